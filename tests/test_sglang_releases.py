"""The release adapters (hs_tracer/integrations/sglang/releases/): one row per family, and the pins
that must agree.

A row says what its family's adapter must give, written out here rather than read back from it: the
releases, the workers, and where its layer-id rules differ from other families', what they make of a
DeepSeek draft config whose first id is not 1 and of a gpt-oss config whose largest id is N. Adding a
release family = one adapter module and one row. The Makefile and pyproject.toml pin SGLang
releases too; they must be the adapters' releases.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
from pathlib import Path

import pytest

from hs_tracer.integrations.sglang import releases as sglang_releases
from hs_tracer.sources import Family, sglang_layers_to_capture

ROOT = Path(__file__).resolve().parents[1]
ADAPTERS = ROOT / "hs_tracer" / "integrations" / "sglang" / "releases"

# (adapter module, its releases, workers, DeepSeek [0, 3, 5] of 8 layers, gpt-oss [24, 30, 36] of 36)
ROWS = [
    ("v0_5_22", ("0.5.22", "0.5.23"), ("V2",), [0, 3, 5], [24, 30, 36]),
    ("v0_5_17", ("0.5.17", "0.5.18", "0.5.19", "0.5.20", "0.5.21"), ("V2",), [0, 3, 5], [24, 30, 36]),
    ("v0_5_16", ("0.5.16",), ("V2",), [0, 3, 5], [25, 31, 37]),
    ("v0_5_13", ("0.5.13", "0.5.14", "0.5.15"), ("V2",), [0, 3, 5], [25, 31, 37]),
    ("v0_5_12", ("0.5.12",), ("V2", "V1"), [1, 4, 6], [25, 31, 37]),
    ("v0_5_11", ("0.5.11",), ("V2", "V1"), [1, 4, 6], [25, 31, 37]),
]


def _adapter_modules() -> list[str]:
    return sorted((m.name for m in pkgutil.iter_modules(sglang_releases.__path__) if m.name.startswith("v")),
                  key=lambda n: [int(p) for p in n[1:].split("_")], reverse=True)


def test_every_adapter_module_is_a_family_in_newest_first_order_with_one_row() -> None:
    modules = _adapter_modules()
    assert [row[0] for row in ROWS] == modules
    families = [importlib.import_module(f"{sglang_releases.__name__}.{m}").FAMILY for m in modules]
    assert list(sglang_releases.FAMILIES) == families
    for module, family in zip(modules, families, strict=True):
        assert module == "v" + family.name.replace(".", "_")  # the module is named by its oldest release
        assert family.releases[0] == family.name


@pytest.mark.parametrize(("module", "releases", "workers", "deepseek", "gpt_oss"), ROWS,
                         ids=[row[0] for row in ROWS])
def test_each_family_as_its_row_says(module: str, releases: tuple[str, ...], workers: tuple[str, ...],
                                     deepseek: list[int], gpt_oss: list[int]) -> None:
    family = importlib.import_module(f"{sglang_releases.__name__}.{module}").FAMILY
    assert family.releases == releases and family.workers == workers
    for release in (*releases, *(f"{r}.post1" for r in releases), *family.check_only):
        assert sglang_releases.family_for(release) is (family if release not in family.check_only else None)
        assert sglang_layers_to_capture([0, 3, 5], Family.DEEPSEEK, 8, engine_version=release) == deepseek
        assert sglang_layers_to_capture([24, 30, 36], Family.GPT_OSS, 36, engine_version=release) == gpt_oss
    assert {h.worker for h in family.hooks} <= {"", *workers}
    assert set(family.worker_env) <= set(workers[1:])  # only a non-default worker needs an environment


def _make_list(name: str) -> list[str]:
    text = (ROOT / "Makefile").read_text().replace("\\\n", " ")
    (value,) = re.findall(rf"^{name} :=(.*)$", text, re.MULTILINE)
    # a whole-list reference, $(OTHER), is OTHER's list
    return [word for part in value.split()
            for word in (_make_list(part[2:-1]) if part.startswith("$(") and part.endswith(")") else [part])]


def test_the_makefiles_releases_are_the_adapters() -> None:
    (newest,) = _make_list("NEWEST_SGLANG")
    old = _make_list("OLD_SGLANG")
    assert newest == sglang_releases.NEWEST_RELEASE
    assert {sglang_releases.release_of(v) for v in (*old, newest)} == set(sglang_releases.SUPPORTED_VERSIONS)
    assert all(sglang_releases.family_for(v) is not None and not sglang_releases.is_untested(v) for v in old)
    for name in ("CHECKED_SGLANG", "ENGINE_EVERY_RUN", "ENGINE_ROTATION"):
        assert set(_make_list(name)) <= set(old), name
    assert _make_list("CHECKED_SGLANG") == old  # every older release's real classes, in every make test
    every_run = {sglang_releases.family_for(v).name for v in _make_list("ENGINE_EVERY_RUN")}
    rotation = [sglang_releases.family_for(v).name for v in _make_list("ENGINE_ROTATION")]
    assert len(set(rotation)) == len(rotation) and not every_run & set(rotation)  # one release per family
    pins = {p.name.removeprefix("sglang-").removesuffix(".txt")
            for p in (ROOT / "requirements").glob("sglang-*.txt")}
    assert pins <= set(old)  # a release's own pins over the lock file, for a release make can build


def test_pyprojects_sglang_pins_are_the_newest_adapters_release() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    pins = re.findall(r'^(\w+) = \[(?:[^]]*?)"sglang==([^"]+)"', text, re.MULTILINE)
    assert pins == [("sglang", sglang_releases.NEWEST_RELEASE), ("testbed", sglang_releases.NEWEST_RELEASE)]


def test_release_numbers_appear_in_hs_tracers_python_only_in_the_adapters() -> None:
    """Every other module takes a release from the adapters (NEWEST_RELEASE, a family's name, the
    checked release), so adding a release edits no module but its adapter."""
    releases = {r for f in sglang_releases.FAMILIES for r in (*f.releases, *f.check_only)}
    named = re.compile(r"(?<![\d.])(" + "|".join(re.escape(r) for r in releases) + r")(?![\d])")
    package = ROOT / "hs_tracer"
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
             for path in sorted(package.rglob("*.py")) if not path.is_relative_to(ADAPTERS)
             for n, line in enumerate(path.read_text().splitlines(), 1) if named.search(line)]
    assert found == []


def test_the_installed_releases_meta_counters_are_the_keys_it_writes() -> None:
    """The counter keys the engine tests and benchmarks read (its family's ``meta_counters``) are the
    ones the installed release's tokenizer manager writes into a response's meta_info: a renamed
    key would make a lossless or agreement check read nothing (make test runs this on every
    supported release)."""
    import importlib.util

    from hs_tracer.integrations.sglang import versions

    spec = importlib.util.find_spec("sglang.srt.managers.tokenizer_manager")
    assert spec is not None and spec.origin is not None
    source = Path(spec.origin).read_text()
    counters = versions.installed_meta_counters()
    for key in (counters.accepted_drafts, counters.accept_histogram):
        assert f'meta_info["{key}"]' in source, (versions.installed_version(), key)

"""The plugin entry point against SGLang's real plugin loader (no engine: see test_engine_*.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from hs_tracer import config


def run_python(code: str, **env: str) -> str:
    """Run code in a fresh interpreter: load_plugins() is once-per-process by design."""
    import os

    full_env = {k: v for k, v in os.environ.items() if not k.startswith("HS_TRACER")}
    full_env.update(env)
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full_env,
                         capture_output=True, text=True, timeout=600, check=True)
    return out.stdout


# Importing every hook target needs an sgl_kernel, which this CPU machine lacks (some releases,
# e.g. 0.5.12, import it at module level): the CPU testbed's stand-in provides it.
WITH_STAND_IN = """
    from hs_tracer_testbed.runtime import launcher
    launcher.prepare_process()
"""


LOAD = """
    import sys
    from sglang.srt.plugins import load_plugins, load_plugins_by_group, GENERAL_PLUGINS_GROUP
    from sglang.srt.plugins.hook_registry import HookRegistry
    print("discovered", sorted(load_plugins_by_group(GENERAL_PLUGINS_GROUP)))
    load_plugins()
    print("registered", sorted(HookRegistry._hooks))
    print("heavy", [m for m in ("prometheus_client", "hs_tracer.integrations.sglang.hooks")
                    if m in sys.modules])
"""


def test_entry_point_discovered_and_inert_without_env() -> None:
    out = run_python(LOAD)
    assert "discovered ['hs_tracer']" in out
    assert "registered []" in out
    assert "heavy []" in out


def test_enabled_outside_a_scheduler_registers_nothing() -> None:
    # The launcher/tokenizer process runs no model: the plugin must not import hook targets there.
    out = run_python(LOAD, HS_TRACER="1")
    assert "registered []" in out
    assert "'prometheus_client'" not in out


@pytest.mark.parametrize(("raw", "on"), [("1", True), ("true", True), ("0", False), ("", False)])
def test_enabled_values(raw: str, on: bool) -> None:
    assert config.enabled({"HS_TRACER": raw}) is on


def test_invalid_settings_are_reported_not_raised(tmp_path) -> None:
    cfg, errors = config.load({"HS_TRACER_SPAN_SAMPLE": "2", "HS_TRACER_PROFILE": str(tmp_path / "x")})
    assert len(errors) == 2
    assert any("HS_TRACER_SPAN_SAMPLE" in e for e in errors)
    assert any("profile build" in e for e in errors)
    assert cfg.span_sample == config.TracerConfig().span_sample


# The checks of the installed release's real classes, in one interpreter (importing every hook target
# takes seconds, and make test runs them on every release): each check prints "ok ..." or its error.
RELEASE_CHECKS = WITH_STAND_IN + r"""
    import dataclasses, importlib, importlib.util, inspect, json, logging, os, pkgutil, re, sys
    import tempfile, traceback
    from pathlib import Path
    from sglang.srt.plugins.hook_registry import HookRegistry
    from hs_tracer.integrations.sglang import releases as sglang_releases
    from hs_tracer.integrations.sglang import draft_layout, plugin, state, versions

    results = {}

    def check(fn):
        try:
            results[fn.__name__] = "ok " + str(fn() or "")
        except BaseException:
            results[fn.__name__] = traceback.format_exc()
        return fn

    @check
    def version_guard():
        family = versions.installed_family()
        # The plugin runs inside the scheduler process, whose modules SGLang has imported by then; a
        # cold first import of 0.5.14's scheduler module stops inside its own import cycle.
        versions.problems()
        assert family is not None and versions.problems() == [], versions.problems()
        # reads and layer-id rules too (the checks an untested release gets), on this release's classes
        assert versions.problems(check_reads=True) == [], versions.problems(check_reads=True)
        logits = next(h for h in family.hooks if h.target.endswith("LogitsProcessor.forward"))
        def only(**change):
            return dataclasses.replace(family, hooks=(dataclasses.replace(logits, **change),))

        assert "missing" in versions.problems(only(target=logits.target + "_gone"))[0]
        assert "no longer takes no_such_arg" in versions.problems(only(params=("no_such_arg",)))[0]
        renamed = dataclasses.replace(family, scheduler_entry=(family.scheduler_entry[0], "run_scheduler_v2"),
                                      hooks=())
        assert "scheduler process entry" in versions.problems(renamed)[0]
        gone = only(reads=("result.no_such_field",))
        assert "no_such_field" in versions.problems(gone, check_reads=True)[0]
        return family.name

    @check
    def post_release():
        # V.post1 keeps V's internals: the guard checks that family's real targets and passes.
        real = versions.installed_version
        release = sglang_releases.release_of(real())
        try:
            versions.installed_version = lambda: release + ".post1"
            assert versions.installed_family() is sglang_releases.family_for(release)
            assert versions.problems() == [], versions.problems()
            versions.installed_version = lambda: release + "rc1"
            assert "not a supported release" in versions.problems()[0]
        finally:
            versions.installed_version = real
        return release

    @check
    def draft_layouts():
        # A norm the layout names but the release's draft class never sets would switch tracing off at
        # startup (0.5.12's LlamaForCausalLMEagle3 has no input_norm); read from the real classes' source.
        modules = {"LlamaForCausalLMEagle3": "sglang.srt.models.llama_eagle3",
                   "Eagle3DeepseekV2ForCausalLM": "sglang.srt.models.kimi_k25_eagle3"}
        for arch, module in modules.items():
            try:
                source = inspect.getsource(pkgutil.resolve_name(module))
            except (ImportError, AttributeError):  # the release does not ship this draft class
                continue
            layout = draft_layout.installed_layouts().get(arch)
            if layout is None:  # read leniently
                continue
            for name in (*layout.norms, "num_aux_hidden_states"):
                assert f"self.{name} =" in source, (arch, name)
            fc = r"self\.fc = (torch\.)?nn\.Linear\(" if layout.fc_width == "in_features" else \
                r"self\.fc = ColumnParallelLinear\("
            assert re.search(fc, source), (arch, layout.fc_width)
        return sorted(draft_layout.installed_layouts())

    @check
    def ranks_and_role():
        # Before sglang.srt.runtime_context (0.5.14) the ranks come from parallel_state/dp_attention; before
        # its get_disagg (0.5.17) the role from the server args (a failure here would switch tracing off).
        from hs_tracer.records import Ranks
        from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler
        set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", device="cpu",
                                                        disaggregation_mode="prefill"))
        ranks = state._ranks()
        assert ranks == (Ranks(), True), ranks  # nothing published: a single rank
        has_disagg = importlib.util.find_spec("sglang.srt.runtime_context") is not None and \
            hasattr(importlib.import_module("sglang.srt.runtime_context"), "get_disagg")
        role = state._role()
        assert role == "prefill", role  # from the runtime context where SGLang has one
        return "runtime context" if has_disagg else "server args"

    @check
    def registration():
        os.environ["HS_TRACER"] = "1"
        HookRegistry.reset()
        plugin._in_scheduler_process = lambda: True
        plugin.register()
        family = versions.installed_family()
        # every hook of the family but a model body whose class is not importable here (a kernel the
        # stand-in lacks, a release without that model): none of its models could be served here
        served = [h for h in family.hooks if not h.optional or versions.importable(h.target)]
        assert all(h.optional for h in family.hooks if h not in served)
        assert sorted(HookRegistry._hooks) == sorted({h.target for h in served})
        names = sorted(fn.__hs_tracer_where__ for hooks in HookRegistry._hooks.values()
                       for _type, fn, _src in hooks)
        assert names == sorted(h.name for h in served), names
        return len(names)

    @check
    def newer_release():
        # This release's files under a newer version string, read as any version is read (the
        # distribution's metadata, first on sys.path): checked against the newest family's targets,
        # parameters, reads and layer-id rule; traced with one "untested release" line when they all
        # match (a release of the newest family), else off naming what changed (an older release).
        real = versions.installed_version()
        fake = tempfile.mkdtemp()
        info = Path(fake, "sglang-0.5.99.dist-info")
        info.mkdir()
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang\nVersion: 0.5.99\n")
        sys.path.insert(0, fake)
        lines = []
        handler = logging.Handler()
        handler.emit = lambda record: lines.append(record.getMessage())
        logging.getLogger("hs_tracer").addHandler(handler)
        try:
            assert versions.installed_version() == "0.5.99" and sglang_releases.is_untested("0.5.99")
            assert versions.installed_family() is sglang_releases.FAMILIES[0]
            HookRegistry.reset()
            plugin.register()
        finally:
            sys.path.remove(fake)
        (line,) = [m for m in lines if "sglang 0.5.99" in m]
        if sglang_releases.family_for(real) is sglang_releases.FAMILIES[0]:
            assert "untested release" in line and "hooks registered" in line, line
            newest = versions.hooks_here(sglang_releases.FAMILIES[0])
            assert sorted(HookRegistry._hooks) == sorted({h.target for h in newest})
            return "traced: " + line
        assert line.startswith("hs_tracer: tracing stays off for this SGLang: "), line
        assert not HookRegistry._hooks
        return "off: " + line

    @check
    def uninstall():
        # Uninstall takes every hook back out of SGLang's registry and puts back the very function each
        # patched attribute held (identity), also under another plugin's hook on the same target, which
        # stays applied.
        from hs_tracer.config import TracerConfig
        from hs_tracer.integrations.sglang.engine import ENGINE
        from sglang.srt.plugins.hook_registry import HookType

        def attr(target):
            owner, _, name = target.rpartition(".")
            return getattr(pkgutil.resolve_name(owner), name)

        HookRegistry.reset()
        family = versions.installed_family()
        served = sorted({h.target for h in versions.hooks_here(family)})
        before = {t: attr(t) for t in served}
        foreign = lambda result, *a, **k: None
        HookRegistry.register(served[0], foreign, HookType.AFTER)
        assert ENGINE.install(TracerConfig()) == len(versions.hooks_here(family))
        HookRegistry.apply_hooks()
        assert all(attr(t) is not before[t] for t in served) and state.current() is not None
        ENGINE.uninstall()
        ENGINE.uninstall()  # a second call finds nothing to undo
        changed = [t for t in served[1:] if attr(t) is not before[t]]
        assert not changed, changed
        assert sorted(HookRegistry._hooks) == [served[0]] and state.current() is None
        kept = attr(served[0])
        assert kept is not before[served[0]] and kept.__wrapped__ is before[served[0]]
        HookRegistry.reset()
        return f"{len(served)} targets restored"

    @check
    def status_reads_no_metadata():
        # status() runs every few seconds in the scheduler process, in the recorder thread holding the
        # scheduler's GIL, once per hand-off. Reading a distribution's metadata scans sys.path (about a
        # millisecond a call), and status() once read it per patched target: tens of ms per call. The
        # installed release's facts are read once, when the state is installed.
        import importlib.metadata
        os.environ["HS_TRACER"] = "1"
        HookRegistry.reset()
        plugin.register()
        HookRegistry.apply_hooks()  # SGLang's load_plugins() applies them right after registering
        st = state.current()
        assert st is not None and HookRegistry._patched, sorted(HookRegistry._patched)
        calls = []
        real = importlib.metadata.version
        importlib.metadata.version = lambda name: calls.append(name) or real(name)
        try:
            applied = [st.status()["hooks_applied"] for _ in range(3)][-1]
        finally:
            importlib.metadata.version = real
        assert calls == [], f"status() read metadata {len(calls)} times: {sorted(set(calls))}"
        assert applied and set(applied) <= {h.target for h in versions.installed_family().hooks}, applied
        return f"{len(applied)} hooks applied, no metadata read"

    print("RESULTS " + json.dumps(results))
"""


@pytest.fixture(scope="module")
def release_checks() -> dict[str, str]:
    out = run_python(RELEASE_CHECKS)
    return json.loads(out.split("RESULTS ", 1)[1])


@pytest.mark.parametrize("name", ["version_guard", "post_release", "draft_layouts", "ranks_and_role",
                                  "registration", "newer_release",
                                  "status_reads_no_metadata", "uninstall"])
def test_the_installed_releases_real_classes(release_checks: dict[str, str], name: str) -> None:
    """The version guard (targets, parameters, reads, layer-id rules), a .postN build, the draft
    classes' layouts, the ranks/role readers, registration of exactly the family's hooks under their
    names, the same files under a newer version string, and a status() that reads no metadata."""
    assert release_checks[name].startswith("ok"), release_checks[name]


def test_a_renamed_scheduler_entry_is_reported_outside_the_scheduler(monkeypatch) -> None:
    # Without the entry the plugin is never called in a scheduler process: it must say so where it
    # does run (launcher, tokenizer), reading SGLang's source without importing it.
    import dataclasses

    from hs_tracer.integrations.sglang import plugin, versions
    from hs_tracer.integrations.sglang import releases as sglang_releases

    family = versions.installed_family()
    assert plugin._entry_problem() is None
    renamed = dataclasses.replace(family, scheduler_entry=(family.scheduler_entry[0], "run_scheduler_v2"))
    monkeypatch.setattr(sglang_releases, "family_for", lambda _v: renamed)
    assert "no scheduler entry sglang.srt.managers.scheduler.run_scheduler_v2" in plugin._entry_problem()
    monkeypatch.setattr(sglang_releases, "family_for", lambda _v: None)
    assert "not a supported release" in plugin._entry_problem()
    # a newer release, checked as the newest
    monkeypatch.setattr(sglang_releases, "family_for", lambda _v: family)
    assert plugin._entry_problem() is None


@pytest.mark.parametrize(("version", "family"), [
    ("0.5.23", "0.5.22"), ("0.5.23.post1", "0.5.22"), ("0.5.22", "0.5.22"), ("0.5.21", "0.5.17"),
    ("0.5.17", "0.5.17"), ("0.5.16", "0.5.16"), ("0.5.15.post1", "0.5.13"), ("0.5.13", "0.5.13"),
    ("0.5.12", "0.5.12"), ("0.5.12.post3", "0.5.12"), ("0.5.11", "0.5.11"),
    ("0.5.10", None), ("0.5.23rc1", None), ("0.5.24rc1", None), ("0.5.24.dev0", None), (None, None),
    ("0.5.24", "0.5.22"), ("0.5.230", "0.5.22"), ("0.6.0", "0.5.22"),  # newer: checked as the newest family
])
def test_release_families_accept_post_releases_and_check_newer_ones(version: str | None,
                                                                    family: str | None) -> None:
    from hs_tracer.integrations.sglang import releases as sglang_releases

    found = sglang_releases.family_for(version)
    assert (found.name if found else None) == family
    assert sglang_releases.is_untested(version) is (
        family is not None and version is not None
        and version.split(".post")[0] not in sglang_releases.SUPPORTED_VERSIONS)
    assert ("untested" in sglang_releases.support(version)) is sglang_releases.is_untested(version)


def test_every_release_from_0_5_11_to_0_5_23_is_in_one_family() -> None:
    from hs_tracer.integrations.sglang import releases as sglang_releases

    releases = [f"0.5.{n}" for n in range(11, 24)]
    assert sorted(sglang_releases.SUPPORTED_VERSIONS, key=lambda r: int(r.split(".")[2])) == releases
    assert sglang_releases.NEWEST_RELEASE == "0.5.23"
    assert sglang_releases.FAMILIES[0].releases[-1] == "0.5.23"


def test_every_hook_of_every_family_resolves_and_is_named_once() -> None:
    import inspect
    import pkgutil

    from hs_tracer.integrations.sglang import releases as sglang_releases

    for family in sglang_releases.FAMILIES:
        assert len({h.name for h in family.hooks}) == len(family.hooks), family.name
        for hook in family.hooks:
            handler = pkgutil.resolve_name(hook.handler)
            assert inspect.isfunction(handler) and next(iter(inspect.signature(handler).parameters)) == "st"
            assert hook.type in ("before", "after") and hook.worker in ("", *family.workers)



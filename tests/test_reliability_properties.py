"""Property-based: damaged inputs of every kind, for every command: exit 2 in one line or a valid report.

Hypothesis mutates valid inputs (a capture, a profile, a draft checkpoint, a target config, server
args, HS_TRACER_* settings): truncates and flips bytes, drops keys, changes value types, swaps
fields. For each mutated input the command must either exit 2 with exactly one line on stderr, or
exit 0/1 with a parseable report; it must never raise (a traceback) and never touch a file outside
its declared output. ``derandomize`` keeps CI reproducible; the example counts keep this file to
about a minute on a 2-core machine.

``hs-tracer demo`` is left out (a valid mutation would start SGLang): its inputs go through the same
validators as ``check`` (target and draft) and ``diagnose`` (profile).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import io
import json
import shutil
import struct
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reliability_inputs import SERVER_ARGS, Inputs, make_inputs

from hs_tracer.cli import main
from hs_tracer.inputs import env
from hs_tracer.inputs.server_args import SGLANG_SPECULATIVE_FLAGS
from hs_tracer.profile.capture_format import MANIFEST

EXAMPLES = 30
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Inputs:
    return make_inputs(tmp_path_factory.mktemp("base"))


# ---- mutations -------------------------------------------------------------------------------------
def _header_len(data: bytes) -> int:
    return 8 + struct.unpack("<Q", data[:8])[0] if len(data) >= 8 else len(data)


@st.composite
def byte_mutation(draw: st.DrawFn) -> Callable[[bytes], bytes]:
    """Truncate, flip, insert or delete bytes; half of the positions fall in a safetensors header."""
    kind = draw(st.sampled_from(["truncate", "flip", "insert", "delete"]))
    frac = draw(st.floats(0, 1))
    in_header = draw(st.booleans())
    blob = draw(st.binary(min_size=1, max_size=16))

    def apply(data: bytes) -> bytes:
        span = min(_header_len(data), len(data)) if in_header else len(data)
        pos = min(int(frac * span), max(len(data) - 1, 0))
        if kind == "truncate":
            return data[:pos]
        if kind == "flip":
            return data[:pos] + bytes([data[pos] ^ (blob[0] or 1)]) + data[pos + 1:] if data else data
        if kind == "insert":
            return data[:pos] + blob + data[pos:]
        return data[:pos] + data[pos + len(blob):]

    return apply


_ODD_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**63), st.sampled_from(
    [float("nan"), float("inf"), -1.5, 0, -1, 10**12]), st.text(max_size=8), st.lists(st.integers(-3, 99),
                                                                                      max_size=4),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2), st.just("../../etc/passwd"),
    st.just("/etc/hostname"))


@st.composite
def json_mutation(draw: st.DrawFn) -> Callable[[Any], Any]:
    """Drop a key, change a value's type, swap two values, or edit inside a list (also nested)."""
    kind = draw(st.sampled_from(["drop", "retype", "swap", "list"]))
    pick = draw(st.integers(0, 10**6))
    pick2 = draw(st.integers(0, 10**6))
    value = draw(_ODD_VALUES)

    def paths(obj: Any, prefix: tuple = ()) -> list[tuple]:
        out = []
        if isinstance(obj, dict):
            for k, v in obj.items():
                out.append((*prefix, k))
                out += paths(v, (*prefix, k))
        elif isinstance(obj, list):
            for i, v in enumerate(obj[:4]):
                out.append((*prefix, i))
                out += paths(v, (*prefix, i))
        return out

    def apply(obj: Any) -> Any:
        obj = copy.deepcopy(obj)
        all_paths = paths(obj)
        if not all_paths:
            return value
        path = all_paths[pick % len(all_paths)]
        parent = obj
        for key in path[:-1]:
            parent = parent[key]
        last = path[-1]
        if kind == "drop":
            del parent[last]
        elif kind == "retype":
            parent[last] = value
        elif kind == "swap":
            other = all_paths[pick2 % len(all_paths)]
            holder = obj
            for key in other[:-1]:
                holder = holder[key]
            try:
                parent[last], holder[other[-1]] = holder[other[-1]], parent[last]
            except (KeyError, IndexError, TypeError):
                parent[last] = value
        elif isinstance(parent[last], list):
            parent[last] = [*parent[last], value][::-1]
        else:
            parent[last] = [parent[last], value]
        return obj

    return apply


def mutate_json_file(path: Path, mutation: Callable[[Any], Any]) -> None:
    path.write_text(json.dumps(mutation(json.loads(path.read_text()))))


def mutate_profile_meta(path: Path, mutation: Callable[[Any], Any]) -> None:
    """Rewrite a profile with its provenance mutated, keeping the safetensors structure valid."""
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    meta = json.loads(header["__metadata__"]["hs_tracer_profile"])
    header["__metadata__"]["hs_tracer_profile"] = json.dumps(mutation(meta))
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:])


# ---- the invariant ---------------------------------------------------------------------------------
def _tree(root: Path) -> dict[str, tuple[int, str]]:
    return {str(p.relative_to(root)): (p.lstat().st_mode, hashlib.sha1(p.read_bytes()).hexdigest()
                                       if p.is_file() and not p.is_symlink() else "")
            for p in sorted(root.rglob("*"))}


def assert_clean_outcome(root: Path, argv: list[str], output: Path | None = None) -> int:
    """Run ``argv``: exit 2 in one line, or 0/1 with a report; nothing but ``output`` changed."""
    before = _tree(root)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code = main(argv)  # an exception escaping here is the traceback this test forbids
    assert code in (0, 1, 2), (code, err.getvalue())
    if code == 2:
        lines = err.getvalue().strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in err.getvalue(), err.getvalue()
    elif "--json" in argv:
        json.loads(out.getvalue()[out.getvalue().index("{"):])
    else:
        assert out.getvalue().strip(), "a report was expected"
    after = _tree(root)
    if output is not None:
        after.pop(str(output.relative_to(root)), None)
        before.pop(str(output.relative_to(root)), None)
    assert after == before, "a file other than the output was created, changed or removed"
    return code


@contextlib.contextmanager
def workdir(base: Inputs):
    with tempfile.TemporaryDirectory(prefix="hs-tracer-prop-") as tmp:
        root = Path(tmp)
        for name in ("capture", "draft", "target"):
            shutil.copytree(getattr(base, name), root / name)
        shutil.copy(base.profile, root / "ref.profile")
        yield root


# ---- one property per command and input ------------------------------------------------------------
@SETTINGS
@given(mutation=st.one_of(byte_mutation(), json_mutation()))
def test_profile_show_and_merge(base: Inputs, mutation) -> None:
    with workdir(base) as root:
        p = root / "ref.profile"
        _mutate_capture_or_profile(root, mutation, "profile")
        assert_clean_outcome(root, ["profile", "show", "--json", str(p)])
        shutil.copy(base.profile, root / "good.profile")
        out = root / "merged.profile"
        assert_clean_outcome(root, ["profile", "merge", str(p), str(root / "good.profile"), "-o", str(out)],
                             output=out)


@SETTINGS
@given(mutation=st.one_of(byte_mutation(), json_mutation()), target=st.sampled_from(["manifest", "shard",
                                                                                     "profile"]))
def test_diagnose(base: Inputs, mutation, target: str) -> None:
    with workdir(base) as root:
        _mutate_capture_or_profile(root, mutation, target)
        assert_clean_outcome(root, ["diagnose", str(root / "capture"), "--profile", str(root / "ref.profile"),
                                    "--json"])


@SETTINGS
@given(mutation=st.one_of(byte_mutation(), json_mutation()), target=st.sampled_from(["manifest", "shard"]))
def test_profile_build(base: Inputs, mutation, target: str) -> None:
    with workdir(base) as root:
        _mutate_capture_or_profile(root, mutation, target)
        out = root / "built.profile"
        argv = ["profile", "build", str(root / "capture"), "-o", str(out), "--no-progress"]
        assert_clean_outcome(root, argv, output=out)


@settings(SETTINGS, max_examples=EXAMPLES // 2)
@given(mutation=st.one_of(byte_mutation(), json_mutation()), target=st.sampled_from(["manifest", "shard",
                                                                                     "draft_config"]))
def test_replay(base: Inputs, mutation, target: str) -> None:
    with workdir(base) as root:
        if target == "draft_config":
            _mutate(root / "draft" / "config.json", mutation)
        else:
            _mutate_capture_or_profile(root, mutation, target)
        assert_clean_outcome(root, ["replay", str(root / "capture"), "--draft", str(root / "draft"),
                                    "--target", str(root / "target"), "--max-tokens", "200", "--json"])


_WORDS = st.sampled_from([*sorted(SGLANG_SPECULATIVE_FLAGS), "EAGLE3", "EAGLE", "3", "0", "-1", "x", "1",
                          "'", "--model-path", "=", "--speculative"])


@SETTINGS
@given(mutation=st.one_of(byte_mutation(), json_mutation()),
       target=st.sampled_from(["draft_config", "draft_weights", "target_config", "server_args"]),
       words=st.lists(_WORDS, max_size=6))
def test_check(base: Inputs, mutation, target: str, words: list[str]) -> None:
    with workdir(base) as root:
        server_args = SERVER_ARGS
        if target == "draft_config":
            _mutate(root / "draft" / "config.json", mutation)
        elif target == "draft_weights":
            f = root / "draft" / "model.safetensors"
            f.write_bytes(_as_bytes(mutation)(f.read_bytes()))
        elif target == "target_config":
            _mutate(root / "target" / "config.json", mutation)
        else:
            server_args = " ".join([*SERVER_ARGS.split()[:2], *words])
        assert_clean_outcome(root, ["check", "--draft", str(root / "draft"), "--target", str(root / "target"),
                                    "--profile", str(root / "ref.profile"), "--server-args", server_args,
                                    "--json"])


@settings(SETTINGS, max_examples=EXAMPLES * 3)
@given(values=st.dictionaries(st.sampled_from([*sorted(env.config.VARIABLES), "HS_TRACER_PROFLE"]),
                              st.one_of(st.text(max_size=12), st.sampled_from(
                                  ["0", "1", "-1", "nan", "inf", "65536", "0.5", "1e3", "/nonexistent/x",
                                   "/dev/null", "/"]))))
def test_env_settings_never_raise_and_fail_in_one_line(values: dict[str, str]) -> None:
    _cfg, line = env.validate({"HS_TRACER": "1", **values})
    assert line is None or ("\n" not in line and "tracing stays off" in line)


@settings(SETTINGS, max_examples=10)
@given(names=st.lists(st.sampled_from(["manifest.json", "notes.txt", "target", "data", "x.safetensors"]),
                      min_size=1, max_size=3, unique=True))
def test_testbed_build_never_touches_a_foreign_dir(names: list[str]) -> None:
    with tempfile.TemporaryDirectory(prefix="hs-tracer-prop-") as tmp:
        out = Path(tmp) / "out"
        out.mkdir()
        for name in names:
            (out / name).write_text(json.dumps({"format": "hs_tracer_capture"}))
        argv = ["testbed", "build", "--out", str(out), "--small", "--quiet"]
        assert assert_clean_outcome(Path(tmp), argv) == 2


# ---- helpers ---------------------------------------------------------------------------------------
def _is_bytes_mutation(mutation: Callable) -> bool:
    return mutation.__code__.co_varnames[:1] == ("data",)


def _as_bytes(mutation: Callable) -> Callable[[bytes], bytes]:
    if _is_bytes_mutation(mutation):
        return mutation
    return lambda data: json.dumps(mutation(data.decode("latin-1"))).encode()


def _mutate(path: Path, mutation: Callable) -> None:
    if _is_bytes_mutation(mutation):
        path.write_bytes(mutation(path.read_bytes()))
    else:
        mutate_json_file(path, mutation)


def _mutate_capture_or_profile(root: Path, mutation: Callable, target: str) -> None:
    if target == "manifest":
        _mutate(root / "capture" / MANIFEST, mutation)
    elif target == "shard":
        shard = sorted((root / "capture").glob("*.safetensors"))[0]
        if _is_bytes_mutation(mutation):
            shard.write_bytes(mutation(shard.read_bytes()))
        else:  # a mutated safetensors header, structure kept
            data = shard.read_bytes()
            n = struct.unpack("<Q", data[:8])[0]
            raw = json.dumps(mutation(json.loads(data[8:8 + n]))).encode()
            shard.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:])
    elif _is_bytes_mutation(mutation):
        p = root / "ref.profile"
        p.write_bytes(mutation(p.read_bytes()))
    else:
        mutate_profile_meta(root / "ref.profile", mutation)

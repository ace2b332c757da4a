"""Bad input gets one line and exit 2; nothing the tool did not create is lost, overwritten or re-moded.

One test per problem found by trying hs-tracer with damaged and hostile inputs (docs/reliability.md).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import stat
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from reliability_inputs import SERVER_ARGS, Inputs, make_inputs, write_atlas, write_capture
from test_check_drafts import draft_state, specforge_draft

from hs_tracer.cli import main
from hs_tracer.inputs import env
from hs_tracer.profile.capture_format import MANIFEST, CaptureManifest, CaptureWriter


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> Inputs:
    return make_inputs(tmp_path_factory.mktemp("inputs"))


def run(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str]:
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out + out.err


def one_line_error(capsys: pytest.CaptureFixture[str], *argv: object) -> str:
    """Run; assert exit 2 with exactly one stderr line and no traceback; return that line."""
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def snapshot(root: Path) -> dict[str, tuple[int, int, bytes | None]]:
    """Every path under ``root`` with its mode, size and content: to prove nothing was touched."""
    out = {}
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        out[str(p.relative_to(root))] = (st.st_mode, st.st_size, p.read_bytes() if p.is_file() else None)
    return out


# ---- data loss --------------------------------------------------------------------------------------
def test_testbed_build_refuses_a_capture_dir_and_keeps_it(tmp_path: Path, capsys) -> None:
    cap = write_capture(tmp_path / "cap", shards=1, rows=8)
    (cap / "notes.txt").write_text("my notes")
    before = snapshot(tmp_path)
    line = one_line_error(capsys, "testbed", "build", "--out", cap, "--small", "--quiet")
    assert "not a testbed build" in line and str(cap) in line
    assert snapshot(tmp_path) == before


def test_only_an_earlier_testbed_build_counts_as_replaceable(tmp_path: Path) -> None:
    from hs_tracer.commands.testbed import _earlier_build

    out = tmp_path / "tb"
    for d in ("target", "draft", "data"):
        (out / d).mkdir(parents=True)
    (out / "manifest.json").write_text(json.dumps({"format": 1, "recipe_hash": "x"}))
    assert _earlier_build(out)
    (out / "notes.txt").write_text("mine")
    assert not _earlier_build(out)


# ---- permissions -----------------------------------------------------------------------------------
def test_capture_writer_keeps_the_mode_of_an_existing_dir(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    CaptureWriter(shared, CaptureManifest(num_slots=1, hidden_size=4)).write_manifest()
    assert stat.S_IMODE(shared.stat().st_mode) == 0o1777
    fresh = tmp_path / "fresh" / "cap"
    CaptureWriter(fresh, CaptureManifest(num_slots=1, hidden_size=4))
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o700


# ---- overwrites ------------------------------------------------------------------------------------
def test_profile_build_with_mismatched_inputs_leaves_the_output_alone(inputs: Inputs, tmp_path: Path,
                                                                     capsys) -> None:
    good = tmp_path / "good.profile"
    shutil.copy(inputs.profile, good)
    before = good.read_bytes()
    other = write_capture(tmp_path / "narrow", hidden=32, shards=1, rows=64)
    one_line_error(capsys, "profile", "build", inputs.capture, other, "-o", good, "--no-progress")
    atlas = write_atlas(tmp_path / "atlas", hidden=32)
    one_line_error(capsys, "profile", "build", inputs.capture, "--atlas", atlas, "-o", good,
                   "--no-progress")
    one_line_error(capsys, "profile", "build", inputs.capture, "-o", inputs.capture / MANIFEST)
    assert good.read_bytes() == before
    assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob(".*.tmp"))


def test_profile_merge_refuses_to_overwrite_an_input(inputs: Inputs, tmp_path: Path, capsys) -> None:
    a = tmp_path / "a.profile"
    shutil.copy(inputs.profile, a)
    before = a.read_bytes()
    line = one_line_error(capsys, "profile", "merge", a, a, "-o", a)
    assert "is also an input" in line
    assert a.read_bytes() == before


def test_a_failed_save_leaves_no_temporary_file(inputs: Inputs, tmp_path: Path) -> None:
    from hs_tracer.profile.model import Profile

    (tmp_path / "out.profile").mkdir()  # the rename onto it fails
    with pytest.raises(OSError):
        Profile.load(inputs.profile).save(tmp_path / "out.profile")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.profile"]


# ---- trusting headers ------------------------------------------------------------------------------
def test_check_refuses_a_truncated_safetensors_draft(inputs: Inputs, tmp_path: Path, capsys) -> None:
    draft = tmp_path / "draft"
    shutil.copytree(inputs.draft, draft)
    weights = draft / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])  # an interrupted download
    line = one_line_error(capsys, "check", "--draft", draft, "--target", inputs.target)
    assert "model.safetensors" in line and "truncated" in line


@pytest.mark.parametrize("entry", [
    {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]},  # bytes do not match the shape
    {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},  # leaves a gap
    {"dtype": "Q9", "shape": [2], "data_offsets": [0, 8]},  # no such dtype
    {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]},
])
def test_safetensors_header_checks(tmp_path: Path, entry: dict) -> None:
    from hs_tracer.preflight.safetensors_header import SafetensorsError, read_header

    header = json.dumps({"x": entry}).encode()
    path = tmp_path / "x.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 12)
    with pytest.raises(SafetensorsError):
        read_header(path)


# ---- paths -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink"])
def test_capture_shards_must_stay_inside_the_capture(inputs: Inputs, tmp_path: Path, capsys,
                                                     how: str) -> None:
    outside = write_capture(tmp_path / "outside", shards=1, rows=300)
    cap = tmp_path / "cap"
    shutil.copytree(inputs.capture, cap)
    manifest = json.loads((cap / MANIFEST).read_text())
    name = manifest["shards"][0]["file"]
    if how == "dotdot":
        manifest["shards"][0]["file"] = f"../outside/{name}"
    elif how == "absolute":
        manifest["shards"][0]["file"] = str(outside / name)
    else:
        (cap / name).unlink()
        (cap / name).symlink_to(outside / name)
    (cap / MANIFEST).write_text(json.dumps(manifest))
    one_line_error(capsys, "diagnose", cap, "--profile", inputs.profile)
    one_line_error(capsys, "replay", cap, "--draft", inputs.draft)


# ---- late failures ---------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("setting", ["port_range", "port_busy", "corrupt_profile", "report_dir_file",
                                     "misspelt", "nan_rate"])
def test_plugin_settings_fail_in_one_line(tmp_path: Path, setting: str, caplog) -> None:
    from hs_tracer.integrations.sglang import plugin

    corrupt = tmp_path / "bad.profile"
    corrupt.write_bytes(b"\x10\0\0\0\0\0\0\0{not json at all}")
    (tmp_path / "file").write_text("")
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    environ = {
        "port_range": {"HS_TRACER_METRICS_PORT": "70000"},
        "port_busy": {"HS_TRACER_METRICS_PORT": str(busy.getsockname()[1]),
                      "HS_TRACER_METRICS_ADDR": "127.0.0.1"},
        "corrupt_profile": {"HS_TRACER_PROFILE": str(corrupt)},
        "report_dir_file": {"HS_TRACER_REPORT_DIR": str(tmp_path / "file")},
        "misspelt": {"HS_TRACER_PROFILES": str(corrupt)},
        "nan_rate": {"HS_TRACER_CAPTURE_RATE": "nan"},
    }[setting]
    name = next(iter(environ)).replace("HS_TRACER_PROFILES", "HS_TRACER_PROFILE")
    try:
        _cfg, line = env.validate({"HS_TRACER": "1", **environ})
        assert line is not None and name in line and "\n" not in line
        caplog.set_level(logging.DEBUG, logger="hs_tracer")
        old = dict(os.environ)
        os.environ.update({"HS_TRACER": "1", **environ})
        try:
            plugin._register()
        finally:
            os.environ.clear()
            os.environ.update(old)
    finally:
        busy.close()
    records = [r for r in caplog.records if r.name == "hs_tracer"]
    assert len(records) == 1 and records[0].exc_info is None
    assert "tracing stays off" in records[0].getMessage()


def test_valid_settings_pass(inputs: Inputs, tmp_path: Path) -> None:
    _cfg, line = env.validate({"HS_TRACER": "1", "HS_TRACER_PROFILE": str(inputs.profile),
                               "HS_TRACER_REPORT_DIR": str(tmp_path / "new" / "reports"),
                               "HS_TRACER_METRICS_PORT": str(_free_port()),
                               "HS_TRACER_TESTBED_DIR": "/elsewhere"})
    assert line is None
    assert not (tmp_path / "new").exists()  # validation creates nothing


# ---- tracebacks that exited 1 ----------------------------------------------------------------------
def test_malformed_inputs_exit_2_in_one_line(inputs: Inputs, tmp_path: Path, capsys) -> None:
    junk = tmp_path / "junk.profile"
    junk.write_bytes(os.urandom(64))
    one_line_error(capsys, "profile", "show", junk)
    one_line_error(capsys, "diagnose", inputs.capture, "--profile", junk)
    cap = tmp_path / "cap"
    shutil.copytree(inputs.capture, cap)
    (cap / MANIFEST).write_text(json.dumps({**json.loads((cap / MANIFEST).read_text()), "num_slots": "x"}))
    one_line_error(capsys, "diagnose", cap, "--profile", inputs.profile)
    draft = tmp_path / "draft"
    shutil.copytree(inputs.draft, draft)
    (draft / "config.json").write_text(json.dumps({**json.loads((draft / "config.json").read_text()),
                                                   "hidden_size": "64"}))
    one_line_error(capsys, "check", "--draft", draft, "--target", inputs.target)
    one_line_error(capsys, "profile", "build", inputs.capture, "-o", tmp_path / "no" / "such" / "dir.p")
    one_line_error(capsys, "profile", "build", inputs.capture, "-o", tmp_path / ("x" * 300))
    one_line_error(capsys, "profile", "merge", inputs.profile, "-o", tmp_path)


def test_a_closed_output_pipe_is_not_a_traceback(inputs: Inputs) -> None:
    cmd = [sys.executable, "-m", "hs_tracer.cli", "profile", "show", "--json", str(inputs.profile)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader went away (`| head -0`)
    err = proc.stderr.read().decode()
    proc.wait(timeout=120)
    assert "Traceback" not in err and "BrokenPipe" not in err, err
    assert proc.returncode != 0


def test_debug_shows_the_traceback(capsys, tmp_path: Path) -> None:
    assert main(["--debug", "profile", "show", str(tmp_path / "missing")]) == 2
    assert main(["--debug", "profile", "merge", str(tmp_path / "missing"), "-o", str(tmp_path)]) == 2
    assert "Traceback" in capsys.readouterr().err


def test_a_defect_is_an_internal_error_not_a_usage_error(inputs: Inputs, capsys, monkeypatch) -> None:
    """A ValueError from hs_tracer's own code is a bug: exit 1 and a line asking for a report, not
    "usage error" (exit 2) as if the input were wrong; --debug adds the traceback."""
    from hs_tracer.profile import model

    def defect(*_a, **_k):
        raise ValueError("an internal invariant broke")

    monkeypatch.setattr(model.Profile, "summary", defect)
    assert main(["profile", "show", str(inputs.profile)]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "internal error" in err and "an internal invariant broke" in err
    assert "report" in err and "--debug" in err and "Traceback" not in err
    assert main(["--debug", "profile", "show", str(inputs.profile)]) == 1
    assert "Traceback" in capsys.readouterr().err


# ---- inputs that do not belong together ------------------------------------------------------------
def test_profile_of_another_hidden_size_is_an_input_error(inputs: Inputs, tmp_path: Path, capsys) -> None:
    cap = write_capture(tmp_path / "cap32", hidden=32, shards=1, rows=300)
    line = one_line_error(capsys, "diagnose", cap, "--profile", inputs.profile)
    assert "the profile is of another model (hidden size 64, this model's is 32)" in line


def test_capture_mixing_two_wirings_is_an_input_error(inputs: Inputs, tmp_path: Path, capsys) -> None:
    cap = tmp_path / "cap"
    shutil.copytree(inputs.capture, cap)
    m = json.loads((cap / MANIFEST).read_text())
    m["wiring"] = {"sources": ["embedding", "block:1", "block:2"], "hidden_size": m["hidden_size"]}
    (cap / MANIFEST).write_text(json.dumps(m))
    assert "mixed wirings" in one_line_error(capsys, "diagnose", cap, "--profile", inputs.profile)


@pytest.mark.parametrize("flag,value", [("--unknown-factor", "0"), ("--unknown-factor", "nan"),
                                        ("--drift-factor", "inf"), ("--min-tokens", "0"),
                                        ("--rho-min", "-1")])
def test_tuning_options_out_of_range(inputs: Inputs, capsys, flag: str, value: str) -> None:
    line = one_line_error(capsys, "diagnose", inputs.capture, "--profile", inputs.profile, flag, value)
    assert flag in line


@pytest.mark.parametrize("args,expect", [
    ("--speculative-algorithm EAGLE3 --speculative-num-stepz 3", "did you mean --speculative-num-steps"),
    ("--speculative-num-steps 3 --speculative-eagle-topk 1", "no --speculative-algorithm"),
    ("--speculative-algorithm NGRAM", "does not run an EAGLE draft"),
    ("--speculative-algorithm EAGLE3 --speculative-num-steps 0", "positive"),
    ("--speculative-algorithm EAGLE3 --speculativ-num-steps 3", "did you mean"),
])
def test_server_args_sglang_would_refuse(inputs: Inputs, capsys, args: str, expect: str) -> None:
    line = one_line_error(capsys, "check", "--draft", inputs.draft, "--target", inputs.target,
                          "--server-args", args)
    assert "--server-args" in line and expect in line


def test_known_speculative_flags_are_sglangs() -> None:
    import argparse

    from sglang.srt.server_args import ServerArgs

    from hs_tracer.inputs.server_args import SGLANG_SPECULATIVE_FLAGS

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    flags = {o for a in parser._actions for o in a.option_strings if "speculative" in o}
    assert flags == SGLANG_SPECULATIVE_FLAGS


def test_valid_server_args_still_pass(inputs: Inputs, capsys) -> None:
    code, out = run(capsys, "check", "--draft", inputs.draft, "--target", inputs.target, "--server-args",
                    f"python -m sglang.launch_server --model-path x {SERVER_ARGS}")
    assert code == 0, out


def test_replay_reports_non_finite_features_as_a_finding(tmp_path: Path, capsys) -> None:
    """NaN rows are left out of the agreement and named, never averaged into the verdict."""
    from test_check_drafts import target_config

    draft = specforge_draft(tmp_path / "draft", layer_ids=[1, 3, 4], state=draft_state(with_embed=True))
    target_config(tmp_path / "target")
    cap = write_capture(tmp_path / "cap", shards=2, rows=40, nan=True)
    code, out = run(capsys, "replay", cap, "--draft", draft, "--json")
    report = json.loads(out[out.index("{"):])
    codes = [f["code"] for f in report["findings"]]
    assert codes == ["non_finite_features"] and code == 1
    assert report["capture"]["sequences"] == 1  # the shard holding NaN rows is left out

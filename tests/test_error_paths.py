"""The places a newcomer gets stuck, run as they happen: each gives one correct line and the right fix.

1. a mistyped ``HS_TRACER_*`` variable stops ``hs-tracer demo`` (and the testbed launcher) before
   any engine starts, with the plugin's own "did you mean" line;
2. a profile of another model is named as the cause, in one line, by every command, before anything
   could blame the draft; the live diagnosis says so and leaves the profile unused;
3. ids moved to the top level of config.json: the fix moves the key back under ``eagle_config``;
4. ``check`` without ``--profile`` says what it did not compare; an fc of the wrong width is a shape
   error, not also "missing weights".
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from hs_tracer.cli import main
from hs_tracer_testbed import build as tb


@pytest.fixture(scope="module")
def testbed() -> tb.TestbedPaths:
    return tb.ensure_testbed(progress=False)


@pytest.fixture(scope="module")
def profile(testbed: tb.TestbedPaths) -> Path:
    from hs_tracer_testbed.demo import testbed_profile

    return testbed_profile(testbed)



def _cli(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def _draft(testbed: tb.TestbedPaths, dst: Path, edit) -> Path:
    shutil.copytree(testbed.draft, dst)
    cfg = json.loads((dst / "config.json").read_text())
    edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def _no_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any engine start fails the test: the problem must be reported before one."""
    import hs_tracer_testbed.demo as demo
    from hs_tracer_testbed.runtime import launcher

    def started(*_a, **_k):
        raise AssertionError("an engine was started")

    monkeypatch.setattr(demo, "run_engine", started)
    monkeypatch.setattr(launcher, "prepare_process", started)


# ---- 1. a mistyped variable -------------------------------------------------------------------------

def test_demo_reports_a_mistyped_variable_before_any_engine(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    _no_engine(monkeypatch)
    monkeypatch.setenv("HS_TRACER_CAPTUR_DIR", str(tmp_path / "capture"))
    code, out, err = _cli(capsys, "demo")
    assert code == 2 and out == ""
    assert err.splitlines() == ["hs-tracer demo: error: HS_TRACER_CAPTUR_DIR is not an hs_tracer setting; "
                                "did you mean HS_TRACER_CAPTURE_DIR?"]


def test_demo_reports_a_bad_value_before_any_engine(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    _no_engine(monkeypatch)
    monkeypatch.setenv("HS_TRACER_CAPTURE_RATE", "2")
    code, _out, err = _cli(capsys, "demo")
    assert code == 2 and "HS_TRACER_CAPTURE_RATE='2' must be a fraction between 0 and 1" in err
    assert err.count("\n") == 1


def test_demo_refuses_a_bad_value_of_a_setting_it_replaces(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The demo sets HS_TRACER_WINDOW_TOKENS for its engines; the caller's invalid value still stops it."""
    _no_engine(monkeypatch)
    monkeypatch.setenv("HS_TRACER_WINDOW_TOKENS", "lots")
    code, _out, err = _cli(capsys, "demo")
    assert code == 2 and err.count("\n") == 1 and "HS_TRACER_WINDOW_TOKENS='lots'" in err


def test_demo_names_the_settings_it_replaces(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    _no_engine(monkeypatch)
    monkeypatch.setenv("HS_TRACER_WINDOW_TOKENS", "64")
    monkeypatch.setenv("HS_TRACER_REPORT_DIR", str(tmp_path))
    code, _out, err = _cli(capsys, "demo", "--prompts", "0")  # stops after the settings' check
    lines = err.splitlines()
    assert code == 2 and lines[-1].startswith("hs-tracer demo: error: --prompts")
    assert lines[:-1] == [
        "hs-tracer demo runs its engines with HS_TRACER_WINDOW_TOKENS=128; your HS_TRACER_WINDOW_TOKENS=64 "
        "is not used",
        f"hs-tracer demo runs its engines with HS_TRACER_REPORT_DIR set to a temporary folder per engine; "
        f"your HS_TRACER_REPORT_DIR={tmp_path} is not used"]


def test_launcher_refuses_bad_settings_before_the_engine(
        monkeypatch: pytest.MonkeyPatch, testbed: tb.TestbedPaths) -> None:
    from hs_tracer.errors import InputError
    from hs_tracer_testbed.runtime.launcher import start_engine

    _no_engine(monkeypatch)
    with pytest.raises(InputError, match="did you mean HS_TRACER_WINDOW_TOKENS"):
        start_engine(testbed.target, testbed.draft, env={"HS_TRACER": "1", "HS_TRACER_WINDOW_TOKEN": "64"})


def test_production_keeps_reporting_at_startup() -> None:
    """The plugin's own check is the same rule: one log line, tracing off (what the launcher raises)."""
    from hs_tracer.inputs import env

    _cfg, line = env.validate({"HS_TRACER": "1", "HS_TRACER_CAPTUR_DIR": "/tmp/x"})
    assert line == ("hs_tracer: tracing stays off, invalid settings: HS_TRACER_CAPTUR_DIR is not an "
                    "hs_tracer setting; did you mean HS_TRACER_CAPTURE_DIR?")


# ---- 2. a profile of another model -----------------------------------------------------------------

OTHER = "the profile is of another model (hidden size 32, this model's is 64"


def test_check_names_a_profile_of_another_model(
        testbed: tb.TestbedPaths, small_profile: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _cli(capsys, "check", "--draft", testbed.draft, "--target", testbed.target,
                          "--profile", small_profile)
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert OTHER in err and "use the profile built for this target's training data" in err
    assert "retrain" not in err and "trained on another target" not in err


def test_demo_names_a_profile_of_another_model_before_any_engine(
        monkeypatch: pytest.MonkeyPatch, testbed: tb.TestbedPaths, small_profile: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    _no_engine(monkeypatch)
    code, out, err = _cli(capsys, "demo", "--profile", small_profile)
    assert code == 2 and out == ""
    assert err.splitlines()[-1].startswith("hs-tracer demo: error: target ") and OTHER in err


def test_live_diagnosis_names_a_profile_of_another_model(small_profile: Path) -> None:
    """The plugin's startup: the profile is set aside with one warning, which comes first; nothing is
    compared with it, so no finding blames the draft."""
    from hs_tracer.config import TracerConfig
    from hs_tracer.diagnosis.report import Report
    from hs_tracer.diagnosis.verdict import live_report
    from hs_tracer.integrations.sglang.state import TracerState

    st = TracerState(TracerConfig(profile=small_profile))
    st.target = {"architecture": "DeepseekV3ForCausalLM", "num_layers": 8, "hidden_size": 64}
    trained, finding = st.trained_sources()
    assert trained is None and st.profile_fits is False
    assert finding is not None and finding.code.value == "profile_mismatch" and OTHER in finding.message
    report = live_report([finding], None, None, None)
    assert report.status == "warning" and report.root_causes()[0].cause == "profile_mismatch"
    verdict = Report.from_json(report.to_json()).verdict()
    assert "use the profile built for this target's training data" in verdict


def test_diagnose_uses_the_same_rule(small: tb.TestbedPaths, profile: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _cli(capsys, "diagnose", small.specforge_data, "--profile", profile)
    assert code == 2 and out == ""
    assert "the profile is of another model (hidden size 64, this model's is 32" in err


# ---- 3. ids at the top level of config.json --------------------------------------------------------

def _top_level(cfg: dict) -> None:
    cfg["eagle_aux_hidden_state_layer_ids"] = cfg["eagle_config"].pop("eagle_aux_hidden_state_layer_ids")


MOVE = ("move eagle_aux_hidden_state_layer_ids from the top level of config.json into eagle_config, the only "
        "place SGLang reads the target's capture layers from")


@pytest.mark.parametrize("with_profile", [False, True])
def test_top_level_ids_fix_moves_the_key(testbed: tb.TestbedPaths, profile: Path, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str], with_profile: bool) -> None:
    draft = _draft(testbed, tmp_path / "top", _top_level)
    extra = ["--profile", profile] if with_profile else []
    code, out, _ = _cli(capsys, "check", "--draft", draft, "--target", testbed.target, "--json", *extra)
    report = json.loads(out)
    roots = report["root_causes"]
    assert len(roots) == 1 and roots[0]["fix"].startswith(MOVE), roots
    assert "retrain" not in out
    # served: SGLang's default; on this target it is the trained wiring (a warning with the profile)
    assert report["status"] == ("warning" if with_profile else "miswired")
    assert code == (0 if with_profile else 1)
    if with_profile:
        assert roots[0]["fix"].endswith("unchanged, [1, 3, 4] make SGLang feed [block:1, block:3, block:4], "
                                        "the layers the draft was trained on")


# ---- 4. check without a profile; ids [1, 3] ---------------------------------------------------------

def test_check_without_profile_says_what_was_not_compared(
        testbed: tb.TestbedPaths, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    draft = _draft(testbed, tmp_path / "wrong",
                   lambda c: c["eagle_config"].__setitem__("eagle_aux_hidden_state_layer_ids", [1, 3, 5]))
    code, out, _ = _cli(capsys, "check", "--draft", draft, "--target", testbed.target)
    lines = out.splitlines()
    assert code == 0
    assert "status: ok" not in lines and "  status: ok" not in lines
    assert "status: ok (not everything was checked: see the info below)" in lines
    assert lines[-1].startswith("verdict: nothing to fix in what was checked, but the layers SGLang will "
                                "feed were not compared with the draft's training data (no --profile")
    assert "run hs-tracer check with --profile P" in lines[-1]


def test_check_with_profile_catches_the_wrong_id(testbed: tb.TestbedPaths, profile: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    draft = _draft(testbed, tmp_path / "wrong",
                   lambda c: c["eagle_config"].__setitem__("eagle_aux_hidden_state_layer_ids", [1, 3, 5]))
    code, out, _ = _cli(capsys, "check", "--draft", draft, "--target", testbed.target, "--profile", profile)
    assert code == 1
    assert out.splitlines()[-1] == ("verdict: fix this before relying on speculation: set "
                                    "eagle_config.eagle_aux_hidden_state_layer_ids to [1, 3, 4]")


def test_fc_of_another_width_is_a_shape_error_not_missing_weights(
        testbed: tb.TestbedPaths, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    draft = _draft(testbed, tmp_path / "ids13",
                   lambda c: c["eagle_config"].__setitem__("eagle_aux_hidden_state_layer_ids", [1, 3]))
    code, out, _ = _cli(capsys, "check", "--draft", draft, "--target", testbed.target, "--json")
    report = json.loads(out)
    codes = [f["code"] for f in report["findings"]]
    assert code == 1 and "draft_weights_missing" not in codes, codes
    assert [r["cause"] for r in report["root_causes"]] == ["draft_input_width"]
    assert "list as many layers as the fc was trained on" in report["root_causes"][0]["fix"]

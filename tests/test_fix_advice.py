"""Fix advice follows the root cause, for every finding code: each case makes the finding the way it
happens (a draft edited as in real incidents and checked with ``hs-tracer check``, or the live
diagnosis's own functions on the evidence they judge) and asserts the fix of its root cause. Wrong
advice is a bug: a misplaced key is moved, not retrained; a convention error gets the corrected ids;
a missing profile says what was not compared and how to compare it.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from hs_tracer.diagnosis.report import Report
from hs_tracer.findings import Acceptance, Code, Finding, Severity
from hs_tracer_testbed import build as tb


@pytest.fixture(scope="module")
def testbed() -> tb.TestbedPaths:
    return tb.ensure_testbed(progress=False)


@pytest.fixture(scope="module")
def profile(testbed: tb.TestbedPaths) -> Path:
    from hs_tracer_testbed.demo import testbed_profile

    return testbed_profile(testbed)


def _draft(testbed: tb.TestbedPaths, dst: Path, edit: Callable[[dict], None]) -> Path:
    shutil.copytree(testbed.draft, dst)
    cfg = json.loads((dst / "config.json").read_text())
    edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def _ids(ids: list[int]) -> Callable[[dict], None]:
    return lambda c: c["eagle_config"].__setitem__("eagle_aux_hidden_state_layer_ids", ids)


def _top_level(c: dict) -> None:
    c["eagle_aux_hidden_state_layer_ids"] = c["eagle_config"].pop("eagle_aux_hidden_state_layer_ids")


def _check(draft: Path, target: Path, profile: Path | None = None, **kw) -> Report:
    from hs_tracer.preflight.runner import run_check

    return run_check(draft, target, profile=profile, **kw).report


def _root(report: Report, code: Code) -> str:
    """The fix of the root cause that holds a finding of ``code``."""
    for r in report.root_causes():
        if any(report.findings[i].code is code for i in r.findings):
            return r.fix
    raise AssertionError(f"no root cause holds {code.value}: {[f.one_line() for f in report.findings]}")


# ---- preflight codes, from edited drafts -----------------------------------------------------------

def test_layer_ids_ignored_moves_the_key(testbed, profile, tmp_path) -> None:
    draft = _draft(testbed, tmp_path / "d", _top_level)
    for prof in (None, profile):
        fix = _root(_check(draft, testbed.target, prof), Code.LAYER_IDS_IGNORED)
        assert fix.startswith("move eagle_aux_hidden_state_layer_ids from the top level of config.json into "
                              "eagle_config") and "retrain" not in fix


def test_layer_id_convention_gives_the_corrected_ids(testbed, profile, tmp_path) -> None:
    draft = _draft(testbed, tmp_path / "d", _ids([0, 2, 3]))
    report = _check(draft, testbed.target, profile)
    fixed = "set eagle_config.eagle_aux_hidden_state_layer_ids to [1, 3, 4]"
    assert _root(report, Code.LAYER_ID_CONVENTION) == fixed
    assert report.verdict().endswith("set eagle_config.eagle_aux_hidden_state_layer_ids to [1, 3, 4]")


def test_capture_raises_avoids_layer_0_or_upgrades(testbed, profile, tmp_path) -> None:
    """[0, 2, 3] on the DeepSeek-V3 testbed target capture layer 0: SGLang 0.5.13 dies at the first
    forward. Its cause leads; the fix keeps layer 0 out of the capture or names the release that
    captures it safely; the convention cause still gives ids that do not capture layer 0."""
    draft = _draft(testbed, tmp_path / "d", _ids([0, 2, 3]))
    report = _check(draft, testbed.target, profile, engine_version="0.5.13")
    fix = _root(report, Code.CAPTURE_RAISES)
    assert "do not make SGLang capture layer 0" in fix and "SGLang 0.5.14 or newer" in fix
    assert report.root_causes()[0].fix == fix and fix in report.verdict()
    fixed = "set eagle_config.eagle_aux_hidden_state_layer_ids to [1, 3, 4]"
    assert _root(report, Code.LAYER_ID_CONVENTION) == fixed
    assert not any(f.code is Code.CAPTURE_RAISES
                   for f in _check(draft, testbed.target, profile, engine_version="0.5.14").findings)


def test_without_profile_says_what_was_not_compared(testbed, tmp_path) -> None:
    report = _check(_draft(testbed, tmp_path / "d", _ids([1, 3, 5])), testbed.target)
    assert report.status == "ok" and not report.root_causes()
    info = [f for f in report.findings if f.code is Code.INSUFFICIENT_DATA]
    assert len(info) == 1 and "not compared with the draft's training data" in info[0].message
    assert "--profile P" in info[0].fix and "--profile P" in report.verdict()


def test_draft_input_width_mismatch_names_the_count(testbed, tmp_path) -> None:
    report = _check(_draft(testbed, tmp_path / "d", _ids([1, 3])), testbed.target)
    assert "list as many layers as the fc was trained on" in _root(report, Code.DRAFT_INPUT_WIDTH_MISMATCH)
    aux_off = _draft(testbed, tmp_path / "off",
                     lambda c: c["eagle_config"].__setitem__("use_aux_hidden_state", False))
    assert _root(_check(aux_off, testbed.target), Code.DRAFT_INPUT_WIDTH_MISMATCH) == (
        "remove use_aux_hidden_state: false (the draft was trained on aux states)")
    eagle = _check(testbed.draft, testbed.target,
                   server_args={"speculative_algorithm": "EAGLE", "speculative_num_steps": 3,
                                "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 4})
    assert _root(eagle, Code.DRAFT_INPUT_WIDTH_MISMATCH) == "serve with --speculative-algorithm EAGLE3"


def test_draft_format_names_the_format(testbed, tmp_path) -> None:
    report = _check(_draft(testbed, tmp_path / "d", lambda c: c.__setitem__("architectures", ["Foo"])),
                    testbed.target)
    fix = _root(report, Code.DRAFT_FORMAT)
    assert "LlamaForCausalLMEagle3" in fix, fix


def test_draft_shape_mismatch_sets_the_vocabulary(testbed, tmp_path) -> None:
    draft = _draft(testbed, tmp_path / "d", lambda c: c.__setitem__("vocab_size", 999))
    report = _check(draft, testbed.target)
    assert _root(report, Code.DRAFT_SHAPE_MISMATCH).startswith("set vocab_size to the target's")


def _weights_variant(testbed, dst: Path, change: Callable[[dict], None]) -> Path:
    from safetensors.torch import load_file, save_file

    shutil.copytree(testbed.draft, dst)
    for f in dst.glob("*.safetensors"):
        weights = load_file(str(f))
        change(weights)
        save_file(weights, str(f))
    return dst


def test_draft_weights_missing_and_unused(testbed, tmp_path) -> None:
    import torch

    missing = _weights_variant(testbed, tmp_path / "m",
                               lambda w: w.pop(next(k for k in w if k.endswith("norm.weight"))))
    assert _root(_check(missing, testbed.target), Code.DRAFT_WEIGHTS_MISSING).startswith(
        "export the full draft state dict")
    unused = _weights_variant(testbed, tmp_path / "u", lambda w: w.__setitem__("extra_proj.weight",
                                                                                 torch.zeros(2, 2)))
    assert _root(_check(unused, testbed.target), Code.DRAFT_WEIGHTS_UNUSED).startswith(
        "rename them to SGLang's names")


def test_d2t_invalid_ships_the_map(testbed, profile, tmp_path) -> None:
    from hs_tracer_testbed.miswire import write_vocab_variant

    gone = write_vocab_variant(Path(testbed.draft), tmp_path / "gone", None)
    assert "save d2t" in _root(_check(gone, testbed.target), Code.D2T_INVALID)
    import numpy as np

    d2t = np.roll(np.arange(256), 1) * 0 + 1  # every draft token mapped one id up: a regenerated map
    other = write_vocab_variant(Path(testbed.draft), tmp_path / "other", d2t)
    assert _root(_check(other, testbed.target, profile), Code.D2T_INVALID).startswith(
        "ship the d2t (and t2d) the draft was trained with")


def test_spec_args_adjusted_drops_the_flag(testbed) -> None:
    report = _check(testbed.draft, testbed.target,
                    server_args={"speculative_algorithm": "EAGLE3", "speculative_num_steps": 3,
                                 "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 4,
                                 "speculative_use_rejection_sampling": True})
    assert _root(report, Code.SPEC_ARGS_ADJUSTED) == ("drop --speculative-use-rejection-sampling for a "
                                                      "reduced-vocabulary draft")


# ---- live codes, from the diagnosis's own functions ------------------------------------------------

def _match(verdict: str, observed: str, d_expected: float, d_best: float, best: str):
    from hs_tracer.diagnosis.matcher import SlotMatch

    return SlotMatch(0, "block:1", observed, d_expected, d_best, best, "block:2", 5.0, verdict,
                     d_expected / 0.01)


def test_slot_source_mismatch_and_drift(testbed) -> None:
    from hs_tracer.diagnosis.matcher import slot_findings

    _v, [mismatch] = slot_findings([_match("mismatch", "embedding", 1.0, 0.001, "embedding")], 0.01, True)
    assert _root(Report(findings=[mismatch]), Code.SLOT_SOURCE_MISMATCH).startswith(
        "make the engine feed block:1 in slot 0 (it feeds embedding)")
    _v, [drift] = slot_findings([_match("drift", "block:1", 0.09, 0.09, "block:1")], 0.01, True)
    assert _root(Report(findings=[drift]), Code.FEATURE_DRIFT).startswith("compare the serving target")


def test_non_finite_features() -> None:
    from hs_tracer.diagnosis.matcher import nonfinite_finding

    assert _root(Report(findings=nonfinite_finding(5, 100)), Code.NON_FINITE_FEATURES).startswith(
        "look for overflow in the target")


def _collapse() -> Acceptance:
    return Acceptance(steps=500, mean_accept_length=1.02, per_position_rate=[0.02, 0.0, 0.0])


def test_acceptance_drop_follows_what_the_features_say(profile) -> None:
    from hs_tracer.diagnosis.acceptance import acceptance_findings
    from hs_tracer.profile.model import Profile

    expected = Profile.load(profile).expected_acceptance
    right = acceptance_findings(_collapse(), expected, features_match=True)
    assert _root(Report(findings=right), Code.ACCEPTANCE_DROP).startswith(
        "check the draft's d2t against the training data's map")
    unknown = acceptance_findings(_collapse(), None, features_match=None)
    assert _root(Report(findings=unknown), Code.ACCEPTANCE_DROP).startswith("serve with HS_TRACER_PROFILE")
    # features wrong: the symptom joins the wiring cause and takes its fix
    wiring = Finding(Code.LAYER_ID_CONVENTION, Severity.CRITICAL, "slot 0 will be fed embedding",
                     "set eagle_config.eagle_aux_hidden_state_layer_ids to [1, 3, 4]", slot=0)
    wrong = [wiring, *acceptance_findings(_collapse(), expected, features_match=False)]
    assert _root(Report(findings=wrong), Code.ACCEPTANCE_DROP) == (
        "set eagle_config.eagle_aux_hidden_state_layer_ids to [1, 3, 4]")


def test_norm_flags_sets_the_flag() -> None:
    from hs_tracer.static_checks.norm_flags import check_norm_flags

    found = check_norm_flags({"norm_before_fc": True}, {"norm_before_fc": False})
    fix = _root(Report(findings=found), Code.NORM_FLAGS)
    assert fix.startswith("set norm_before_fc to false where SGLang reads it")
    # SGLang has no norm_before_residual branch: no flag to set, another engine or a retrained draft
    found = check_norm_flags({"norm_before_residual": True}, {"norm_before_residual": True})
    fix = _root(Report(findings=found), Code.NORM_FLAGS)
    assert "has no norm_before_residual branch" in fix and "vLLM" in fix and not fix.startswith("set ")


def test_features_from_other_requests_points_at_the_gather() -> None:
    import inspect

    from hs_tracer.replay import analysis

    # the finding is made by replay's verdict object; its fix names the gather (docs/replay.md)
    source = inspect.getsource(analysis)
    assert "Code.FEATURES_FROM_OTHER_REQUESTS" in source
    assert "check how the target's aux hidden states are gathered and ordered before the draft" in source


def test_profile_mismatch_names_the_right_profile(tmp_path, testbed) -> None:
    from hs_tracer.config import TracerConfig
    from hs_tracer.integrations.sglang.state import TracerState

    small = tb.ensure_testbed(recipe=tb.Recipe.small(), progress=False)
    from hs_tracer.cli import main

    out = tmp_path / "small.profile"
    assert main(["profile", "build", str(small.specforge_data), "-o", str(out), "--draft", str(small.draft),
                 "--target", str(small.target), "--no-progress"]) == 0
    st = TracerState(TracerConfig(profile=out))
    st.target = {"architecture": "DeepseekV3ForCausalLM", "num_layers": 8, "hidden_size": 64}
    _trained, finding = st.trained_sources()
    assert finding is not None
    assert _root(Report(findings=[finding]), Code.PROFILE_MISMATCH) == (
        "use the profile built for this target's training data (hs-tracer profile build)")


def test_an_unreadable_profile_is_named_and_leaves_serving_alone(tmp_path) -> None:
    """A profile file that is no profile: one warning whose fix points at the file, the slot and
    acceptance checks reported off (never a hook error that would switch tracing off)."""
    from hs_tracer.config import TracerConfig
    from hs_tracer.integrations.sglang.state import TracerState

    broken = tmp_path / "truncated.profile"
    broken.write_bytes(b"\x00" * 16)
    st = TracerState(TracerConfig(profile=broken))
    trained, finding = st.trained_sources()
    assert trained is None and st.profile_fits is False and finding is not None
    assert finding.code is Code.PROFILE_UNREADABLE and str(broken) in finding.message
    assert _root(Report(findings=[finding]), Code.PROFILE_UNREADABLE).startswith("point HS_TRACER_PROFILE at")


def test_a_capture_loop_that_is_not_what_the_engine_records_is_fixed_in_the_engine_not_the_config() -> None:
    """The engine records the trained source for slot 0 while the rows it feeds measurably equal the
    next block's: the fix points at the target's model class in the engine; the draft config has
    nothing to change (``capture_record_mismatch``); an unresolved window asks for a measurement
    (``slot_source_unresolved``)."""
    from hs_tracer.diagnosis.same_token import MeasuredSlot
    from hs_tracer.diagnosis.verdict import live_report
    from hs_tracer.findings import SlotVerdict

    judged = Report(slots=[SlotVerdict(0, "block:1", "block:1", 0.6)])
    late = MeasuredSlot(0, ("block:2",), rows=256, error=0.0, nearest="block:2", runner_up="block:1",
                        runner_up_error=0.2)
    report = live_report([], judged, None, None, engine_layers_checked=True, measured=[late])
    fix = _root(report, Code.CAPTURE_RECORD_MISMATCH)
    assert "model class in the engine" in fix and "draft config cannot fix" in fix
    assert report.root_causes()[0].fix == fix
    from hs_tracer.diagnosis.matcher import SlotMatch, slot_findings

    either = SlotMatch(0, "block:1", "unknown", d_expected=1.1, d_best=1.0, best="block:2",
                       runner_up="block:1", d_runner_up=1.1, verdict="ambiguous",
                       candidates=["block:2", "block:1"])
    slots, findings = slot_findings([either], t_match=1.0, has_atlas=True)
    assert [f.code for f in findings] == [Code.SLOT_SOURCE_UNRESOLVED]
    window = Report(slots=slots, findings=findings)
    fix = _root(live_report([], window, None, None), Code.SLOT_SOURCE_UNRESOLVED)
    assert "HS_TRACER_IDENTITY_EVERY" in fix


def test_a_dump_whose_rows_are_not_what_its_ids_say_is_fixed_where_the_dump_is_described() -> None:
    """``profile build --target`` measured slot 1 of a dump described as SpecForge ids [1, 3, 4] holding
    block:4: the profile keeps the measured source, and the fix is the description of the dump (its
    ids or convention), not the draft or the engine (``training_record_mismatch``)."""
    from hs_tracer.diagnosis.recompute import training_findings
    from hs_tracer.diagnosis.same_token import MeasuredSlot

    stated = ["block:1", "block:3", "block:4"]
    measured = [MeasuredSlot(k, (s,), rows=256, error=0.002, nearest=s, runner_up="block:0",
                             runner_up_error=0.4) for k, s in enumerate(["block:1", "block:4", "block:4"])]
    meta = {"layer_ids": [1, 3, 4], "convention": "specforge", "ids_origin": "draft_config"}
    findings = training_findings(measured, stated, meta)
    assert [(f.slot, f.expected, f.observed, f.severity) for f in findings] == [
        (1, "block:3", "block:4", Severity.CRITICAL)]
    fix = _root(Report(findings=findings), Code.TRAINING_RECORD_MISMATCH)
    assert "records block:4" in fix and "layer ids or their convention" in fix


def test_every_code_has_a_case() -> None:
    """A new finding code needs its fix-advice case here."""
    import sys

    source = Path(sys.modules[__name__].__file__).read_text()
    assert [c.name for c in Code if f"Code.{c.name}" not in source] == []


def test_the_fix_of_a_measured_slot_follows_its_cause() -> None:
    """A value no layer has points at the capture channel's code (with the value it appends); two
    slots fed each other's trained sources at the order the engine concatenates them; neither at the
    draft's layer ids, which cannot fix them. A slot measured as fed none is never named as a layer,
    whatever the window's statistics say."""
    from hs_tracer.diagnosis.same_token import MeasuredSlot
    from hs_tracer.diagnosis.verdict import live_report
    from hs_tracer.findings import SlotVerdict

    trained = ["block:1", "block:14", "block:26"]
    judged = Report(slots=[SlotVerdict(k, s, "embedding" if k == 0 else s, 0.6)
                           for k, s in enumerate(trained)])
    none = MeasuredSlot(0, (), rows=256, error=0.93, nearest="block:0", runner_up="block:1",
                        runner_up_error=0.95, tolerance=1e-3,
                        transform={"transform": "residual_left_out", "source": "block:1", "error": 0.0,
                                   "words": "block:1's output alone"})
    swapped = [MeasuredSlot(k, (s,), rows=256, error=0.0, nearest=s, runner_up="block:0", runner_up_error=0.3,
                            tolerance=1e-3) for k, s in ((1, "block:26"), (2, "block:14"))]
    report = live_report([], judged, None, None, engine_layers_checked=True, measured=[none, *swapped])
    assert report.slots[0].observed_source == "unknown" and report.slots[0].fed_none
    assert "none of the target's layers" in report.slots[0].evidence()
    assert [s.observed_source for s in report.slots[1:]] == ["block:26", "block:14"]
    causes = {r.cause: r.fix for r in report.root_causes()}
    assert set(causes) == {"capture_channel", "capture_order"}
    assert "capture channel" in causes["capture_channel"] and "without adding the residual" in causes[
        "capture_channel"]
    assert "order" in causes["capture_order"]
    assert all("eagle_aux_hidden_state_layer_ids" not in f.fix for f in report.findings)

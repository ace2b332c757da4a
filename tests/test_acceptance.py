"""Expected acceptance (profile build) and the live acceptance verdict."""

from __future__ import annotations

from dataclasses import replace

import torch

from hs_tracer.diagnosis.acceptance import acceptance_findings
from hs_tracer.diagnosis.causes import group
from hs_tracer.diagnosis.report import Report
from hs_tracer.diagnosis.verdict import live_report, recorded_wiring
from hs_tracer.findings import Acceptance, Code, Finding, Severity, SlotVerdict
from hs_tracer.profile.expectation import ExpectedAcceptance, chain_accepted, training_sequences

EXPECTED = ExpectedAcceptance([0.75, 0.62, 0.56], rows=2767, sequences=64, num_steps=3, draft="d",
                              draft_config_sha256="x", d2t_sha256="y",
                              draft_flags={"norm_output": False, "norm_before_fc": False, "fc_norm": False,
                                           "norm_before_residual": False})
HEALTHY = Acceptance(steps=200, mean_accept_length=2.8, per_position_rate=[0.72, 0.58, 0.5])
COLLAPSED = Acceptance(steps=200, mean_accept_length=1.04, per_position_rate=[0.04, 0.0, 0.0])


def _sequential(draft, feats, ids, p: int, steps: int) -> list[int]:
    """Row p the way SGLang drafts it: extend over 0..p, then decode steps on the draft's KV cache."""
    from hs_tracer.draft.model import KVCache

    cache = KVCache()
    out = draft(feats[: p + 1], ids[1: p + 2], torch.arange(p + 1), cache)
    tok = draft.to_target_ids(out.logits[-1:].argmax(-1))
    chain, hidden = [int(tok)], out.hidden[-1:]
    for s in range(1, steps):
        out = draft(hidden, tok, torch.tensor([p + s]), cache)
        tok = draft.to_target_ids(out.logits.argmax(-1))
        chain.append(int(tok))
        hidden = out.hidden
    return chain


def test_batched_chain_equals_the_sequential_draft(testbed) -> None:
    from hs_tracer.draft.model import Eagle3Draft

    draft = Eagle3Draft.from_pretrained(testbed.draft, target_dir=testbed.target).eval()
    feats, ids, _mask = next(training_sequences(testbed.specforge_data, 1))
    feats, ids = torch.from_numpy(feats), torch.from_numpy(ids)
    with torch.no_grad():
        hits = chain_accepted(draft, feats, ids, 3)
        assert hits.shape == (ids.shape[0] - 4, 3)
        for p in range(0, hits.shape[0], 7):
            chain = _sequential(draft, feats, ids, p, 3)
            want = []
            ok = True
            for s in range(3):
                ok = ok and chain[s] == int(ids[p + 2 + s])
                want.append(ok)
            assert hits[p].tolist() == want, p
    assert hits[:, 0].float().mean() > 0.5  # the trained draft predicts its training data


def test_testbed_profile_carries_its_expectation(testbed_profile) -> None:
    from hs_tracer.profile.model import Profile

    p = Profile.load(testbed_profile)
    e = p.expected_acceptance
    assert e is not None and e.num_steps == 3 and e.rows > 1000
    assert 2.0 < e.mean_accept_length < 4.0
    assert e.per_position_rate == sorted(e.per_position_rate, reverse=True)  # cumulative
    assert e.d2t_sha256 == p.meta["training_vocab_map"]["d2t_sha256"]
    assert not any(e.draft_flags.values())


def test_collapse_far_below_expectation_is_critical() -> None:
    assert acceptance_findings(HEALTHY, EXPECTED) == []
    f = acceptance_findings(COLLAPSED, EXPECTED, features_match=True)
    assert [x.code for x in f] == [Code.ACCEPTANCE_DROP] and f[0].severity is Severity.CRITICAL
    assert f[0].expected == "2.93" and f[0].observed == "1.04"
    assert "reaches on its training data" in f[0].message
    held_out = replace(EXPECTED, data="held-out")  # the profile says what it was measured on
    assert "reaches on held-out data of its training domain" in acceptance_findings(
        COLLAPSED, held_out, features_match=True)[0].message


def test_too_few_steps_decide_nothing() -> None:
    short = Acceptance(steps=20, mean_accept_length=1.0, per_position_rate=[0.0, 0.0, 0.0])
    assert acceptance_findings(short, EXPECTED) == []


def test_without_expectation_an_accept_length_near_one_is_critical() -> None:
    assert acceptance_findings(COLLAPSED, None)[0].severity is Severity.CRITICAL
    assert acceptance_findings(Acceptance(200, 1.6, [0.4, 0.15, 0.05]), None) == []


def test_with_the_features_right_and_no_expectation_an_untrained_draft_is_among_the_causes() -> None:
    """A draft trained a few steps is fed right and accepts nothing: without a measured expectation
    the report cannot tell it from a vocabulary-map fault, and says so; with one it is not named."""
    bare = acceptance_findings(COLLAPSED, None, features_match=True)[0]
    assert "the draft itself" in bare.message and "--draft" in bare.fix
    measured = acceptance_findings(COLLAPSED, EXPECTED, features_match=True)[0]
    assert "the draft itself" not in measured.message


def test_cause_before_symptom() -> None:
    drop_right = acceptance_findings(COLLAPSED, EXPECTED, features_match=True)
    assert [r.cause for r in group(drop_right)] == ["vocabulary_map"]
    assert "vocabulary map (d2t)" in group(drop_right)[0].summary
    norm = Finding(Code.NORM_FLAGS, Severity.CRITICAL, "norm_output differs", "set norm_output to false")
    roots = group([norm, *drop_right])
    assert [r.cause for r in roots] == ["norm_flags"] and roots[0].findings == [0, 1]
    ids = Finding(Code.LAYER_ID_CONVENTION, Severity.CRITICAL, "slot 0 fed block:0", "set ids", slot=0)
    drop_wrong = acceptance_findings(COLLAPSED, EXPECTED, features_match=False)
    assert "not trained on" in drop_wrong[0].message
    roots = group([ids, *drop_wrong])
    assert [r.cause for r in roots] == ["layer_ids"] and "symptom" in roots[0].summary


def test_live_match_makes_a_config_fault_a_warning() -> None:
    static = [Finding(Code.LAYER_IDS_IGNORED, Severity.CRITICAL, "ids at the top level", "move them")]
    judged = Report(slots=[SlotVerdict(0, "block:1", "block:1", 0.1),
                           SlotVerdict(1, "block:3", "block:3", 0.1)])
    report = live_report(static, judged, HEALTHY, None)
    assert report.exit_code == 0 and report.status == "warning"
    assert "does not bite" in report.findings[0].message
    mismatch = Report(slots=[SlotVerdict(0, "block:1", "block:0", 0.1)])
    assert live_report(static, mismatch, HEALTHY, None).exit_code == 1


def test_live_norm_flag_differs_from_the_measured_one() -> None:
    from hs_tracer.profile.model import Profile

    profile = Profile(meta={"expected_acceptance": EXPECTED.to_json()}, slots=None, pieces={})  # type: ignore[arg-type]
    judged = Report(slots=[SlotVerdict(0, "block:1", "block:1", 0.1)])
    report = live_report([], judged, COLLAPSED, profile, {"norm_output": True})
    assert [r.cause for r in report.root_causes()] == ["norm_flags"]
    assert live_report([], judged, HEALTHY, profile, {"norm_output": False}).exit_code == 0



def _profile():
    from hs_tracer.profile.model import Profile

    return Profile(meta={"expected_acceptance": EXPECTED.to_json()}, slots=None, pieces={})  # type: ignore[arg-type]


def _measured(index: int, source: str, runner_up: str = "block:0"):
    from hs_tracer.diagnosis.same_token import MeasuredSlot

    return MeasuredSlot(index=index, sources=(source,), rows=512, error=0.0, nearest=source,
                        runner_up=runner_up, runner_up_error=0.3)


def test_a_collapse_with_the_features_measured_right_says_so_not_drift() -> None:
    """A draft whose vocabulary map is broken (d2t zeroed: acceptance 1.0) fed exactly its trained
    layers: status ``acceptance`` with the vocabulary map as the cause, and no slot finding at all."""
    judged = Report(slots=[SlotVerdict(0, "block:1", "block:1", 0.6, drift=0.2),
                           SlotVerdict(1, "block:3", "block:3", 0.6, drift=2.1)])
    report = live_report([], judged, COLLAPSED, _profile(), {}, engine_layers_checked=True,
                         measured=[_measured(0, "block:1"), _measured(1, "block:3")])
    assert report.status == "acceptance" and report.exit_code == 1
    assert [s.drift for s in report.slots] == [0.2, 2.1]  # the statistics' drift, kept beside the measurement
    assert [r.cause for r in report.root_causes()] == ["vocabulary_map"]
    assert not [f for f in report.findings if f.code is Code.SLOT_SOURCE_MISMATCH]


def test_a_statistics_mismatch_is_not_overruled_by_the_engine_record() -> None:
    """The window names block:3 for slot 2 decisively while the engine records its trained block:4:
    the mismatch stays critical whatever the acceptance, and the record's disagreement is a finding
    of its own whose fix points at the capture loop, not at the draft config."""
    slip = Finding(Code.SLOT_SOURCE_MISMATCH, Severity.CRITICAL,
                   "slot 2 carries block:3 (distance 0.5 vs 4 to block:4, in match levels)", "fix the ids",
                   slot=2, expected="block:4", observed="block:3")
    judged = Report(slots=[SlotVerdict(0, "block:1", "block:1", 0.6),
                           SlotVerdict(2, "block:4", "block:3", 0.6)], findings=[slip])
    for acceptance in (HEALTHY, COLLAPSED):
        report = live_report([], judged, acceptance, _profile(), {}, engine_layers_checked=True)
        assert report.status == "miswired" and report.exit_code == 1, report.human()
        assert [s.observed_source for s in report.slots] == ["block:1", "block:3"]
        (record,) = [f for f in report.findings if f.code is Code.CAPTURE_RECORD_MISMATCH]
        assert record.severity is Severity.CRITICAL
        assert (record.expected, record.observed) == ("block:4", "block:3")
        assert "capture loop" in record.fix and "eagle_aux_hidden_state_layer_ids" not in record.fix
        assert report.root_causes()[0].cause == "capture_loop"


def test_an_unresolved_slot_names_the_record_as_unconfirmed_and_is_never_ok() -> None:
    """A window that admits the trained source and a neighbour, with the engine's record matching the
    profile: a warning naming what it cannot tell apart and the record as unconfirmed, with any
    acceptance; a measurement settles it."""
    either = Finding(Code.SLOT_SOURCE_UNRESOLVED, Severity.WARNING, "slot 0 carries block:1 or block:0",
                     "measure it", slot=0, expected="block:0", observed="unknown",
                     details={"candidates": ["block:1", "block:0"]})
    judged = Report(slots=[SlotVerdict(0, "block:0", "unknown", 0.5, candidates=["block:1", "block:0"])],
                    findings=[either])
    early = Acceptance(steps=20, mean_accept_length=2.8, per_position_rate=[0.7, 0.6, 0.5])
    for acceptance in (HEALTHY, early):
        report = live_report([], judged, acceptance, _profile(), {}, engine_layers_checked=True)
        assert report.status == "warning" and report.exit_code == 0, report.human()
        (f,) = report.findings
        assert f.code is Code.SLOT_SOURCE_UNRESOLVED and "nothing measured confirms it" in f.message
    measured = live_report([], judged, HEALTHY, _profile(), {}, engine_layers_checked=True,
                           measured=[_measured(0, "block:0", runner_up="block:1")])
    assert measured.status == "ok" and not measured.findings, measured.human()
    assert measured.slots[0].observed_source == "block:0" and "measured on 512 tokens" in measured.human()
    shifted = live_report([], judged, HEALTHY, _profile(), {}, engine_layers_checked=True,
                          measured=[_measured(0, "block:1")])
    assert shifted.status == "miswired" and shifted.exit_code == 1, shifted.human()
    codes = {(f.code, f.severity) for f in shifted.findings}
    assert codes == {(Code.SLOT_SOURCE_MISMATCH, Severity.CRITICAL),
                     (Code.CAPTURE_RECORD_MISMATCH, Severity.CRITICAL)}


def test_a_measurement_decides_against_the_window_and_a_record_right_by_accident_is_a_warning() -> None:
    """The measurement outranks the window's statistics either way; where the engine's record says
    another source than the rows measurably are while those are the trained ones, that is a warning
    (served right now), and the config finding that followed the record is not critical either."""
    slip = Finding(Code.SLOT_SOURCE_MISMATCH, Severity.CRITICAL, "slot 0 carries block:0", "fix", slot=0,
                   expected="block:1", observed="block:0")
    judged = Report(slots=[SlotVerdict(0, "block:1", "block:0", 0.5)], findings=[slip])
    report = live_report([], judged, HEALTHY, _profile(), {}, engine_layers_checked=True,
                         measured=[_measured(0, "block:1")])
    assert report.status == "ok" and report.exit_code == 0, report.human()
    ids = Finding(Code.LAYER_ID_CONVENTION, Severity.CRITICAL, "slot 0 fed block:0", "set ids", slot=0,
                  expected="block:1", observed="block:0")
    report = live_report([ids], judged, HEALTHY, _profile(), {}, engine_layers_checked=True,
                         measured=[_measured(0, "block:1")])
    assert report.exit_code == 0 and report.status == "warning", report.human()
    (record,) = [f for f in report.findings if f.code is Code.CAPTURE_RECORD_MISMATCH]
    assert record.severity is Severity.WARNING and record.expected == "block:0"


def test_the_engine_record_and_the_statistics_each_keep_their_say(
        testbed, testbed_profile, tmp_path) -> None:
    """The testbed draft miswired by its config (every id one lower) with windows whose last slot,
    or every slot, holds rows of the trained source: each slot is named by its decisive statistics,
    never by the record alone; where the record says another source than those statistics show,
    that disagreement is critical (live at startup and on a capture's manifest alike), so no such
    report exits 0."""
    import numpy as np

    from hs_tracer.preflight.checkpoint import read_checkpoint
    from hs_tracer.preflight.config import read_draft_config, read_target_config
    from hs_tracer.preflight.runner import build_wiring
    from hs_tracer.profile.model import Profile
    from hs_tracer.static_checks.wiring import capture, check_wiring
    from hs_tracer_testbed.evaluate import judge, pool_from_testbed
    from hs_tracer_testbed.miswire import write_variant

    profile = Profile.load(testbed_profile)
    trained = list(profile.sources)
    draft = write_variant(testbed.draft, tmp_path / "draft", "ids_shifted")
    wiring = build_wiring(read_draft_config(draft), read_target_config(testbed.target),
                          read_checkpoint(draft), "EAGLE3")
    fed = capture(wiring).sources
    assert all(f != t for f, t in zip(fed, trained, strict=True))
    startup = check_wiring(wiring, trained)
    from_capture, _matches = recorded_wiring(fed, profile)

    pool = pool_from_testbed(testbed.target, docs=48, domain="train", seed=1234)
    rng = np.random.default_rng(7)
    for window in ([*fed[:-1], trained[-1]], trained):
        judged = judge(profile, pool.window(window, 512, rng))
        assert [s.observed_source for s in judged.slots] == window
        for static, checked in ((startup, True), (from_capture, False)):
            report = live_report(static, judged, HEALTHY, profile, {}, engine_layers_checked=checked)
            assert [s.observed_source for s in report.slots] == window, report.human()
            assert report.exit_code == 1, report.human()
            disagree = {f.slot for f in report.findings if f.code is Code.CAPTURE_RECORD_MISMATCH
                        and f.severity is Severity.CRITICAL}
            assert disagree == {k for k, (f, w) in enumerate(zip(fed, window, strict=True)) if f != w}
            # one source per slot: no critical finding names another source for a slot than its row
            named = [f for f in report.findings if f.slot is not None and f.observed
                     and f.severity is Severity.CRITICAL and f.code is not Code.CAPTURE_RECORD_MISMATCH]
            assert all(f.observed == window[f.slot] for f in named), report.human()

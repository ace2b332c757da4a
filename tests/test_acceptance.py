"""Expected acceptance (profile build) and the live acceptance verdict."""

from __future__ import annotations

import torch

from hs_tracer.diagnosis.acceptance import acceptance_findings
from hs_tracer.diagnosis.causes import group
from hs_tracer.diagnosis.findings import Acceptance, Code, Finding, Severity, SlotVerdict
from hs_tracer.diagnosis.report import Report
from hs_tracer.diagnosis.verdict import live_report
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
    feats, ids = next(training_sequences(testbed.specforge_data, 1))
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


def test_too_few_steps_decide_nothing() -> None:
    short = Acceptance(steps=20, mean_accept_length=1.0, per_position_rate=[0.0, 0.0, 0.0])
    assert acceptance_findings(short, EXPECTED) == []


def test_without_expectation_an_accept_length_near_one_is_critical() -> None:
    assert acceptance_findings(COLLAPSED, None)[0].severity is Severity.CRITICAL
    assert acceptance_findings(Acceptance(200, 1.6, [0.4, 0.15, 0.05]), None) == []


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


def test_layers_right_by_the_engine_record_keep_the_cause_on_the_vocabulary() -> None:
    """Recorded on the CPU engine with a regenerated d2t: one slot's window sat nearer a neighbour
    (rows of rejected draft tokens) while the engine's layers_to_capture matched the profile."""
    from hs_tracer.profile.model import Profile

    profile = Profile(meta={"expected_acceptance": EXPECTED.to_json()}, slots=None, pieces={})  # type: ignore[arg-type]
    slip = Finding(Code.SLOT_SOURCE_MISMATCH, Severity.CRITICAL, "slot 2 carries block:3", "fix", slot=2,
                   expected="block:4", observed="block:3")
    judged = Report(slots=[SlotVerdict(0, "block:1", "block:1", 0.6),
                           SlotVerdict(2, "block:4", "block:3", 0.6)], findings=[slip])
    report = live_report([], judged, COLLAPSED, profile, {}, engine_layers_checked=True)
    roots = report.root_causes()
    assert [(r.cause, r.severity) for r in roots] == [("vocabulary_map", Severity.CRITICAL),
                                                       ("features", Severity.WARNING)]
    # a critical static wiring finding keeps the live mismatch critical and the blame on the wiring
    ids = Finding(Code.LAYER_ID_CONVENTION, Severity.CRITICAL, "slot 2 fed block:3", "set ids", slot=2)
    assert live_report([ids], judged, COLLAPSED, profile, {},
                       engine_layers_checked=True).root_causes()[0].cause == "layer_ids"
    # without the engine's record (a capture on disk) the statistics are the only evidence
    assert live_report([], judged, COLLAPSED, profile, {}).root_causes()[0].cause == "features"


def test_the_engine_record_settles_an_ambiguous_slot_once_the_acceptance_is_judged() -> None:
    """A window that admits the trained source and a neighbour, with the engine's layers_to_capture
    matching the profile: info (the record decides) once the acceptance is judged and healthy; a
    warning before that; with a collapse the acceptance is critical, never ``ok``."""
    from hs_tracer.profile.model import Profile

    profile = Profile(meta={"expected_acceptance": EXPECTED.to_json()}, slots=None, pieces={})  # type: ignore[arg-type]
    either = Finding(Code.SLOT_SOURCE_MISMATCH, Severity.WARNING, "slot 0 carries block:1 or block:0",
                     "collect a longer window", slot=0, expected="block:0", observed="unknown",
                     details={"candidates": ["block:1", "block:0"]})
    judged = Report(slots=[SlotVerdict(0, "block:0", "unknown", 0.5, candidates=["block:1", "block:0"])],
                    findings=[either])

    def report(acceptance: Acceptance, checked: bool = True) -> Report:
        return live_report([], judged, acceptance, profile, {}, engine_layers_checked=checked)

    settled = report(HEALTHY)
    assert settled.status == "ok" and settled.exit_code == 0, settled.findings
    (f,) = settled.findings
    assert f.severity is Severity.INFO and "carries its trained source" in f.message
    early = report(Acceptance(steps=20, mean_accept_length=2.8, per_position_rate=[0.72, 0.58, 0.5]))
    assert early.status == "warning" and "(20 so far)" in early.findings[0].message
    collapsed = report(COLLAPSED)
    assert collapsed.status != "ok" and collapsed.exit_code == 1
    # without the engine's record (a capture on disk) the statistics alone leave it ambiguous
    assert report(HEALTHY, checked=False).status == "warning"


def test_the_engine_record_overrules_a_thin_statistics_mismatch_once_the_draft_is_seen_working() -> None:
    """Recorded on vLLM's CPU engine: slot 0's window sat nearer block:1 than its trained block:0
    (distance 1.0 vs 1.23) while the layers vLLM resolved were the profile's and the draft accepted
    at its training level. The record decides once the acceptance is judged and did not collapse:
    ``ok``, the slot read as not told apart, and no advice to rewire a layer the engine already feeds;
    before that a warning with nothing to rewire; with a collapse, never ``ok``."""
    from hs_tracer.profile.model import Profile

    profile = Profile(meta={"expected_acceptance": EXPECTED.to_json()}, slots=None, pieces={})  # type: ignore[arg-type]
    near = Finding(Code.SLOT_SOURCE_MISMATCH, Severity.CRITICAL,
                   "slot 0 carries block:1; the draft was trained on block:0 (distance 1 vs 1.23 to block:0, "
                   "in match levels)", "make the engine feed block:0 in slot 0", slot=0, expected="block:0",
                   observed="block:1")
    judged = Report(slots=[SlotVerdict(0, "block:0", "block:1", 0.5, distance=1.0, alternative="block:0",
                                       alternative_distance=1.23)], findings=[near])

    def report(acceptance: Acceptance, checked: bool = True) -> Report:
        return live_report([], judged, acceptance, profile, {}, engine_layers_checked=checked)

    settled = report(HEALTHY)
    assert settled.status == "ok" and settled.exit_code == 0, settled.findings
    (f,) = settled.findings
    assert f.severity is Severity.INFO and not f.fix and "carries its trained source" in f.message
    (slot,) = settled.slots
    assert slot.observed_source == "unknown" and slot.candidates == ["block:1", "block:0"]
    assert "<-- mismatch" not in settled.human() and "<-- ambiguous" in settled.human()
    early = report(Acceptance(steps=20, mean_accept_length=2.8, per_position_rate=[0.72, 0.58, 0.5]))
    assert early.status == "warning" and early.exit_code == 0
    assert all("feed block:0" not in g.fix for g in early.findings), early.findings
    collapsed = report(COLLAPSED)
    assert collapsed.status != "ok" and collapsed.exit_code == 1
    assert all("feed block:0" not in g.fix for g in collapsed.findings), collapsed.findings
    # without the engine's record the statistics are the only evidence: critical, with the rewiring
    alone = report(HEALTHY, checked=False)
    assert alone.exit_code == 1 and "feed block:0" in alone.findings[0].fix


def test_the_engine_record_names_each_slot_where_the_window_reads_the_trained_source(
        testbed, testbed_profile, tmp_path) -> None:
    """The testbed draft miswired by its config (every id one lower) with windows whose last
    slot, or every slot, sits at the trained source (a real model's neighbours can look so): each slot
    is named as the engine's record feeds it, as its critical finding says, live (the startup check
    of SGLang's layers_to_capture) and on a capture (its manifest) alike; the trained source the
    statistics sat nearest stays the one to compare with."""
    import numpy as np

    from hs_tracer.diagnosis.verdict import recorded_wiring
    from hs_tracer.diagnosis.wiring import capture, check_wiring
    from hs_tracer.preflight.checkpoint import read_checkpoint
    from hs_tracer.preflight.config import read_draft_config, read_target_config
    from hs_tracer.preflight.runner import build_wiring
    from hs_tracer.profile.model import Profile
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
    codes = {(f.slot, f.code, f.severity) for f in startup if f.severity is Severity.CRITICAL}
    assert codes == {(k, Code.LAYER_ID_CONVENTION, Severity.CRITICAL) for k in range(len(fed))}
    from_capture, _matches = recorded_wiring(fed, profile)

    pool = pool_from_testbed(testbed.target, docs=48, domain="train", seed=1234)
    rng = np.random.default_rng(7)
    for window in ([*fed[:-1], trained[-1]], trained):
        judged = judge(profile, pool.window(window, 512, rng))
        assert [s.observed_source for s in judged.slots][-1] == trained[-1]  # what misled the table
        for static, checked in ((startup, True), (from_capture, False)):
            report = live_report(static, judged, HEALTHY, profile, {}, engine_layers_checked=checked)
            assert [s.observed_source for s in report.slots] == fed, report.human()
            assert report.status == "miswired" and report.exit_code == 1, report.human()
            critical = {f.slot: f.observed for f in report.findings if f.severity is Severity.CRITICAL}
            assert critical == dict(enumerate(fed)), report.human()
            last = report.slots[-1]
            assert last.alternative == trained[-1] and last.distance is None and not last.candidates
            assert f"sat nearest {trained[-1]} (trained)" in report.human()
            # the window's own findings never name another source for a slot than the record does
            named = [f for f in report.findings if f.slot is not None and f.observed
                     and f.severity is not Severity.INFO]
            assert all(f.observed == fed[f.slot] for f in named), report.human()

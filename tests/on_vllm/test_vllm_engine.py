"""hs_tracer inside real vLLM engines on CPU (the vLLM testbed pair), compiled as vLLM serves by
default (tests/on_vllm/engines.py says which run eager): greedy decoding stays lossless with tracing
on, hs_tracer's acceptance equals vLLM's own spec-decode counters (also at TP 2, where they are
counted in another process than the fingerprints), the configured draft is ``ok``, a copy whose
layer ids vLLM does not find is named slot by slot, the demo's verdict on the two, and a fault in
any hook leaves the served tokens unchanged. Every traced engine measures the slots' layer identity
on every target forward, inside the compiled body: the configured draft measured as trained, a
capture loop patched to feed later layers named slot by slot."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hs_tracer.diagnosis.report import Report
from tests.on_vllm.engines import HOOK_NAMES, NUM_PROMPTS, diagnosis

TRAINED = ["block:0", "block:3", "block:6"]


def _measured(d: dict) -> list[str | None]:
    """Each slot's measured source (None: not one source)."""
    return [s["sources"][0] if len(s["sources"]) == 1 else None for s in d["measured_identity"]["slots"]]


def test_greedy_eagle3_with_tracing_commits_exactly_the_plain_tokens(vllm_engines) -> None:
    """EAGLE-3 traced and untraced, both compiled (the traced body with the sampler's op in its
    graph): the same tokens."""
    want = vllm_engines["plain"]["workloads"]["main"]["output_ids"]
    got = vllm_engines["configured"]["workloads"]["main"]["output_ids"]
    assert len(want) == NUM_PROMPTS
    assert got == want
    # vLLM's own lines: it compiled the body ahead of time (or loaded it from its compile cache),
    # under another cache key when traced: neither engine runs the other's graph
    found = [re.search(r"\[backbone\] (?:saved AOT compiled function to|Directly load AOT compilation from "
                       r"path) (\S+)", vllm_engines[name]["log"]) for name in ("configured", "plain")]
    assert all(found) and found[0].group(1) != found[1].group(1), found


def test_acceptance_equals_vllms_counters(vllm_engines) -> None:
    run = vllm_engines["configured"]
    spec = run["workloads"]["main"]["spec"]
    acc = diagnosis(run)["acceptance"]
    assert spec["num_drafts"] > NUM_PROMPTS  # several verify steps per request
    assert acc["steps"] == spec["num_drafts"]
    accepted = round(acc["mean_accept_length"] * acc["steps"]) - acc["steps"]
    assert accepted == spec["num_accepted_tokens"]
    per_pos = [round(r * acc["steps"]) for r in acc["per_position_rate"]]
    assert per_pos == spec["num_accepted_tokens_per_pos"]


def test_configured_draft_is_served_as_trained(vllm_engines) -> None:
    """The layers vLLM resolved (its record) are the profile's sources, every slot is measured on
    the same tokens as its trained source (equal to it, far from the next candidate), and the
    acceptance is judged and healthy: ``ok``, exit 0."""
    from hs_tracer.diagnosis.acceptance import AcceptanceThresholds

    run = vllm_engines["configured"]
    d = diagnosis(run)
    rep = next(r for r in run["reports"] if r["emitting"])
    assert rep["identity"]["sampled"] >= 1 and rep["identity"]["failed"] is None, rep["identity"]
    assert rep["identity"]["mode"] == "compiled" and rep["identity"]["graphs"] is None, rep["identity"]
    assert rep["identity"]["recorded"] >= 1 and rep["identity"]["no_last_block"] == 0, rep["identity"]
    assert rep["wiring"]["sources"] == TRAINED
    assert d["measured_identity"]["samples"] >= 1
    assert _measured(d) == TRAINED
    for slot in d["measured_identity"]["slots"]:
        assert slot["error"] <= 1e-3 < slot["runner_up_error"]
    assert [s["expected_source"] for s in d["slots"]] == [s["observed_source"] for s in d["slots"]] == TRAINED
    assert d["acceptance"]["steps"] >= AcceptanceThresholds().min_steps
    assert d["status"] == "ok" and Report.from_json(d).exit_code == 0, d["findings"]
    assert not [f for f in d["findings"] if f["code"] in ("slot_source_mismatch", "capture_record_mismatch")]


def test_a_capture_loop_that_feeds_later_layers_is_named_by_measurement(vllm_engines) -> None:
    """The target's loop captures every slot but the first after its layer instead of before, while
    vLLM's record (``aux_hidden_state_layers``) stays as configured: the measurement names each slot
    as fed, the engine's record is called wrong, exit 1; the served tokens are still plain decoding's
    (the draft only proposes)."""
    run = vllm_engines["late_deep"]
    fed = ["block:0", "block:4", "block:7"]
    assert run["workloads"]["main"]["output_ids"] == vllm_engines["plain"]["workloads"]["main"]["output_ids"]
    rep = next(r for r in run["reports"] if r["emitting"])
    assert rep["enabled"], rep["disabled_reason"]
    assert rep["identity"]["mode"] == "compiled", rep["identity"]
    assert rep["aux"]["layer_ids"] == [1, 4, 7] and rep["wiring"]["sources"] == TRAINED
    d = diagnosis(run)
    assert _measured(d) == fed
    assert [s["observed_source"] for s in d["slots"]] == fed
    assert d["status"] == "miswired" and Report.from_json(d).exit_code == 1, d["findings"]
    mismatches = [f for f in d["findings"] if f["code"] == "capture_record_mismatch"]
    assert {f["slot"] for f in mismatches} == {1, 2}, d["findings"]
    for f in mismatches:
        assert f["severity"] == "critical"
        assert (f["expected"], f["observed"]) == (TRAINED[f["slot"]], fed[f["slot"]])


def test_draft_without_ids_is_named_slot_by_slot(vllm_engines) -> None:
    """Eager (``enforce_eager``): the sampler's eager path measures vLLM's default layers as fed."""
    run = vllm_engines["ids_missing"]
    d = diagnosis(run)
    assert d["status"] == "miswired", d
    assert run["reports"][0]["identity"]["mode"] == "eager"
    assert _measured(d) == ["block:1", "block:3", "block:4"]
    assert Report.from_json(d).exit_code == 1
    wiring = run["reports"][0]["wiring"]
    assert wiring["layer_ids_key"] == "default" and wiring["layers_to_capture"] == [2, 4, 5]
    named = {f["slot"]: (f["expected"], f["observed"]) for f in d["findings"]
             if f["code"] == "slot_source_mismatch" and f["severity"] == "critical"}
    assert named == {0: ("block:0", "block:1"), 2: ("block:6", "block:4")}
    assert all('"eagle_aux_hidden_state_layer_ids": [1, 4, 7]' in f["fix"] for f in d["findings"]
               if f["code"] == "slot_source_mismatch" and f["severity"] == "critical")


def test_tensor_parallel_2_is_lossless_and_rank_0_alone_diagnoses(vllm_engines) -> None:
    """vLLM's CPU build with ``tensor_parallel_size=2`` (its multi-process executor: the scheduler in
    the engine core's process, a worker process per rank, gloo): greedy EAGLE-3 commits the tokens of
    plain TP 2 decoding with tracing on; the plugin loads in both workers, rank 0 alone emits and
    reads the trained wiring, and its report's acceptance, counted by the core's scheduler and
    joined to rank 0's steps over the SchedulerOutput, equals vLLM's own counters and is judged
    against the profile's expected acceptance (``ok``)."""
    run = vllm_engines["tp2"]
    # against plain decoding at TP 2: its all-reduce sums in another order than TP 1, and bf16
    # near-ties then flip a token
    want = vllm_engines["tp2:plain"]["workloads"]["main"]["output_ids"]
    assert run["workloads"]["main"]["output_ids"] == want
    assert run["workloads"]["main"]["spec"]["num_drafts"] > NUM_PROMPTS  # it speculated
    reports = sorted(run["reports"], key=lambda r: r["ranks"]["tp"])
    assert [(r["ranks"]["tp"], r["emitting"], r["enabled"], r["hook_errors"]) for r in reports] == [
        (0, True, True, 0), (1, False, True, 0)]
    d = diagnosis(run)
    assert reports[0]["wiring"]["sources"] == [s["expected_source"] for s in d["slots"]] == [
        "block:0", "block:3", "block:6"]
    assert Report.from_json(d).exit_code == 0, d["findings"]
    assert not [f for f in d["findings"] if f["code"] == "slot_source_mismatch"], d["findings"]
    spec = run["workloads"]["main"]["spec"]
    acc = d["acceptance"]
    assert acc["steps"] == spec["num_drafts"] and reports[0]["unjoined_steps"] == 0
    assert round(acc["mean_accept_length"] * acc["steps"]) - acc["steps"] == spec["num_accepted_tokens"]
    assert [round(r * acc["steps"]) for r in acc["per_position_rate"]] == spec["num_accepted_tokens_per_pos"]
    _judged_against_the_profile(d, vllm_engines.profile)


def _judged_against_the_profile(d: dict, profile: Path) -> None:
    """The live acceptance meets the profile's expectation: judged (enough steps, an expected value),
    not far below it; the same live counts against an expectation twice as high would be critical."""
    from dataclasses import replace

    from hs_tracer.diagnosis.acceptance import AcceptanceThresholds, acceptance_findings, bound
    from hs_tracer.profile.model import Profile

    live = Report.from_json(d).acceptance
    expected = Profile.load(profile).expected_acceptance
    assert live is not None and expected is not None
    assert live.steps >= AcceptanceThresholds().min_steps and bound(live, expected).expected is not None
    assert not [f for f in acceptance_findings(live, expected) if f.severity == "critical"]
    rates = [r / 4 for r in live.per_position_rate]
    collapsed = replace(live, mean_accept_length=1 + sum(rates), per_position_rate=rates)
    assert "critical" in [f.severity for f in acceptance_findings(collapsed, expected)]


def test_demo_says_the_configured_draft_is_served_as_trained_and_the_miswiring_caught(vllm_engines) -> None:
    """``hs-tracer demo --engine vllm``'s output and exit status on the real engines' reports: the
    configured draft is never told to fix anything (a slot the window cannot resolve is a warning
    asking for a measurement), the miswiring is caught."""
    from hs_tracer_testbed.demo import Run, exit_code, human

    runs = [Run(name, Path("target"), Path("draft"), [], [], [], vllm_engines[name]["reports"])
            for name in ("configured", "ids_missing")]
    lines = human(runs, expect_miswired=True).splitlines()
    assert ("   status: ok" in lines or "   status: warning" in lines) and "   status: miswired" in lines
    assert lines[-1].startswith("verdict: the draft as configured: ") and "fix this" not in lines[-1]
    # with what the miswiring costs on these prompts (both runs' live acceptance)
    assert re.search(r"; the deliberate miswiring \(ids_missing: accept length \d\.\d\d against \d\.\d\d as "
                     r"configured, [+-]\d+ %\) was caught$", lines[-1]), lines[-1]
    assert exit_code(runs, expect_miswired=True) == 0


@pytest.mark.parametrize("hook", HOOK_NAMES)
def test_fault_in_each_hook_leaves_serving_unchanged(vllm_engines, hook: str) -> None:
    want = vllm_engines["plain"]["workloads"]["main"]["output_ids"]
    fault = vllm_engines["faults"]["faults"][hook]
    assert fault["output_ids"] == want
    assert fault["tracer"]["enabled"] is False
    assert fault["tracer"]["disabled_reason"].startswith(f"{hook}: RuntimeError: fault injected")

"""hs_tracer inside real vLLM engines on CPU (the vLLM testbed pair): greedy decoding stays lossless
with tracing on, hs_tracer's acceptance equals vLLM's own spec-decode counters, the configured draft
is served as trained (nothing critical), a copy whose layer ids vLLM does not find is named slot by
slot, and a fault in any hook leaves the served tokens unchanged."""

from __future__ import annotations

import pytest

from tests.on_vllm.engines import HOOK_NAMES, NUM_PROMPTS, diagnosis


def test_greedy_eagle3_with_tracing_commits_exactly_the_plain_tokens(vllm_engines) -> None:
    want = vllm_engines["plain"]["workloads"]["main"]["output_ids"]
    got = vllm_engines["configured"]["workloads"]["main"]["output_ids"]
    assert len(want) == NUM_PROMPTS
    assert got == want


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
    """The engine's own ids match the profile's sources: nothing critical. On this small target the
    live statistics may not tell neighbouring layers apart (the slots are then reported ambiguous, a
    warning, never a mismatch)."""
    d = diagnosis(vllm_engines["configured"])
    assert d["status"] in ("ok", "warning"), d
    assert [s["expected_source"] for s in d["slots"]] == ["block:0", "block:3", "block:6"]
    assert not [f for f in d["findings"] if f["severity"] == "critical"], d["findings"]


def test_draft_without_ids_is_named_slot_by_slot(vllm_engines) -> None:
    run = vllm_engines["ids_missing"]
    d = diagnosis(run)
    assert d["status"] == "miswired", d
    wiring = run["reports"][0]["wiring"]
    assert wiring["layer_ids_key"] == "default" and wiring["layers_to_capture"] == [2, 4, 5]
    named = {f["slot"]: (f["expected"], f["observed"]) for f in d["findings"]
             if f["code"] == "slot_source_mismatch" and f["severity"] == "critical"}
    assert named == {0: ("block:0", "block:1"), 2: ("block:6", "block:4")}
    assert all('"eagle_aux_hidden_state_layer_ids": [1, 4, 7]' in f["fix"] for f in d["findings"]
               if f["code"] == "slot_source_mismatch" and f["severity"] == "critical")


@pytest.mark.parametrize("hook", HOOK_NAMES)
def test_fault_in_each_hook_leaves_serving_unchanged(vllm_engines, hook: str) -> None:
    want = vllm_engines["plain"]["workloads"]["main"]["output_ids"]
    fault = vllm_engines["faults"]["faults"][hook]
    assert fault["output_ids"] == want
    assert fault["tracer"]["enabled"] is False
    assert fault["tracer"]["disabled_reason"].startswith(f"{hook}: RuntimeError: fault injected")

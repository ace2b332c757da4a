"""End to end on the CPU testbed: real SGLang 0.5.23 EAGLE-3 engines with the hs_tracer plugin.

The engines are the suite's shared ones (tests/engine_runs.py); the tests read what each generated
and what its scheduler process reported:

* correct wiring -> status ok, acceptance as the testbed records it, and still ok after long prompts
  that share a long prefix (radix-cache hits);
* real misconfigurations made by editing the draft's config.json only -> the right finding and
  sources (hs_tracer_testbed.miswire);
* HS_TRACER unset -> the same tokens and the same SGLang acceptance counters, and no report;
* one exception injected per hook kind (HS_TRACER_FAULT_INJECT: a startup hook, a per-step BEFORE
  hook, a per-step AFTER hook, the recorder thread) -> the tokens of plain decoding, and the tracer
  reports itself disabled (every one of the nine hooks is faulted in-process in test_hook_faults.py);
* a real Prometheus scrapes the correct and a miswired engine while they run, and PromQL over the
  scraped counters agrees with each engine's own diagnosis; a real OTLP/HTTP receiver gets the
  sampled step spans.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.engine_runs import COUNTERS, ENGINES, FAULT_ENGINES, OLDER_RELEASE

pytestmark = [pytest.mark.engine, pytest.mark.timeout(3600)]

SCRAPED = sorted(name for name, spec in ENGINES.items() if spec.scraped)


def codes(diag: dict[str, Any]) -> set[str]:
    return {f["code"] for f in diag["findings"] if f["severity"] == "critical"}


def trained_sources(testbed) -> list[str]:
    return json.loads(Path(testbed.manifest).read_text())["layers"]["aux_sources"]


def test_correct_wiring_is_ok(engines, testbed) -> None:
    d = engines["correct"].diagnosis
    assert d["status"] == "ok", d["findings"]
    trained = trained_sources(testbed)
    assert [s["observed_source"] for s in d["slots"]] == trained
    assert [s["expected_source"] for s in d["slots"]] == trained
    assert d["acceptance"]["steps"] > 0
    assert d["acceptance"]["mean_accept_length"] > 1.3  # the trained draft is accepted
    assert d["wiring"]["sources"] == trained


def test_correct_wiring_stays_ok_with_prefix_reuse_and_long_prompts(engines) -> None:
    """Prefill rows depend on how much of a prompt the radix cache already holds; the verdict must not."""
    run = engines["correct"]
    # long prompts: about 175 tokens, twice the longest of the testbed corpus documents (under 90)
    assert min(m["prompt_tokens"] for m in run.meta("prefix_reuse")) > 150
    assert all(m["cached_tokens"] > 150 for m in run.meta("prefix_reuse#2"))  # sent again: from the cache
    before, after = run.diagnosis_after("replay"), run.diagnosis_after("prefix_reuse#2")
    assert after["acceptance"]["steps"] > before["acceptance"]["steps"]  # the verdict saw these steps
    assert after["status"] == "ok", after["findings"]
    assert [s["observed_source"] for s in after["slots"]] == [s["expected_source"] for s in after["slots"]]


def test_tracing_changes_neither_tokens_nor_acceptance(engines) -> None:
    traced, untraced = engines["correct"], engines["untraced"]
    assert traced.output_ids("lossless") == untraced.output_ids("lossless")
    counters = ("spec_verify_ct", COUNTERS.accepted_drafts)
    assert [[m[c] for c in counters] for m in traced.meta("lossless")] == \
        [[m[c] for c in counters] for m in untraced.meta("lossless")]
    assert untraced.schedulers == []


def test_aux_off_is_a_width_mismatch(engines) -> None:
    d = engines["aux_off"].diagnosis_after("diagnosis")
    assert d["status"] == "miswired"
    assert "draft_input_width_mismatch" in codes(d)
    assert d["acceptance"]["mean_accept_length"] < engines["correct"].diagnosis_after("diagnosis")[
        "acceptance"]["mean_accept_length"]


def test_ids_at_top_level_are_reported_ignored(engines, testbed) -> None:
    d = engines["ids_top_level"].diagnosis_after("diagnosis")
    found = {f["code"] for f in d["findings"]}
    assert "layer_ids_ignored" in found
    fed = d["wiring"]["sources"]
    trained = trained_sources(testbed)
    for slot in d["slots"]:  # whatever SGLang's default feeds, each slot is named as fed
        assert slot["expected_source"] == trained[slot["index"]]
        assert slot["observed_source"] == fed[slot["index"]]
    if fed != trained:
        assert d["status"] == "miswired"


def test_shifted_ids_put_the_embedding_in_slot_0(engines, testbed) -> None:
    """This engine runs the exporters and the diagnosis in their own process (HS_TRACER_EXPORT=process,
    the report says where) on the newest release."""
    run = engines["ids_shifted"]
    if not OLDER_RELEASE:
        where = run.report["export"]
        assert where["mode"] == "process" and where["pid"] != run.report["pid"]
    d = run.diagnosis_after("diagnosis")
    assert d["status"] == "miswired"
    assert "slot_source_mismatch" in codes(d)
    trained = trained_sources(testbed)
    slots = {s["index"]: s for s in d["slots"]}
    assert slots[0]["observed_source"] == "embedding"
    assert slots[0]["expected_source"] == trained[0]
    assert [s["observed_source"] for s in d["slots"]] == d["wiring"]["sources"]
    mismatches = {(f["slot"], f["expected"], f["observed"]) for f in d["findings"]
                  if f["code"] == "slot_source_mismatch"}
    assert (0, trained[0], "embedding") in mismatches


@pytest.mark.parametrize("kind", sorted(FAULT_ENGINES))
def test_fault_leaves_serving_unchanged(engines, kind: str) -> None:
    where = FAULT_ENGINES[kind][0]
    run = engines[f"fault:{kind}"]
    assert run.output_ids("lossless") == engines["plain"].output_ids("lossless")  # greedy EAGLE is lossless
    assert all(m["spec_verify_ct"] > 0 for m in run.meta("lossless"))  # speculation still ran
    report = run.report
    assert report["enabled"] is False
    assert report["hook_errors"] >= 1
    assert where in report["disabled_reason"]


@pytest.mark.parametrize("name", SCRAPED)
def test_promql_agrees_with_the_diagnosis(engines, name: str) -> None:
    d = engines[name].diagnosis
    prom, _otlp = engines.observers
    sel = f'instance="127.0.0.1:{engines.ports[name]}"'

    def total(metric: str, extra: str = "") -> float:
        return prom.value(f"sum(last_over_time({metric}{{{sel}{extra}}}[1h]))")

    acc = d["acceptance"]
    drafts = total("hs_tracer_drafts_total")
    assert drafts == acc["steps"]
    mean_accept_length = 1 + total("hs_tracer_accepted_tokens_total") / drafts
    assert mean_accept_length == pytest.approx(acc["mean_accept_length"], abs=1e-9)
    for i, rate in enumerate(acc["per_position_rate"]):
        per_position = total("hs_tracer_accepted_tokens_per_position_total", f',position="{i}"') / drafts
        assert per_position == pytest.approx(rate, abs=1e-9)
    scraped_slots = {
        int(labels["slot"]): (labels["expected_source"], labels["observed_source"])
        for labels, _v in prom.vector(f"last_over_time(hs_tracer_slot_match_score{{{sel}}}[1h]) >= 0")
    }
    assert scraped_slots == {s["index"]: (s["expected_source"], s["observed_source"]) for s in d["slots"]}


def test_sampled_step_spans_reach_the_otlp_endpoint(engines) -> None:
    engines["correct"]
    _prom, otlp = engines.observers
    spans = otlp.spans("hs_tracer.verify_step")
    assert spans, "no step spans arrived"
    attrs = spans[0].attributes
    assert attrs["hs_tracer.num_draft_tokens"] > 1
    assert "hs_tracer.input_width" in attrs
    assert not any("prompt" in key or "text" in key for key in attrs)


@pytest.mark.parametrize("name", ["correct", "ids_shifted"])  # exporters in the scheduler; in a process
def test_step_counts_equal_sglangs_on_batched_workloads(engines, name: str) -> None:
    """Every workload sends its prompts at once (batch > 1). After each, hs_tracer's request-steps
    (acceptance ``steps``: one per request and verify step SGLang committed) equal the sum of SGLang's
    per-request ``spec_verify_ct``, and its distinct verify steps (the report's ``overhead`` block)
    grew by at least the longest request's count and at most that sum: requests prefilled in separate
    batches decode in steps of their own, so SGLang's longest count is a lower bound of the steps."""
    run = engines[name]
    sglang_request_steps, steps_before = 0, 0
    for wl in run.spec.workloads:
        # a request that ends at its first token (EOS) is never verified: SGLang leaves the key out
        counts = [int(m.get("spec_verify_ct", 0)) for m in run.meta(wl)]
        assert len(counts) > 1 and max(counts) > 0
        sglang_request_steps += sum(counts)
        (report,) = [r for r in run.workloads[wl]["schedulers"] if r.get("emitting")]
        assert report["diagnosis"]["acceptance"]["steps"] == sglang_request_steps, wl
        steps = report["overhead"]["verify_steps"]
        assert max(counts) <= steps - steps_before <= sum(counts), (wl, steps - steps_before, counts)
        steps_before = steps
        cost = report["overhead"]
        assert cost["thread_cpu_us_per_step"] > 0 and cost["kernel_gpu_us_per_step"] is None  # the CPU

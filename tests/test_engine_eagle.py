"""End to end on the CPU testbed: real SGLang 0.5.23 EAGLE-3 engines with the hs_tracer plugin.

One subprocess runs every engine of this module in sequence (tests/engine_runs.py); the tests
then read what each engine generated and what its scheduler process reported:

* correct wiring -> status ok, acceptance as the testbed records it;
* real misconfigurations made by editing the draft's config.json only -> the right finding and
  sources (hs_tracer_testbed.miswire);
* HS_TRACER unset -> the same tokens and no report;
* an exception injected into each hook in turn (HS_TRACER_FAULT_INJECT) -> the same tokens as the
  untraced run, and the tracer reports itself disabled;
* a real Prometheus scrapes the correct and a miswired engine while they run, and PromQL over the
  scraped counters agrees with each engine's own diagnosis; a real OTLP/HTTP receiver gets the
  sampled step spans.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hs_tracer.integrations.sglang.hooks import HOOKS
from hs_tracer_testbed.corpus import prompts as corpus_prompts
from hs_tracer_testbed.miswire import SCENARIOS, write_variant
from tests.engine_runs import run_scenarios
from tests.infra.net import free_port
from tests.infra.otlp import OtlpReceiver
from tests.infra.prom import PrometheusServer, ensure_prometheus

pytestmark = [pytest.mark.engine, pytest.mark.timeout(3600)]  # ~16 engine starts

FAULTS = [*sorted(hook.__hs_tracer_where__ for _t, hook, _ty in HOOKS), "recorder"]
MISWIRED = sorted(SCENARIOS)


SCRAPED = {"correct": free_port(), "ids_shifted": free_port()}  # metrics port per scraped engine


@pytest.fixture(scope="module")
def observers(tmp_path_factory):
    """A real Prometheus scraping the scraped engines' metrics ports, and a real OTLP receiver."""
    binary = ensure_prometheus()
    prom = PrometheusServer([f"127.0.0.1:{port}" for port in SCRAPED.values()],
                            tmp_path_factory.mktemp("prometheus"), binary=binary).start()
    otlp = OtlpReceiver().start()
    yield prom, otlp
    prom.stop()
    otlp.stop()


@pytest.fixture(scope="module")
def runs(testbed, testbed_profile, observers, tmp_path_factory) -> dict[str, dict[str, Any]]:
    _prom, otlp = observers
    drafts = tmp_path_factory.mktemp("drafts")
    scenarios: list[dict[str, Any]] = [
        {"name": "untraced", "draft": str(testbed.draft), "traced": False},
    ]
    for name in ["correct", *MISWIRED]:
        draft = testbed.draft if name == "correct" else write_variant(testbed.draft, drafts / name, name)
        sc: dict[str, Any] = {"name": name, "draft": str(draft), "profile": str(testbed_profile)}
        if name in SCRAPED:
            sc["env"] = {"HS_TRACER_METRICS_PORT": str(SCRAPED[name]), "HS_TRACER_SPAN_SAMPLE": "1",
                         "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": otlp.endpoint,
                         "OTEL_BSP_SCHEDULE_DELAY": "200"}
            sc["linger_s"] = 3.0  # stay up for a few scrapes after the last step
        scenarios.append(sc)
    for where in FAULTS:
        scenarios.append({"name": f"fault:{where}", "draft": str(testbed.draft),
                          "profile": str(testbed_profile), "env": {"HS_TRACER_FAULT_INJECT": where}})
    return run_scenarios(testbed.target, scenarios, corpus_prompts(seed=1234, n=8), max_new_tokens=24)


def diagnosis(runs: dict[str, dict[str, Any]], name: str) -> dict[str, Any]:
    return runs[name]["diagnosis"]


def codes(diag: dict[str, Any]) -> set[str]:
    return {f["code"] for f in diag["findings"] if f["severity"] == "critical"}


def test_correct_wiring_is_ok(runs, testbed) -> None:
    d = diagnosis(runs, "correct")
    assert d["status"] == "ok", d["findings"]
    trained = testbed_sources(testbed)
    assert [s["observed_source"] for s in d["slots"]] == trained
    assert [s["expected_source"] for s in d["slots"]] == trained
    assert d["acceptance"]["steps"] > 0
    assert d["acceptance"]["mean_accept_length"] > 1.3  # the trained draft is accepted
    assert d["wiring"]["sources"] == trained


def test_tracing_does_not_change_tokens(runs) -> None:
    assert runs["correct"]["output_ids"] == runs["untraced"]["output_ids"]
    assert runs["untraced"]["schedulers"] == []


def test_aux_off_is_a_width_mismatch(runs) -> None:
    d = diagnosis(runs, "aux_off")
    assert d["status"] == "miswired"
    assert "draft_input_width_mismatch" in codes(d)
    assert d["acceptance"]["mean_accept_length"] < diagnosis(runs, "correct")["acceptance"][
        "mean_accept_length"]


def test_ids_at_top_level_are_reported_ignored(runs, testbed) -> None:
    d = diagnosis(runs, "ids_top_level")
    found = {f["code"] for f in d["findings"]}
    assert "layer_ids_ignored" in found
    fed = d["wiring"]["sources"]
    trained = testbed_sources(testbed)
    for slot in d["slots"]:  # whatever SGLang's default feeds, each slot is named as fed
        assert slot["expected_source"] == trained[slot["index"]]
        assert slot["observed_source"] == fed[slot["index"]]
    if fed != trained:
        assert d["status"] == "miswired"


def test_shifted_ids_put_the_embedding_in_slot_0(runs, testbed) -> None:
    d = diagnosis(runs, "ids_shifted")
    assert d["status"] == "miswired"
    assert "slot_source_mismatch" in codes(d)
    trained = testbed_sources(testbed)
    slots = {s["index"]: s for s in d["slots"]}
    assert slots[0]["observed_source"] == "embedding"
    assert slots[0]["expected_source"] == trained[0]
    assert [s["observed_source"] for s in d["slots"]] == d["wiring"]["sources"]
    mismatches = {(f["slot"], f["expected"], f["observed"]) for f in d["findings"]
                  if f["code"] == "slot_source_mismatch"}
    assert (0, trained[0], "embedding") in mismatches


@pytest.mark.parametrize("where", FAULTS)
def test_fault_in_a_hook_leaves_serving_unchanged(runs, where: str) -> None:
    run = runs[f"fault:{where}"]
    assert run["output_ids"] == runs["untraced"]["output_ids"]
    (report,) = run["schedulers"]
    assert report["enabled"] is False
    assert report["hook_errors"] >= 1
    assert where in report["disabled_reason"]


@pytest.mark.parametrize("name", sorted(SCRAPED))
def test_promql_agrees_with_the_diagnosis(runs, observers, name: str) -> None:
    prom, _otlp = observers
    sel = f'instance="127.0.0.1:{SCRAPED[name]}"'

    def total(metric: str, extra: str = "") -> float:
        return prom.value(f"sum(last_over_time({metric}{{{sel}{extra}}}[1h]))")

    d = diagnosis(runs, name)
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


def test_sampled_step_spans_reach_the_otlp_endpoint(runs, observers) -> None:
    _prom, otlp = observers
    spans = otlp.spans("hs_tracer.verify_step")
    assert spans, "no step spans arrived"
    attrs = spans[0].attributes
    assert attrs["hs_tracer.num_draft_tokens"] > 1
    assert "hs_tracer.input_width" in attrs
    assert not any("prompt" in key or "text" in key for key in attrs)


def testbed_sources(testbed) -> list[str]:
    import json

    return json.loads(Path(testbed.manifest).read_text())["layers"]["aux_sources"]

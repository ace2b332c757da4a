"""Every PromQL query of the dashboard and of the alert rules, against a real Prometheus server that
scrapes hs_tracer's real PrometheusExporter fed with realistic step records.

Two deployments are fed: a correct draft with modest acceptance and a miswired one (accept length
~1.0, slot 0 fed the wrong layer, a critical finding, the tracer switched off after a hook error).
Each dashboard query must return series; each alert expression must select exactly the miswired
deployment's series and never the correct one's.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import hs_tracer.dashboards as dashboards
from hs_tracer.dashboards import alerts, lint, overview
from hs_tracer.diagnosis.report import Report
from hs_tracer.export.prometheus import PrometheusExporter
from hs_tracer.findings import Code, Finding, Severity, SlotVerdict
from hs_tracer.records import Ranks, WiringRecord
from tests.infra.prom import PrometheusServer, ensure_prometheus
from tests.infra.steps import make_steps

NDT = 4
GOOD, BAD = "llama-eagle3", "llama-eagle3-miswired"
WINDOW = "10m"  # longer than the test: every rate() covers all samples, the first being the zero state
ALL = ".+"


def _wiring(model: str) -> WiringRecord:
    return WiringRecord(model=model, target_arch="LlamaForCausalLM", num_layers=8, hidden_size=32,
                        layers_to_capture=[2, 4, 6], sources=["block:1", "block:3", "block:5"],
                        configured_layer_ids=[1, 3, 5], draft_fc_in_features=96, draft_num_aux_states=3,
                        draft_graph_width=96, use_aux_hidden_state=True,
                        spec_args={"speculative_num_draft_tokens": NDT, "speculative_num_steps": NDT - 1},
                        engine_version="0.5.23")


@pytest.fixture(scope="module")
def prom(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrometheusServer]:
    exporters = {model: PrometheusExporter(model, Ranks(tp=0, pp=pp), port=0)
                 for model, pp in ((GOOD, 0), (BAD, 1))}
    server = PrometheusServer([f"127.0.0.1:{e.port}" for e in exporters.values()],
                              tmp_path_factory.mktemp("prometheus"), binary=ensure_prometheus())
    try:
        engine = {model: _sglang_metrics(e.registry, model) for model, e in exporters.items()}
        for model, e in exporters.items():
            e.record_wiring(_wiring(model))
            e.record_expected_accept_length(2.1)  # what both drafts reach on their training data
        server.start()
        server.wait_for_scrape(time.time())  # every pre-created series scraped at 0 first

        good, bad = exporters[GOOD], exporters[BAD]
        for rec in make_steps(150, seed=1, ranks=good.ranks, p_accept=0.45, num_draft_tokens=NDT):
            good.record_step(rec)
        good.record_checks({})
        good.record_slots([SlotVerdict(0, "block:1", "block:1", 1.0, measured_error=0.0, measured_rows=8,
                                       measured_runner_up_error=0.4),
                           SlotVerdict(1, "block:3", "block:3", 0.94, 0.3),
                           SlotVerdict(2, "block:5", "block:5", 0.95, 0.3)], drift=[0.8, 1.3, 0.6])
        good.record_finding(Finding(Code.INSUFFICIENT_DATA, Severity.INFO, "warming up"))
        good.record_health(dropped=0, hook_errors=0, enabled=True, host_overhead_s=9e-6, spans_dropped=0)

        for rec in make_steps(150, seed=2, ranks=bad.ranks, p_accept=0.02, num_draft_tokens=NDT):
            bad.record_step(rec)
        bad.record_slots([SlotVerdict(0, "block:1", "block:0", 0.91, 0.2),
                          SlotVerdict(1, "block:3", "block:3", 0.93, 0.3),
                          SlotVerdict(2, "block:5", "block:5", 0.92, 0.3)], drift=[1.1, 7.5, 0.9])
        mismatch = Finding(Code.SLOT_SOURCE_MISMATCH, Severity.CRITICAL, "slot 0 carries block:0",
                           "make the engine feed block:1 in slot 0", slot=0, expected="block:1",
                           observed="block:0")
        bad.record_finding(mismatch)
        bad.record_root_causes(Report(findings=[mismatch]).root_causes())
        bad.record_checks({"identity": "HS_TRACER_IDENTITY_EVERY=0"})
        bad.record_health(dropped=9, hook_errors=1, enabled=False, host_overhead_s=30e-6, spans_dropped=4)
        for model, (tokens, gauge, itl, ttft, running) in engine.items():
            fast = model == GOOD
            tokens.inc(4000 if fast else 1500)
            gauge.set(400.0 if fast else 150.0)
            running.set(4)
            for _ in range(50):
                itl.observe(0.01 if fast else 0.03)
                ttft.observe(0.2)
        for e in exporters.values():
            e.flush()  # steps are summed in Python and pushed at most every 0.5 s
        server.wait_for_scrape(time.time())
        yield server
    finally:
        server.stop()
        for e in exporters.values():
            e.close()


def _sglang_metrics(registry, model: str) -> tuple:
    """SGLang's own series the dashboard's serving row reads, with SGLang's names, types and labels
    (model_name, tp_rank: not hs_tracer's model), on the same /metrics as hs_tracer's, as
    ``--enable-metrics`` serves them (tests/test_dashboards.py checks the names against SGLang)."""
    from prometheus_client import Counter, Gauge, Histogram

    from hs_tracer.dashboards import engine_metrics as em

    labels = {"model_name": model, "tp_rank": "0"}
    names = list(labels)

    def bare(name: str) -> str:
        return name.removesuffix("_total")

    tokens = Counter(bare(em.SGLANG_GENERATION_TOKENS), "generated tokens", names, registry=registry)
    return (tokens.labels(**labels),
            Gauge(em.SGLANG_GEN_THROUGHPUT, "tokens/s", names, registry=registry).labels(**labels),
            Histogram(em.SGLANG_ITL, "itl", names, registry=registry).labels(**labels),
            Histogram(em.SGLANG_TTFT, "ttft", names, registry=registry).labels(**labels),
            Gauge(em.SGLANG_RUNNING_REQS, "running", names, registry=registry).labels(**labels))


def _dashboard() -> dict:
    return json.loads(overview.render())


def test_every_dashboard_query_returns_series(prom: PrometheusServer) -> None:
    queries = dashboards.dashboard_queries(rate_window=WINDOW)
    assert len(queries) == len(lint.expressions(_dashboard())) >= 25
    empty = [f"{where}: {expr}" for where, expr in queries.items() if not prom.query(expr)]
    assert not empty, "queries without series:\n" + "\n".join(empty)


def test_dashboard_queries_separate_the_two_deployments(prom: PrometheusServer) -> None:
    """The per-model acceptance panels show a useless draft near 1.0 and a modest one well above."""
    values = {"job": ALL, "instance": ALL, "model": ALL, "__rate_interval": WINDOW}
    by_title = {title: expr for title, ref, expr in lint.expressions(_dashboard()) if ref == "A"}
    lengths = {labels["model"]: v for labels, v in
               prom.vector(lint.substitute(by_title["Mean accept length per model and rank"], values))}
    assert lengths[BAD] < 1.1 < 1.5 < lengths[GOOD] < 2.5
    mismatch = prom.vector(lint.substitute(by_title["Slot wiring mismatch"], values))
    assert {(lab["model"], lab["slot"]) for lab, v in mismatch if v == 1} == {(BAD, "0")}
    # the $model variable really narrows the queries
    only_good = prom.vector(lint.substitute(by_title["Mean accept length per model and rank"],
                                            {**values, "model": GOOD}))
    assert [lab["model"] for lab, _v in only_good] == [GOOD]


def test_template_variable_queries_return_values(prom: PrometheusServer) -> None:
    for v in lint.variables(_dashboard()):
        if v["type"] != "query":
            continue
        inner = v["query"][len("label_values("):-1]
        selector, label = (part.strip() for part in inner.rsplit(",", 1))
        selector = lint.substitute(selector, {"job": ALL, "instance": ALL})
        result = prom.vector(f"count by ({label}) ({selector})")
        assert result, f"variable {v['name']} would offer no values"
        if v["name"] == "model":
            assert {lab["model"] for lab, _ in result} == {GOOD, BAD}


EXPECTED_FIRING = {
    "HsTracerAcceptLengthNearOne": {BAD},
    "HsTracerAcceptanceDrop": set(),  # needs a 6h baseline: a fresh deployment is judged by the floor
    "HsTracerCriticalWiringFinding": {BAD},
    "HsTracerSlotSourceMismatch": {BAD},
    "HsTracerFeatureDrift": {BAD},
    "HsTracerDisabled": {BAD},
    "HsTracerHookErrors": {BAD},
    "HsTracerRecordsDropped": {BAD},
    "HsTracerChecksOff": {BAD},
    # both deployments are scraped with hs_tracer loaded: the presence rules stay quiet
    "HsTracerAbsent": set(),
    "HsTracerNotLoaded": set(),
    "HsTracerScrapeDown": set(),
}


@pytest.mark.parametrize("alert", sorted(EXPECTED_FIRING))
def test_alert_expression_selects_only_the_broken_deployment(prom: PrometheusServer, alert: str) -> None:
    rules = dashboards.alert_queries()
    assert set(rules) == set(EXPECTED_FIRING)
    result = prom.vector(rules[alert])
    assert {labels["model"] for labels, _ in result} == EXPECTED_FIRING[alert]
    if alert == "HsTracerSlotSourceMismatch":  # the page names both sources, from the real labels
        [(labels, score)] = result
        slot = (labels["slot"], labels["expected_source"], labels["observed_source"])
        assert slot == ("0", "block:1", "block:0")
        assert score == pytest.approx(0.91)
    if alert == "HsTracerAcceptLengthNearOne":
        [(_labels, length)] = result
        assert 1.0 <= length < alerts.AL_FLOOR


def test_rule_and_dashboard_files_are_the_ones_tested(prom: PrometheusServer) -> None:
    """The module's rules and dashboard are what the committed files hold (so the live checks above
    cover what is deployed)."""
    root = Path(__file__).resolve().parents[1]
    assert (root / "grafana/dashboards" / overview.FILENAME).read_text() == overview.render()

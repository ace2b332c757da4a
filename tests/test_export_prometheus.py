"""Prometheus exporter against a real Prometheus server: the PromQL in docs/metrics.md returns the
acceptance figures computed independently from the same step records."""

from __future__ import annotations

import logging
import math
import multiprocessing
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from dataclasses import replace as dc_replace
from pathlib import Path

import numpy as np
import pytest

from hs_tracer.export.prometheus import PrometheusExporter, metrics_port_for
from hs_tracer.findings import Code, Finding, Severity, SlotVerdict
from hs_tracer.fingerprint.stats import DIGEST_WIDTH, StepDigest
from hs_tracer.records import Ranks, StepRecord, WiringRecord
from tests.infra.mp_writer import write_steps
from tests.infra.net import wait_until
from tests.infra.prom import PrometheusServer
from tests.infra.steps import make_steps

# Real Prometheus / OTLP receiver fixtures (also fine once tests/conftest.py lists the plugin).
pytest_plugins = ["tests.infra.fixtures"]

NDT = 4  # speculative_num_draft_tokens: 3 draft positions
MODEL = "tiny-llama-eagle3"
W = "[10m]"  # longer than any test: rate() spans all samples, first sample is the all-zero state


def wiring() -> WiringRecord:
    return WiringRecord(model=MODEL, target_arch="LlamaForCausalLM", num_layers=8, hidden_size=32,
                        layers_to_capture=[2, 4, 6], sources=["block:1", "block:3", "block:5"],
                        configured_layer_ids=[1, 3, 5], draft_fc_in_features=96, draft_num_aux_states=3,
                        draft_graph_width=96, use_aux_hidden_state=True,
                        spec_args={"speculative_num_draft_tokens": NDT, "speculative_num_steps": NDT - 1},
                        engine_version="0.5.23")


def expected(records: list[StepRecord]) -> dict[str, object]:
    """Acceptance figures straight from the records (the definitions of docs/metrics.md, as vLLM's)."""
    lengths = [a for r in records for a in r.accept_lengths]
    drafts = len(lengths)
    accepted = sum(a - 1 for a in lengths)
    return {
        "acceptance_rate": accepted / (drafts * (NDT - 1)),
        "mean_accept_length": sum(lengths) / drafts,
        "per_position": [sum(1 for a in lengths if a - 1 > i) / drafts for i in range(NDT - 1)],
        "steps": len(records),
        "drafts": drafts,
    }


def by_label(result: list[tuple[dict[str, str], float]], label: str) -> dict[str, float]:
    return {labels[label]: value for labels, value in result}


Factory = Callable[..., PrometheusServer]


def test_promql_matches_records_per_rank_and_slots(prometheus_factory: Factory) -> None:
    exporters = {tp: PrometheusExporter(MODEL, Ranks(tp=tp), port=0) for tp in (0, 1)}
    try:
        for e in exporters.values():
            assert e.port is not None and not e.multiprocess
            e.record_wiring(wiring())
        prom = prometheus_factory([f"127.0.0.1:{e.port}" for e in exporters.values()])
        prom.wait_for_scrape(time.time())  # every series scraped at 0 first

        records = {tp: make_steps(150, seed=10 + tp, ranks=Ranks(tp=tp), p_accept=p, num_draft_tokens=NDT)
                   for tp, p in ((0, 0.75), (1, 0.3))}
        for tp, e in exporters.items():
            for rec in records[tp]:
                e.record_step(rec)
            e.flush()  # what the recorder does when its queue runs empty
        # rank 0: slot 0 first identified as block:0, then as block:2 (the older series must go NaN)
        e0 = exporters[0]
        e0.record_slots([SlotVerdict(0, "block:1", "block:0", 0.81, 0.05),
                         SlotVerdict(1, "block:3", "block:3", 0.97, 0.30),
                         SlotVerdict(2, "block:5", "block:5", 0.95, 0.25)], drift=[0.9, 0.02, 0.03])
        e0.record_slots([SlotVerdict(0, "block:1", "block:2", 0.93, 0.12)], drift=[0.8])
        finding = Finding(Code.SLOT_SOURCE_MISMATCH, Severity.CRITICAL, "slot 0 carries block:2",
                          slot=0, expected="block:1", observed="block:2")
        for e in exporters.values():
            e.record_finding(finding)
        e0.record_health(dropped=3, hook_errors=0, enabled=True, host_overhead_s=12e-6, spans_dropped=2)
        e0.record_health(dropped=5, hook_errors=1, enabled=False, host_overhead_s=20e-6, spans_dropped=2)
        prom.wait_for_scrape(time.time())

        # Acceptance, per rank, in the rate() forms of docs/metrics.md.
        rate = prom.vector(f"sum by (tp_rank) (rate(hs_tracer_accepted_tokens_total{W}))"
                           f" / sum by (tp_rank) (rate(hs_tracer_draft_tokens_total{W}))")
        mean_len = prom.vector(f"1 + sum by (tp_rank) (rate(hs_tracer_accepted_tokens_total{W}))"
                               f" / sum by (tp_rank) (rate(hs_tracer_drafts_total{W}))")
        hist_len = prom.vector(f"sum by (tp_rank) (rate(hs_tracer_accept_length_sum{W}))"
                               f" / sum by (tp_rank) (rate(hs_tracer_accept_length_count{W}))")
        per_pos = prom.vector(
            f"sum by (tp_rank, position) (rate(hs_tracer_accepted_tokens_per_position_total{W}))"
            f" / ignoring(position) group_left sum by (tp_rank) (rate(hs_tracer_drafts_total{W}))")
        for tp in (0, 1):
            want = expected(records[tp])
            rank = str(tp)
            assert by_label(rate, "tp_rank")[rank] == pytest.approx(want["acceptance_rate"], rel=1e-9)
            assert by_label(mean_len, "tp_rank")[rank] == pytest.approx(want["mean_accept_length"], rel=1e-9)
            assert by_label(hist_len, "tp_rank")[rank] == pytest.approx(want["mean_accept_length"], rel=1e-9)
            got = {labels["position"]: v for labels, v in per_pos if labels["tp_rank"] == str(tp)}
            assert [got[str(i)] for i in range(NDT - 1)] == pytest.approx(want["per_position"], rel=1e-9)
            assert prom.value(f'hs_tracer_verify_steps_total{{tp_rank="{tp}"}}') == want["steps"]
        # The two ranks' acceptance really differs, so the per-rank checks above can fail.
        assert expected(records[0])["mean_accept_length"] > expected(records[1])["mean_accept_length"] + 0.5

        # Across ranks, cumulative totals (exact whatever the scrape timing).
        everything = records[0] + records[1]
        want = expected(everything)
        assert prom.value("sum(hs_tracer_accepted_tokens_total) / sum(hs_tracer_draft_tokens_total)") == \
            pytest.approx(want["acceptance_rate"], rel=1e-9)
        assert prom.value("sum(hs_tracer_accept_length_sum) / sum(hs_tracer_accept_length_count)") == \
            pytest.approx(want["mean_accept_length"], rel=1e-9)
        # Histogram buckets: le="1" counts the request-steps where every draft token was rejected.
        assert prom.value('sum(hs_tracer_accept_length_bucket{le="1.0"})') == \
            sum(1 for r in everything for a in r.accept_lengths if a == 1)

        # Slots: the mismatch indicator, the current match score, the superseded series as NaN.
        mismatched = prom.vector("hs_tracer_slot_mismatch == 1")
        assert [(labels["slot"], v) for labels, v in mismatched] == [("0", 1.0)]
        current = prom.vector('hs_tracer_slot_match_score{slot="0"} >= 0')
        assert [(labels["expected_source"], labels["observed_source"], v) for labels, v in current] == \
            [("block:1", "block:2", 0.93)]
        stale = prom.vector('hs_tracer_slot_match_score{slot="0", observed_source="block:0"}')
        assert len(stale) == 1 and math.isnan(stale[0][1])
        assert by_label(prom.vector("hs_tracer_slot_drift_score"), "slot") == {"0": 0.8, "1": 0.02, "2": 0.03}
        assert by_label(prom.vector("hs_tracer_slot_match_margin"), "slot")["0"] == pytest.approx(0.12)
        last = records[0][-1].digest
        assert last is not None
        rms = by_label(prom.vector('hs_tracer_slot_rms{tp_rank="0"}'), "slot")
        assert [rms[str(k)] for k in range(3)] == pytest.approx([s.rms for s in last.slots], rel=1e-9)

        info = prom.vector('hs_tracer_wiring_info{tp_rank="0"} == 1')
        assert len(info) == 1
        labels = info[0][0]
        assert labels["sources"] == "block:1,block:3,block:5"
        assert labels["layers_to_capture"] == "2,4,6"
        assert labels["expected_width"] == "96" and labels["use_aux_hidden_state"] == "true"
        findings = 'hs_tracer_findings_total{code="slot_source_mismatch",severity="critical"}'
        assert prom.value(f"sum({findings})") == 2
        assert prom.value('hs_tracer_records_dropped_total{tp_rank="0"}') == 5
        assert prom.value('hs_tracer_hook_errors_total{tp_rank="0"}') == 1
        assert prom.value('hs_tracer_spans_dropped_total{tp_rank="0"}') == 2
        assert by_label(prom.vector("hs_tracer_enabled"), "tp_rank") == {"0": 0.0, "1": 1.0}
        assert prom.value('hs_tracer_host_overhead_seconds_count{tp_rank="0"}') == 2
        assert prom.value('hs_tracer_host_overhead_seconds_sum{tp_rank="0"}') == pytest.approx(32e-6)
    finally:
        for e in exporters.values():
            e.close()


def test_multiprocess_mode_aggregates_ranks(prometheus_factory: Factory,
                                            tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two spawned 'schedulers' write with PROMETHEUS_MULTIPROC_DIR set; one MultiProcessCollector
    serves both (as SGLang's /metrics does) and rate() across ranks is exact in PromQL."""
    from prometheus_client import CollectorRegistry, multiprocess, start_http_server

    mp_dir = tmp_path / "prom_mp"
    mp_dir.mkdir()
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(mp_dir))
    ctx = multiprocessing.get_context("spawn")
    plan = {0: (21, 0.8), 1: (22, 0.2)}
    ready = {tp: ctx.Event() for tp in plan}
    go = ctx.Event()
    procs = [ctx.Process(target=write_steps, args=(MODEL, tp, wiring(), seed, 80, p, ready[tp], go))
             for tp, (seed, p) in plan.items()]
    for p in procs:
        p.start()
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(mp_dir))
    server, _ = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        for tp, event in ready.items():
            assert event.wait(120), f"writer tp={tp} did not start"
        prom = prometheus_factory([f"127.0.0.1:{server.server_address[1]}"])
        prom.wait_for_scrape(time.time())
        go.set()
        for p in procs:
            p.join(120)
            assert p.exitcode == 0
        prom.wait_for_scrape(time.time())

        records = [r for tp, (seed, p) in plan.items()
                   for r in make_steps(80, seed=seed, ranks=Ranks(tp=tp), p_accept=p)]
        want = expected(records)
        rate = prom.value(f"sum(rate(hs_tracer_accepted_tokens_total{W}))"
                          f" / sum(rate(hs_tracer_draft_tokens_total{W}))")
        assert rate == pytest.approx(want["acceptance_rate"], rel=1e-9)
        mean_len = prom.value(f"sum(rate(hs_tracer_accept_length_sum{W}))"
                              f" / sum(rate(hs_tracer_accept_length_count{W}))")
        assert mean_len == pytest.approx(want["mean_accept_length"], rel=1e-9)
        per_pos = prom.vector(f"sum by (position) (rate(hs_tracer_accepted_tokens_per_position_total{W}))"
                              f" / ignoring(position) group_left sum(rate(hs_tracer_drafts_total{W}))")
        got = by_label(per_pos, "position")
        assert [got[str(i)] for i in range(NDT - 1)] == pytest.approx(want["per_position"], rel=1e-9)
        # Gauges in multiprocess mode: one series per rank, no pid label.
        enabled = prom.vector("hs_tracer_enabled")
        assert sorted(labels["tp_rank"] for labels, _ in enabled) == ["0", "1"]
        assert all("pid" not in labels for labels, _ in enabled)
        assert prom.value("sum(hs_tracer_records_dropped_total)") == 1 + 2
        assert len(prom.vector("hs_tracer_wiring_info == 1")) == 2
    finally:
        go.set()
        server.shutdown()
        server.server_close()
        for p in procs:
            if p.is_alive():
                p.kill()


def test_port_in_use_logs_and_keeps_recording(caplog: pytest.LogCaptureFixture) -> None:
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with caplog.at_level(logging.WARNING, logger="hs_tracer"):
            e = PrometheusExporter(MODEL, Ranks(), port=port)
        assert e.port is None
        assert [r.message for r in caplog.records if "cannot serve metrics" in r.message]
        rec = make_steps(1, seed=1)[0]
        e.record_step(rec)
        e.flush()
        drafts = e.registry.get_sample_value("hs_tracer_drafts_total",
                                             {"model": MODEL, "engine": "sglang", **Ranks().labels()})
        assert drafts == len(rec.accept_lengths)


def test_metrics_port_for_is_unique_per_process_on_a_host() -> None:
    ports = {metrics_port_for(Ranks(tp=tp, pp=pp, dp=dp))
             for tp in range(8) for pp in range(8) for dp in range(4)}
    assert len(ports) == 8 * 8 * 4
    assert metrics_port_for(Ranks()) == 9464
    assert metrics_port_for(Ranks(tp=3, pp=1), base=20000) == 20011


def run_python(code: str, **env: str) -> str:
    import os

    full_env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    full_env.update(env)
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full_env, capture_output=True,
                         text=True, timeout=300, check=True)
    return out.stdout + out.stderr


def test_importing_exporters_loads_no_metrics_or_tracing_client() -> None:
    """SGLang's main process imports the plugin before it sets PROMETHEUS_MULTIPROC_DIR: importing
    hs_tracer's exporter modules must not import prometheus_client or the OTel SDK."""
    out = run_python("""
        import sys
        import hs_tracer.export.prometheus, hs_tracer.export.otel
        print(sorted(m for m in sys.modules if m.startswith(("prometheus_client", "opentelemetry"))))
    """)
    assert out.strip() == "[]"


def test_multiprocess_dir_set_too_late_falls_back_to_own_port(tmp_path: Path) -> None:
    out = run_python(f"""
        import logging, os
        logging.basicConfig(level=logging.WARNING)
        import prometheus_client  # imported before the variable is set: in-memory values
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = {str(tmp_path)!r}
        from hs_tracer.export.prometheus import PrometheusExporter
        from hs_tracer.records import Ranks
        e = PrometheusExporter("m", Ranks(), port=0)
        print("multiprocess", e.multiprocess, "serving", e.port is not None)
        e.close()
    """)
    assert "multiprocess False serving True" in out
    assert "imported before it was" in out


def test_close_frees_the_port() -> None:
    e = PrometheusExporter(MODEL, Ranks(), port=0)
    port = e.port
    assert port is not None
    e.close()
    with socket.socket() as s:  # a restarted recorder can serve on it again
        s.bind(("0.0.0.0", port))


def test_own_endpoint_binds_the_address_from_the_config() -> None:
    from hs_tracer import config

    cfg, errors = config.load({"HS_TRACER_METRICS_ADDR": "127.0.0.1"})
    assert not errors and config.TracerConfig().metrics_addr == "0.0.0.0"
    e = PrometheusExporter(MODEL, Ranks(), port=0, addr=cfg.metrics_addr)
    try:
        assert e._server is not None and e._server.server_address[0] == "127.0.0.1"
    finally:
        e.close()


@pytest.mark.parametrize("fast", [True, False])
def test_batched_histogram_update_equals_one_observe_per_request(fast: bool) -> None:
    """The exporter adds equal accept lengths in one go; the exposition must be exactly what one
    prometheus_client observe() per request gives (both the fast path and its fallback)."""
    from prometheus_client import CollectorRegistry, Histogram

    from hs_tracer.export.prometheus import ACCEPT_LENGTH_BUCKETS

    e = PrometheusExporter(MODEL, Ranks(), serve=False)
    assert e._accept_length.fast  # this prometheus_client release takes the fast path
    e._accept_length.fast = fast
    reference = Histogram("hs_tracer_accept_length", "reference", buckets=ACCEPT_LENGTH_BUCKETS,
                          registry=CollectorRegistry())
    for rec in make_steps(60, seed=3, num_draft_tokens=6, p_accept=0.6):
        e.record_step(rec)
        for length in rec.accept_lengths:
            reference.observe(length)
    e.flush()
    labels = {"model": MODEL, "engine": "sglang", **Ranks().labels()}
    got = {(s.name, s.labels.get("le")): s.value for m in e.registry.collect() for s in m.samples
           if s.name.startswith("hs_tracer_accept_length") and not s.name.endswith("_created")
           and {k: v for k, v in s.labels.items() if k != "le"} == labels}
    want = {(s.name, s.labels.get("le")): s.value for m in reference.collect() for s in m.samples
            if not s.name.endswith("_created")}
    assert got == want
    assert want[("hs_tracer_accept_length_bucket", "1.0")] > 0
    assert want[("hs_tracer_accept_length_count", None)] > 60


def test_nonfinite_width_and_rewiring_in_registry() -> None:
    e = PrometheusExporter(MODEL, Ranks(dp=1), serve=False)
    labels = {"model": MODEL, "engine": "sglang", **Ranks(dp=1).labels()}
    raw = np.zeros((3, DIGEST_WIDTH))
    raw[:, 0], raw[:, 4] = 10, (0, 0, 4)
    rec = dc_replace(make_steps(1, seed=2)[0], digest=StepDigest.from_raw(4, raw), input_width=32)
    e.record_step(rec)
    e.record_step(rec)
    e.flush()
    assert e.registry.get_sample_value("hs_tracer_slot_nonfinite_values_total", {**labels, "slot": "2"}) == 8
    assert e.registry.get_sample_value("hs_tracer_slot_nonfinite_values_total", {**labels, "slot": "0"}) == 0
    assert e.registry.get_sample_value("hs_tracer_draft_input_width", labels) == 32  # H, not K*H

    first = wiring()
    second = dc_replace(first, layers_to_capture=[1, 4, 6], sources=["block:0", "block:3", "block:5"])
    e.record_wiring(first)
    e.record_wiring(second)
    info = {s.labels["sources"]: s.value for m in e.registry.collect() if m.name == "hs_tracer_wiring_info"
            for s in m.samples}
    assert info == {"block:1,block:3,block:5": 0.0, "block:0,block:3,block:5": 1.0}


def test_steps_reach_the_metrics_at_flush() -> None:
    labels = {"model": MODEL, "engine": "sglang", **Ranks().labels()}
    lazy = PrometheusExporter(MODEL, Ranks(), serve=False, flush_interval_s=3600)
    eager = PrometheusExporter(MODEL, Ranks(), serve=False, flush_interval_s=0)
    records = make_steps(5, seed=8)
    for rec in records:
        lazy.record_step(rec)
        eager.record_step(rec)
    assert lazy.registry.get_sample_value("hs_tracer_verify_steps_total", labels) == 0
    assert eager.registry.get_sample_value("hs_tracer_verify_steps_total", labels) == 5
    lazy.flush()
    for name in ("hs_tracer_verify_steps_total", "hs_tracer_drafts_total", "hs_tracer_accepted_tokens_total",
                 "hs_tracer_accept_length_sum", "hs_tracer_last_step_timestamp_seconds"):
        assert lazy.registry.get_sample_value(name, labels) == eager.registry.get_sample_value(name, labels)
    assert lazy.registry.get_sample_value("hs_tracer_last_step_timestamp_seconds", labels) == \
        records[-1].time_unix_ns / 1e9


def test_pending_steps_reach_the_metrics_when_the_recorder_goes_quiet() -> None:
    labels = {"model": MODEL, "engine": "sglang", **Ranks().labels()}
    e = PrometheusExporter(MODEL, Ranks(), serve=False, flush_interval_s=0.05)
    for rec in make_steps(3, seed=8):
        e.record_step(rec)  # no flush() call: the idle flusher must push them
    wait_until(lambda: e.registry.get_sample_value("hs_tracer_verify_steps_total", labels) == 3, 30,
               "the idle flush")
    e.close()

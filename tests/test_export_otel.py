"""OTel exporter against a real OTLP/HTTP receiver (protobuf decoded with opentelemetry-proto), and
against SGLang 0.5.23's own request tracing (real ``TraceReqContext``, in a fresh interpreter
because SGLang installs the process-global tracer provider)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from hs_tracer.export.otel import SCOPE_NAME, SPAN_NAME, OtelExporter
from hs_tracer.export.prometheus import PrometheusExporter
from hs_tracer.findings import SlotVerdict
from hs_tracer.fingerprint.stats import DIGEST_WIDTH, StepDigest
from hs_tracer.records import Ranks, WiringRecord
from tests.infra.net import free_port, wait_until
from tests.infra.otlp import OtlpReceiver
from tests.infra.steps import make_steps

# Real Prometheus / OTLP receiver fixtures (also fine once tests/conftest.py lists the plugin).
pytest_plugins = ["tests.infra.fixtures"]

MODEL = "tiny-llama-eagle3"
REPO = Path(__file__).resolve().parents[1]


def wiring() -> WiringRecord:
    return WiringRecord(model=MODEL, target_arch="LlamaForCausalLM", num_layers=8, hidden_size=32,
                        layers_to_capture=[2, 4, 6], sources=["block:1", "block:3", "block:5"],
                        draft_fc_in_features=96)


def test_sampled_spans_reach_the_receiver(otlp_receiver: OtlpReceiver,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from opentelemetry import trace

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", otlp_receiver.endpoint)
    monkeypatch.setenv("OTEL_SERVICE_NAME", "hs-tracer-under-test")
    exporter = OtelExporter(MODEL, Ranks(tp=2, pp=1), sample=0.01)
    exporter.record_wiring(wiring())
    exporter.record_slots([SlotVerdict(1, "block:3", "block:3", 0.97),
                           SlotVerdict(0, "block:1", "block:2", 0.9)])
    records = make_steps(250, seed=5, ranks=Ranks(tp=2, pp=1))
    bad = records[150].digest
    assert bad is not None
    raw = np.zeros((3, DIGEST_WIDTH))
    raw[:, 0], raw[:, 4] = 10, (0, 7, 0)  # slot 1 saw 7 NaN/Inf values: always exported
    records[150] = replace(records[150], digest=StepDigest.from_raw(bad.tokens, raw))
    returned = [exporter.record_step(r) for r in records]
    exporter.force_flush()
    spans = otlp_receiver.wait_for_spans(4, SPAN_NAME)
    exporter.shutdown()

    by_step = {s.attributes["hs_tracer.step"]: s for s in spans}
    assert sorted(by_step) == [0, 100, 150, 200]  # 1 in 100, plus the non-finite step
    assert [i for i, ctx in enumerate(returned) if ctx is not None] == [0, 100, 150, 200]
    for step, span in by_step.items():
        rec = records[step]
        a = span.attributes
        assert span.scope == SCOPE_NAME
        assert span.resource["service.name"] == "hs-tracer-under-test"
        assert span.start_unix_ns == span.end_unix_ns == rec.time_unix_ns
        assert (a["hs_tracer.model"], a["hs_tracer.tp_rank"], a["hs_tracer.pp_rank"]) == (MODEL, 2, 1)
        assert a["hs_tracer.accept_length.histogram"] == [rec.accept_lengths.count(j) for j in (1, 2, 3, 4)]
        assert a["hs_tracer.accept_length.mean"] == pytest.approx(np.mean(rec.accept_lengths))
        assert a["hs_tracer.accepted_tokens"] == sum(x - 1 for x in rec.accept_lengths)
        assert a["hs_tracer.batch_size"] == len(rec.accept_lengths)
        assert a["hs_tracer.slot.source"] == ["block:1", "block:3", "block:5"]
        assert a["hs_tracer.slot.expected_source"] == ["block:1", "block:3"]
        assert a["hs_tracer.slot.observed_source"] == ["block:2", "block:3"]
        assert a["hs_tracer.expected_width"] == 96 == a["hs_tracer.input_width"]
        assert rec.digest is not None
        assert a["hs_tracer.slot.rms"] == pytest.approx([s.rms for s in rec.digest.slots])
        assert a["hs_tracer.slot.nonfinite"] == [s.nonfinite for s in rec.digest.slots]
        assert all(key.startswith("hs_tracer.") for key in a)  # nothing else: no tensors, no text
    assert by_step[150].attributes["hs_tracer.slot.nonfinite"] == [0, 7, 0]
    assert (exporter.exported, exporter.dropped, exporter.uses_sglang_provider) == (4, 0, False)
    # hs_tracer never installs the process-global provider (SGLang does, once per process).
    assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)


def test_base_endpoint_variable_is_honoured(otlp_receiver: OtlpReceiver,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{otlp_receiver.port}")
    exporter = OtelExporter(MODEL, Ranks(), sample=1.0)
    for rec in make_steps(3, seed=1):
        exporter.record_step(rec)
    exporter.force_flush()
    assert len(otlp_receiver.wait_for_spans(3, SPAN_NAME)) == 3
    exporter.shutdown()


def test_stalled_collector_never_blocks_the_recorder(otlp_receiver: OtlpReceiver,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """While the collector holds an export request unanswered, record_step keeps returning and the
    spans that do not fit the bounded queue are dropped and counted, not buffered."""
    queue = 16
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", otlp_receiver.endpoint)
    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", str(queue))
    monkeypatch.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "8")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "20")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "60")
    exporter = OtelExporter(MODEL, Ranks(), sample=1.0)
    records = make_steps(320, seed=9)
    otlp_receiver.hold()
    for rec in records[:20]:
        exporter.record_step(rec)
    wait_until(lambda: otlp_receiver.requests >= 1, 30, "the exporter's first request")
    for rec in records[20:]:  # the collector is stalled on that request all along
        exporter.record_step(rec)
    assert otlp_receiver.spans() == []  # still nothing answered: the loop above did not wait for it
    assert exporter.dropped >= len(records) - queue
    otlp_receiver.release()
    exporter.force_flush()
    wait_until(lambda: exporter.exported + exporter.dropped == len(records), 60, "every span accounted")
    assert len(otlp_receiver.spans(SPAN_NAME)) == exporter.exported == len(records) - exporter.dropped
    exporter.shutdown()


def test_collector_down_spans_dropped_and_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    closed = free_port()  # nothing listens there
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", f"http://127.0.0.1:{closed}/v1/traces")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "1")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "20")
    exporter = OtelExporter(MODEL, Ranks(), sample=1.0)
    records = make_steps(50, seed=4)
    for rec in records:
        exporter.record_step(rec)
    wait_until(lambda: exporter.dropped == len(records), 120, "all spans counted as dropped")
    assert exporter.exported == 0
    metrics = PrometheusExporter(MODEL, Ranks(), serve=False)
    metrics.record_health(dropped=0, hook_errors=0, enabled=True, spans_dropped=exporter.dropped)
    labels = {"model": MODEL, "engine": "sglang", **Ranks().labels()}
    assert metrics.registry.get_sample_value("hs_tracer_spans_dropped_total", labels) == len(records)
    exporter.shutdown(timeout_s=1.0)


SGLANG_SCRIPT = """
    import json, os, pickle, time
    from opentelemetry import trace
    from sglang.srt.observability import trace as sgl_trace
    from hs_tracer.export.otel import OtelExporter
    from hs_tracer.records import Ranks, StepRecord

    sgl_trace.process_tracing_init(os.environ["RECEIVER"], "sglang-under-test")
    sgl_trace.trace_set_thread_info("scheduler", tp_rank=0, dp_rank=0, pp_rank=0)
    ctx = sgl_trace.TraceReqContext("rid-0123456789")   # tokenizer side: the request's root span
    ctx.trace_req_start()
    root = ctx.root_span.get_span_context()
    sched = pickle.loads(pickle.dumps(ctx))              # shipped to the scheduler, as SGLang does
    sched.rebuild_thread_context()
    sched.trace_slice_start("decode", level=1)
    rec = StepRecord(step=7, time_unix_ns=time.time_ns(), ranks=Ranks(), request_ids=["rid-0123456789", "x"],
                     accept_lengths=[3, 1], num_draft_tokens=4, input_width=96)
    exporter = OtelExporter("m", Ranks(), sample=1.0)
    step_span = exporter.record_step(rec, trace_ctxs=[sched, sgl_trace.TraceNullContext()])
    time.sleep(0.01)
    sched.trace_slice_end("decode", level=1, thread_finish_flag=True)
    ctx.trace_req_finish()
    trace.get_tracer_provider().force_flush()
    print(json.dumps({"uses_sglang_provider": exporter.uses_sglang_provider,
                      "root": [format(root.trace_id, "032x"), format(root.span_id, "016x")],
                      "step_span": format(step_span.span_id, "016x")}))
"""


def test_sglang_request_trace_gets_events_and_links(otlp_receiver: OtlpReceiver) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "SGLANG_"))}
    env.update(RECEIVER=otlp_receiver.endpoint, OTEL_EXPORTER_OTLP_TRACES_PROTOCOL="http/protobuf")
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(SGLANG_SCRIPT)], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    facts = json.loads(out.stdout.strip().splitlines()[-1])
    assert facts["uses_sglang_provider"] is True
    root_trace, root_span = facts["root"]

    ours = otlp_receiver.wait_for_spans(1, SPAN_NAME)
    assert len(ours) == 1
    span = ours[0]
    assert span.resource["service.name"] == "sglang-under-test"  # SGLang's provider, SGLang's pipeline
    assert [(ln.trace_id, ln.span_id) for ln in span.links] == [(root_trace, root_span)]
    assert span.span_id == facts["step_span"]

    decode = otlp_receiver.wait_for_spans(1, "decode")[0]
    assert decode.trace_id == root_trace
    events = [e for e in decode.events if e.name == "hs_tracer.verify"]
    assert len(events) == 1  # the untraced request got none
    attrs = events[0].attributes
    assert (attrs["hs_tracer.accept_length"], attrs["hs_tracer.step"]) == (3, 7)
    assert attrs["hs_tracer.step_time_unix_ns"] == span.start_unix_ns
    assert attrs["hs_tracer.step_span_id"] == span.span_id
    assert attrs["hs_tracer.step_trace_id"] == span.trace_id


def test_sampler_saying_no_and_bad_settings_leave_nothing_pending(otlp_receiver: OtlpReceiver,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", otlp_receiver.endpoint)
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")  # honoured: no span is recorded
    exporter = OtelExporter(MODEL, Ranks(), sample=1.0)
    assert all(exporter.record_step(r) is None for r in make_steps(20, seed=6))
    exporter.force_flush()
    assert (exporter.exported, exporter.dropped, exporter._in_flight) == (0, 0, 0)
    assert otlp_receiver.requests == 0
    exporter.shutdown()

    monkeypatch.delenv("OTEL_TRACES_SAMPLER")
    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "lots")
    broken = OtelExporter(MODEL, Ranks(), sample=1.0)
    assert all(broken.record_step(r) is None for r in make_steps(3, seed=6))  # no exception
    assert broken.spans_off_reason is not None and "lots" in broken.spans_off_reason

"""The hand-off of verify steps from SGLang's scheduler thread to the recorder thread, with real SGLang
objects: the scheduler thread only appends references, the recorder works them off in batches and
gets the same numbers as one step at a time, every step's host time reaches the histogram, and
request-trace events are written into SGLang's trace contexts by the scheduler thread only."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hs_tracer.export.analysis import AcceptanceTally, OwnCost, length_counts
from hs_tracer.export.batch import StepBatch
from hs_tracer.export.prometheus import (
    HOST_OVERHEAD,
    KERNEL_GPU,
    OVERHEAD_BUCKETS,
    THREAD_CPU,
    PrometheusExporter,
)
from hs_tracer.records import Ranks

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("max_accept", [None, 3])
def test_batched_tally_equals_the_tally_one_step_at_a_time(max_accept: int | None) -> None:
    """topk > 1: 8 draft tokens in the tree but at most 3 acceptable (max_accept 3 -> 2 positions)."""
    rng = np.random.default_rng(5)
    steps = [rng.integers(1, (max_accept or 8) + 1, size=rng.integers(1, 40)) for _ in range(50)]
    one, batched = AcceptanceTally(), AcceptanceTally()
    for lengths in steps:
        one.add(lengths.tolist(), 8, max_accept)
    batched.add_counts(length_counts(np.concatenate(steps)), 8, max_accept)
    assert (batched.steps, batched.accepted_tokens, batched.per_position) == (
        one.steps, one.accepted_tokens, one.per_position)
    assert len(batched.per_position) == (7 if max_accept is None else 2)


@pytest.mark.parametrize("size", [0, 5, 20_000])
def test_length_counts_equal_a_bincount(size: int) -> None:
    """Both ways of counting (one bincount for small batches, one comparison per value for large
    ones) give the same counts; lengths below 1 count as 0."""
    lengths = np.random.default_rng(size).integers(-1, 9, size=size).astype(np.int32)
    got = length_counts(lengths)
    want = np.bincount(np.maximum(lengths, 0), minlength=1)
    assert got.tolist() == want.tolist()


def test_a_batch_from_the_step_log_keeps_what_each_step_committed() -> None:
    """Steps logged across the end of the log's slots (runs that wrap), with skipped requests and
    both kinds of accept lengths, come out as one batch per run with exactly what each step
    committed, in order; a full log drops the new steps and counts them."""
    import torch

    from hs_tracer.export.batch import StepBatch
    from hs_tracer.export.step_log import StepLog

    rng = np.random.default_rng(3)
    log = StepLog(8)
    no_digests = (np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros((0, 3, 5), np.float32))
    step = 0
    for run_length in (5, 6, 8, 3):  # 5 + 6 crosses the end of the 8 slots, 8 fills them
        want_lengths, want_sizes, want_reqs = [], [], []
        for _ in range(run_length):
            step += 1
            lens = rng.integers(1, 5, size=6)
            skip = sorted(rng.choice(6, size=rng.integers(0, 3), replace=False).tolist()) if step % 3 else []
            reqs = tuple(f"r{step}.{i}" for i in range(6))
            accept = torch.tensor(lens, dtype=torch.int32) if step % 2 else lens.tolist()
            assert log.append(step, 10 * step, accept, reqs, skip, 4, step * 1e-6)
            want_lengths += [int(x) for i, x in enumerate(lens) if i not in skip]
            want_sizes.append(6 - len(skip))
            want_reqs.append([r for i, r in enumerate(reqs) if i not in skip])
        assert len(log) == run_length
        batch = StepBatch.from_run(log.take(), *no_digests, requests=True)
        assert batch.steps.tolist() == list(range(step - run_length + 1, step + 1))
        assert batch.time_unix_ns.tolist() == (10 * batch.steps).tolist()
        assert batch.lengths.tolist() == want_lengths and batch.sizes.tolist() == want_sizes
        assert batch.requests == want_reqs
        assert [part.tolist() for part in batch.step_lengths()] == [
            want_lengths[sum(want_sizes[:i]):sum(want_sizes[:i + 1])] for i in range(run_length)]
        halves = batch.split(2)
        assert np.concatenate([h.lengths for h in halves]).tolist() == want_lengths
        assert [len(h) for h in halves] == [2] * (run_length // 2) + [1] * (run_length % 2)
        assert log.take() is None
    for i in range(10):
        log.append(100 + i, 0, [2], ("x",), [], 4, 0.0)
    assert len(log) == 8 and log.dropped == 2
    assert log.take().steps.tolist() == list(range(100, 108))  # the first 8: the new ones were dropped
    assert all(ref is None for ref in log._accept) and all(ref is None for ref in log._reqs)


def test_sampled_steps_of_a_batch_equal_asking_step_by_step() -> None:
    from hs_tracer.export.otel import OtelExporter

    one, batched = OtelExporter("m", Ranks(), sample=0.1), OtelExporter("m", Ranks(), sample=0.1)
    picked: list[int] = []
    offset = 0
    for count, bad in ((7, []), (13, [2, 12]), (1, [0]), (30, [])):
        picked += [offset + i for i in batched.sampled_steps(count, bad)]
        offset += count
    asked = [i for i in range(offset) if one.wants_span(nonfinite=i in (9, 19, 20))]
    assert picked == asked == [0, 9, 10, 19, 20, 30, 40, 50]


def test_host_overhead_histogram_observes_every_step() -> None:
    from prometheus_client import CollectorRegistry, Histogram

    e = PrometheusExporter("m", Ranks(), serve=False)
    reference = Histogram(HOST_OVERHEAD, "reference", buckets=OVERHEAD_BUCKETS, registry=CollectorRegistry())
    values = np.random.default_rng(2).exponential(20e-6, size=500)
    e.record_batch(500, np.zeros(1, dtype=np.int64), 0, 0, None, None, [], values.tolist())
    e.flush()
    for v in values.tolist():
        reference.observe(v)
    labels = {"model": "m", "engine": "sglang", **Ranks().labels()}

    def samples(collected, keep):
        return {(s.name, s.labels.get("le")): round(s.value, 12) for m in collected for s in m.samples
                if s.name.startswith(HOST_OVERHEAD) and not s.name.endswith("_created") and keep(s)}

    got = samples(e.registry.collect(), lambda s: {k: v for k, v in s.labels.items() if k != "le"} == labels)
    want = samples(reference.collect(), lambda s: True)
    assert got == want and want[(f"{HOST_OVERHEAD}_count", None)] == 500


def _batch(steps: int, host_s: float, thread_cpu_s: float) -> StepBatch:
    ints = np.arange(steps, dtype=np.int64)
    return StepBatch(steps=ints, time_unix_ns=ints, num_draft_tokens=np.full(steps, 4),
                     host_s=np.full(steps, host_s), sizes=np.ones(steps, np.int64),
                     lengths=np.ones(steps, np.int64),
                     digest_steps=ints[:0], digest_tokens=ints[:0], digest_raws=np.zeros((0, 3, 5)),
                     thread_cpu_s=thread_cpu_s)


def test_recorder_thread_cpu_reaches_the_counter_once_and_the_cost_per_step() -> None:
    """A batch's thread CPU travels with its first chunk only (splitting never counts it twice),
    is added to the counter and to the per-step cost, which sums hooks, thread and kernel."""
    chunks = _batch(10, 4e-6, 3e-3).split(4)
    assert [c.thread_cpu_s for c in chunks] == [3e-3, 0.0, 0.0]
    e = PrometheusExporter("m", Ranks(), serve=False)
    cost = OwnCost()
    for c in [*chunks, _batch(10, 4e-6, 1e-3)]:
        e.record_batch(len(c), np.zeros(1, dtype=np.int64), 0, 0, None, None, [], c.host_s.tolist(),
                       thread_cpu_s=c.thread_cpu_s)
        cost.add(c)
    e.flush()
    e.record_kernel_gpu(7e-6)
    labels = {"model": "m", "engine": "sglang", **Ranks().labels()}
    assert e.registry.get_sample_value(THREAD_CPU + "_total", labels) == pytest.approx(4e-3)
    assert e.registry.get_sample_value(KERNEL_GPU, labels) == 7e-6
    got = cost.to_json(7e-6)
    assert got["verify_steps"] == 20 and got["hook_us_per_step"] == pytest.approx(4.0)
    assert got["thread_cpu_us_per_step"] == pytest.approx(200.0)  # 4 ms over 20 steps
    assert got["host_us_per_step"] == pytest.approx(204.0)
    assert got["kernel_gpu_us_per_step"] == pytest.approx(7.0)
    assert got["total_us_per_step"] == pytest.approx(211.0)
    on_cpu = cost.to_json(None)  # no kernel on the GPU: the total is the host part
    assert on_cpu["kernel_gpu_us_per_step"] is None and on_cpu["total_us_per_step"] == pytest.approx(204.0)
    assert OwnCost().to_json(None)["total_us_per_step"] is None  # before the first step


CHILD = r"""
import json, os, sys, threading, time
from types import SimpleNamespace
from hs_tracer_testbed.runtime.inproc import init_world_of_one
init_world_of_one()
import torch
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
from sglang.srt.managers.utils import GenerationBatchResult
from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.observability import trace as sgl_trace
from hs_tracer.config import TracerConfig
from hs_tracer.core import recorder as recorder_mod
from hs_tracer.integrations.sglang import hooks

# SGLang's request tracing on (a collector that is never reached: nothing here is flushed)
sgl_trace.process_tracing_init("http://127.0.0.1:9/v1/traces", "handoff-test")
sgl_trace.trace_set_thread_info("scheduler", tp_rank=0, dp_rank=0, pp_rank=0)

from tests.infra.tiny_tracer import H, K, NDT, started
recorder_mod.BATCH_INTERVAL_S = 0.01
st = started(TracerConfig(metrics_port=int(sys.argv[1]), window_tokens=1 << 20))

writers = []
def traced_req(rid):
    req = Req(rid, "", [1, 2, 3], SamplingParams(max_new_tokens=8))
    ctx = sgl_trace.TraceReqContext(rid)
    ctx.trace_req_start()
    real = ctx.trace_event
    def trace_event(*a, **k):
        writers.append(threading.current_thread().name)
        return real(*a, **k)
    ctx.trace_event = trace_event
    req.time_stats.trace_ctx = ctx
    return req

reqs = [traced_req("a"), traced_req("b")]
batch = ScheduleBatch(reqs=reqs)
worker = SimpleNamespace()
def step(lengths):
    res = GenerationBatchResult(logits_output=LogitsProcessorOutput(
        next_token_logits=None, hidden_states=torch.ones(2 * NDT, K * H)))
    hooks.before_draft_extend_for_decode(worker, batch, res)
    res.accept_lens = torch.tensor(lengths, dtype=torch.int32)
    res.speculative_num_draft_tokens = NDT
    hooks.after_resolve_spec_v2_tokens(None, None, res, batch.copy())

for i in range(30):
    step([1 + i % 4, 2])
deadline = time.monotonic() + 60
while st.recorder.analysis.acceptance.steps < 60 and time.monotonic() < deadline:
    time.sleep(0.01)
recorded = st.recorder.analysis.acceptance.steps
while not st.recorder.analysis.cost.thread_cpu_s and time.monotonic() < deadline:
    time.sleep(0.01)  # the wake-up that worked the steps off attributes its CPU right after
assert st.recorder.mode == "thread"  # SGLang traces requests: the exporters stay in this process
step([2, 2])                                     # the scheduler thread's next step delivers the rest
prom = st.recorder.analysis._prom
prom.flush()
labels = {"model": "tiny", "engine": "sglang", **st.ranks.labels()}
out = {
    "request_steps": recorded,
    "accepted_tokens": st.recorder.analysis.acceptance.accepted_tokens,
    "writers": writers,
    "main": threading.current_thread().name,
    "hist_count": prom.registry.get_sample_value("hs_tracer_host_overhead_seconds_count", labels),
    "verify_steps": prom.registry.get_sample_value("hs_tracer_verify_steps_total", labels),
    "thread_cpu": prom.registry.get_sample_value("hs_tracer_thread_cpu_seconds_total", labels),
    "overhead": st.status().get("overhead"),
    "enabled": st.enabled, "reason": st.disabled_reason,
}
st.recorder.stop()
st.recorder.join(5)
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def child() -> dict:
    from tests.infra.net import free_port

    proc = subprocess.run([sys.executable, "-c", CHILD, str(free_port())], capture_output=True, text=True,
                          timeout=900, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-5000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def test_recorder_batches_count_every_step(child: dict) -> None:
    assert child["enabled"], child["reason"]
    assert child["request_steps"] == 60
    assert child["accepted_tokens"] == sum(1 + i % 4 for i in range(30)) + 2 * 30
    assert child["verify_steps"] == 30
    assert child["hist_count"] == 30  # every step's host time, not a sample


def test_the_recorder_threads_cpu_time_is_counted_per_step(child: dict) -> None:
    """The recorder thread runs in the scheduler process: its CPU time is part of hs_tracer's cost,
    exported as a counter and per step in the report (here in-thread, on the CPU: no kernel)."""
    assert child["thread_cpu"] > 0
    cost = child["overhead"]
    assert cost["verify_steps"] >= 30 and cost["thread_cpu_us_per_step"] > 0 and cost["hook_us_per_step"] > 0
    assert cost["kernel_gpu_us_per_step"] is None
    parts = cost["hook_us_per_step"] + cost["thread_cpu_us_per_step"]
    assert cost["total_us_per_step"] == pytest.approx(parts, abs=2e-3)


def test_request_trace_events_are_written_by_the_scheduler_thread_only(child: dict) -> None:
    """The recorder prepares one event per traced request and step; the scheduler thread writes
    them into SGLang's trace contexts at its next verify step, never the recorder thread."""
    assert len(child["writers"]) == 60 and set(child["writers"]) == {child["main"]}


def test_wiring_record_is_assembled_from_the_startup_hooks_reads_alone() -> None:
    """Startup assembly is a pure function: the same hook reads give the same record, with no
    SGLang process or tracer state behind it."""
    from hs_tracer.integrations.sglang.state import wiring_record

    target = {"architecture": "DeepseekV3ForCausalLM", "model_path": "/models/DeepSeek-V3/", "num_layers": 61,
              "hidden_size": 7168, "layers_to_capture": [2, 30, 58]}
    aux = {"use_aux_hidden_state": True, "layer_ids": [1, 29, 57]}
    draft = {"fc_in_features": 3 * 7168, "num_aux_hidden_states": 3, "graph_width": 3 * 7168}
    spec = {"speculative_num_steps": 3, "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 4}
    w = wiring_record(target, aux, draft, spec, "0.5.23")
    assert w == wiring_record(dict(target), dict(aux), dict(draft), dict(spec), "0.5.23")
    assert (w.model, w.sources, w.configured_layer_ids, w.draft_fc_in_features, w.expected_width,
            w.sglang_version) == ("DeepSeek-V3", ["block:1", "block:29", "block:57"], [1, 29, 57], 21504,
                                  21504, "0.5.23")
    spec["speculative_num_steps"] = 5
    assert w.spec_args["speculative_num_steps"] == 3  # the record keeps its own copy


def test_accept_lengths_joined_into_reused_memory_equal_a_fresh_join() -> None:
    """The export process's joins go into one scratch tensor (grown as needed, kept between joins):
    each join gives what a fresh ``torch.cat`` gives, skipped requests removed."""
    import torch

    from hs_tracer.export.batch import Scratch, committed_lengths

    rng = np.random.default_rng(7)
    scratch = Scratch()
    for steps, batch in ((3, 4), (40, 16), (5, 2)):  # grows, then a smaller join reuses the memory
        accept = [torch.tensor(rng.integers(1, 5, size=batch), dtype=torch.int32) for _ in range(steps)]
        sizes = np.full(steps, batch)
        skips = [(1, [0, batch - 1])]
        want = committed_lengths(accept, sizes, skips)
        got = committed_lengths(accept, sizes, skips, scratch)
        assert got[0].tolist() == want[0].tolist() and got[1].tolist() == want[1].tolist()
    assert scratch.tensor.numel() >= 40 * 16

"""Cost of exporting one verify step: Prometheus counters/histogram and sampled OTel spans.

Method: realistic step records (batch 32, K=3 slots, 4 draft tokens) are fed to the exporters the
way the recorder thread does. Every variant runs side by side in the same process, interleaved
round by round, and is charged the whole process's CPU time (``time.process_time``: the calling
thread *and* the BatchSpanProcessor thread that serialises and POSTs the spans), with a flush at the
end of each round so export work is not left outside the measurement. Metrics are flushed every
FLUSH_EVERY steps and spans exported every EXPORT_EVERY steps, the production cadence at 50 verify
steps/s. The OTLP receiver runs in a
separate process so its decoding is not charged. The multiprocess-mode (mmap) Prometheus variant
needs ``PROMETHEUS_MULTIPROC_DIR`` before prometheus_client is imported, so it runs in a child
process of the same invocation.

Run from the repository root:  .venv/bin/python benchmarks/export_overhead.py [--steps N] [--rounds R]
With ``--sglang-events`` it measures instead the per-request events hs_tracer adds to SGLang's own
request traces when SGLang tracing is on (real ``TraceReqContext`` objects; imports SGLang).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests.infra: the record generator and the OTLP receiver

from hs_tracer.export.otel import DEFAULT_SPAN_SAMPLE, OtelExporter  # noqa: E402
from hs_tracer.export.prometheus import PrometheusExporter  # noqa: E402
from hs_tracer.findings import SlotVerdict  # noqa: E402
from hs_tracer.records import Ranks, StepRecord, WiringRecord  # noqa: E402
from tests.infra.steps import make_steps  # noqa: E402

BATCH = 32
NUM_DRAFT_TOKENS = 4
FLUSH_EVERY = 25
"""Steps per metrics flush: the default 0.5 s flush interval at 50 verify steps/s per scheduler
(faster steps put more steps in a flush and make the per-step cost smaller)."""
EXPORT_EVERY = 250
"""Steps per OTLP export request: the SDK's 5 s batch delay at 50 verify steps/s, so at the
default sampling a request carries 2-3 spans, as in production."""


def records(n: int) -> list[StepRecord]:
    return make_steps(n, seed=0, max_batch=BATCH, num_draft_tokens=NUM_DRAFT_TOKENS)


def fixed_batch(recs: list[StepRecord]) -> list[StepRecord]:
    """Pad every step to exactly BATCH requests, so the cost is per batch-of-32 step."""
    out = []
    for r in recs:
        lengths = (r.accept_lengths * BATCH)[:BATCH]
        out.append(StepRecord(r.step, r.time_unix_ns, r.ranks, [f"r{i}" for i in range(BATCH)], lengths,
                              r.num_draft_tokens, r.digest, r.input_width))
    return out


WIRING = WiringRecord(model="bench", target_arch="DeepseekV3ForCausalLM", num_layers=61, hidden_size=7168,
                      layers_to_capture=[2, 30, 58], sources=["block:1", "block:29", "block:57"],
                      spec_args={"speculative_num_draft_tokens": NUM_DRAFT_TOKENS})
VERDICTS = [SlotVerdict(i, s, s, 0.97, 0.3) for i, s in enumerate(WIRING.sources)]


Step = Callable[[StepRecord], object]
Flush = Callable[[], object]


def measure(fn: Step, recs: list[StepRecord], flush: Flush) -> tuple[float, float]:
    """(CPU µs per step, wall µs per step) for one round."""
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for r in recs:
        fn(r)
    flush()
    return ((time.process_time() - cpu0) / len(recs) * 1e6, (time.perf_counter() - wall0) / len(recs) * 1e6)


def flushing(record: Step, flush: Flush, every: int) -> Step:
    """``record`` plus a ``flush`` every ``every`` steps, as the time-based flushes would do."""
    counter = [0]

    def step(r: StepRecord) -> None:
        record(r)
        counter[0] += 1
        if counter[0] % every == 0:
            flush()

    return step


def start_receiver() -> tuple[subprocess.Popen[str], str]:
    code = ("import sys, time\nfrom tests.infra.otlp import OtlpReceiver\nr = OtlpReceiver().start()\n"
            "print(r.endpoint, flush=True)\nsys.stdin.read()\n")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    return proc, proc.stdout.readline().strip()


def main_multiprocess_child(steps: int, rounds: int) -> None:
    """Runs with PROMETHEUS_MULTIPROC_DIR set: the mmap value path SGLang --enable-metrics uses."""
    exporter = PrometheusExporter("bench", Ranks(), flush_interval_s=math.inf)
    assert exporter.multiprocess
    exporter.record_wiring(WIRING)
    recs = fixed_batch(records(steps))
    step = flushing(exporter.record_step, exporter.flush, FLUSH_EVERY)
    cpu = [measure(step, recs, exporter.flush)[0] for _ in range(rounds)]
    print(json.dumps({"prometheus_multiprocess": cpu}))


def main_sglang_events(steps: int, rounds: int) -> None:
    """Per-request events on SGLang's real request traces (only when SGLang tracing is on): 32
    traced requests, each a scheduler-side copy of a tokenizer-side context, as SGLang ships them."""
    import pickle

    os.environ.setdefault("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    from sglang.srt.observability import trace as sgl_trace

    from hs_tracer.export.otel import attach_events, step_events

    sgl_trace.process_tracing_init("http://127.0.0.1:9/v1/traces", "bench")  # never flushed here
    sgl_trace.trace_set_thread_info("scheduler", tp_rank=0, dp_rank=0, pp_rank=0)
    contexts = []
    for i in range(BATCH):
        ctx = sgl_trace.TraceReqContext(f"rid-{i}")
        ctx.trace_req_start()
        sched = pickle.loads(pickle.dumps(ctx))
        sched.rebuild_thread_context()
        sched.trace_slice_start("decode", level=1)
        contexts.append(sched)
    recs = fixed_batch(records(steps))

    def step(r: StepRecord) -> None:
        attach_events(step_events(r, contexts))
        for ctx in contexts:  # SGLang's per-step decode_loop slice takes the buffered events away
            ctx.events_cache.clear()

    cpu = [measure(step, recs, lambda: None)[0] for _ in range(rounds)]
    print(json.dumps({"sglang_events": cpu}), flush=True)
    os._exit(0)  # skip SGLang's exit-time span export to the closed port


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000, help="steps per round and variant")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--multiprocess-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--sglang-events", action="store_true",
                        help="instead: cost of per-request events on SGLang request traces (imports SGLang)")
    args = parser.parse_args()
    if args.sglang_events:
        main_sglang_events(args.steps, args.rounds)
        return
    if args.multiprocess_child:
        main_multiprocess_child(args.steps, args.rounds)
        return

    receiver, endpoint = start_receiver()
    os.environ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] = endpoint
    try:
        recs = fixed_batch(records(args.steps))
        prom = PrometheusExporter("bench", Ranks(), serve=False, flush_interval_s=math.inf)
        prom_every = PrometheusExporter("bench-every", Ranks(), serve=False, flush_interval_s=0)
        for p in (prom, prom_every):
            p.record_wiring(WIRING)
            p.record_slots(VERDICTS)
        prom_step = flushing(prom.record_step, prom.flush, FLUSH_EVERY)
        otel_default = OtelExporter("bench", Ranks(), sample=DEFAULT_SPAN_SAMPLE)
        otel_all = OtelExporter("bench", Ranks(), sample=1.0)
        for exp in (otel_default, otel_all):
            exp.record_wiring(WIRING)
            exp.record_slots(VERDICTS)

        otel_step = flushing(otel_default.record_step, otel_default.force_flush, EXPORT_EVERY)

        def both(r: StepRecord) -> None:
            prom_step(r)
            otel_step(r)

        default = f"prometheus + otel sample={DEFAULT_SPAN_SAMPLE} (recorder default)"
        variants: dict[str, tuple[Step, Flush]] = {
            "loop only (baseline)": (lambda r: None, lambda: None),
            f"prometheus record_step, flush every {FLUSH_EVERY} steps (default)": (prom_step, prom.flush),
            "prometheus record_step, flush every step": (prom_every.record_step, lambda: None),
            f"otel record_step, sample={DEFAULT_SPAN_SAMPLE} (default)":
                (otel_step, otel_default.force_flush),
            "otel record_step, sample=1.0 (every step)": (otel_all.record_step, otel_all.force_flush),
            default: (both, lambda: (prom.flush(), otel_default.force_flush())),
        }
        for fn, flush in variants.values():  # warm-up: first span, HTTP connection, lazy imports
            measure(fn, recs[:200], flush)
        cpu: dict[str, list[float]] = {name: [] for name in variants}
        wall: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, (fn, flush) in variants.items():
                c, w = measure(fn, recs, flush)
                cpu[name].append(c)
                wall[name].append(w)
        with tempfile.TemporaryDirectory() as mp_dir:
            child = subprocess.run(
                [sys.executable, __file__, "--multiprocess-child", "--steps", str(args.steps),
                 "--rounds", str(args.rounds)], env={**os.environ, "PROMETHEUS_MULTIPROC_DIR": mp_dir},
                capture_output=True, text=True, check=True)
        mp = json.loads(child.stdout.strip().splitlines()[-1])["prometheus_multiprocess"]
        otel_default.shutdown()
        otel_all.shutdown()
    finally:
        receiver.kill()
        receiver.wait()

    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"Python {platform.python_version()}, {platform.platform()}, load average {load}")
    print(f"steps/round {args.steps}, rounds {args.rounds}, batch {BATCH}, K=3, "
          f"draft tokens {NUM_DRAFT_TOKENS}")
    print(f"{'variant':64s} {'CPU µs/step median [min..max]':>32s} {'wall µs/step':>12s}")
    for name in variants:
        c = cpu[name]
        print(f"{name:64s} {statistics.median(c):10.2f} [{min(c):.2f}..{max(c):.2f}] "
              f"{statistics.median(wall[name]):12.2f}")
    mp_name = f"prometheus record_step, flush every {FLUSH_EVERY}, multiprocess mode (child)"
    print(f"{mp_name:64s} {statistics.median(mp):10.2f} [{min(mp):.2f}..{max(mp):.2f}]")
    span_cost = statistics.median(cpu["otel record_step, sample=1.0 (every step)"]) - \
        statistics.median(cpu["loop only (baseline)"])
    total = statistics.median(cpu[default])
    print(f"one exported span ≈ {span_cost:.1f} µs CPU; recorder default ≈ {total:.1f} µs CPU per step, "
          f"i.e. < 1% of any step longer than {total / 10:.2f} ms")


if __name__ == "__main__":
    main()

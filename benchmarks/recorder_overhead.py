"""What the recorder thread costs per verify step, and what the scheduler thread loses to it, for two
revisions of hs_tracer side by side in one run (CPU; no GPU needed).

    PYTHONPATH=. python benchmarks/recorder_overhead.py --before DIR [--out FILE] [--rounds 3]
        [--export thread|process] [--before-export thread|process]

``DIR`` is a checkout of the revision to compare with (e.g. ``git worktree add DIR main``). Each
round runs one child process per revision, alternating (before, after, before, after, ...), each
child importing hs_tracer from its own checkout and measuring every N in {1,16,64,256,1024,4096}
(draft-input rows; batch = N/4 real SGLang ``Req`` objects). Per N a child measures:

* the scheduler process's recorder CPU µs/step: ``--steps`` verify steps go through the real
  per-step hooks (SGLang's ``HookRegistry`` wrappers, the CPU stand-in probe of
  benchmarks/hook_overhead.py), then the recorder works them off as one wake-up of its thread does,
  timed with ``time.process_time`` (every thread of the scheduler process). With the exporters in
  the scheduler process (revisions before the export process, or ``HS_TRACER_EXPORT=thread``) that
  is the recorder's work plus the OpenTelemetry span processor's encoding and POSTs (spans at the
  default 1% shipped over OTLP/HTTP to a collector in another process, flushed every 10 batches)
  and the metrics flusher; with the export process it is the batching and the pipe write, and the
  export process's own CPU per step is reported beside it (from /proc: its CPU over all measured
  batches, read a second after the last, divided by their steps). Median over
  ``--batches`` batches; as many batches without the span exporter alternate with them ("without
  spans"; the same work where the spans live in the export process).
* with ``--loop``, scheduler loss µs/step: benchmarks/hook_overhead.py's loop, median over block
  pairs of on - off.
On a shared 2-core machine this includes CPU contention from other processes: compare the two
revisions within one run, not across runs.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from provenance import source_state

NS = (1, 16, 64, 256, 1024, 4096)
REPO = Path(__file__).resolve().parents[1]


def child(args: argparse.Namespace) -> None:
    """One revision's measurements (runs with that revision first on ``sys.path``)."""
    sys.path.insert(0, str(Path.cwd() / "benchmarks"))
    import hook_overhead as ho
    import torch

    from hs_tracer.core.recorder import Recorder

    cpu_device = torch.device("cpu")
    st = ho.make_state(cpu_device, None, *([args.export] if args.export != "thread" else []))
    out = []
    for n in [int(v) for v in args.ns.split(",")]:
        inputs = ho.step_inputs(n, cpu_device)  # (running, snapshot, results) or, earlier, (batch, result)
        running, snapshot, result = (inputs[0], inputs[1], inputs[2][0]) if len(inputs) == 3 else (
            inputs[0], inputs[0], inputs[1])
        processor = getattr(ho, "PROCESSOR", None)  # SGLang's result processor, where the hook reads it
        bs = len(running.reqs)
        accepts = [torch.randint(1, ho.DRAFT_TOKENS + 1, (bs,), dtype=torch.int32) for _ in range(64)]
        rec = Recorder(st)
        st.recorder = rec
        rec._setup()
        wake = Wake(rec)
        per_step: dict[bool, list[float]] = {True: [], False: []}
        export_start = 0.0
        for b in range(2 * args.batches + 2):  # two warm-up batches (first span, HTTP connection)
            spans = b % 2 == 0  # batches with and without the span exporter alternate (in-process only)
            wake.spans(spans)
            for i in range(args.steps):
                ho.TRACED_DECODE(None, running, result)
                result.accept_lens = accepts[i % 64]
                ho.TRACED_RESOLVE(processor, result, snapshot)
            if b == 2:
                export_start = wake.export_cpu_s()
            t0 = time.process_time()
            wake()
            if spans and b % 10 == 8:
                wake.flush()
            if b >= 2:
                per_step[spans].append((time.process_time() - t0) / args.steps * 1e6)
        time.sleep(1.0)  # the export process works the last batches off
        export_cpu = (wake.export_cpu_s() - export_start) / (2 * args.batches * args.steps) * 1e6
        wake.close()
        row = {"N": n, "batch": bs, "recorder_cpu_us_per_step": statistics.median(per_step[True]),
               "recorder_cpu_us_per_step_no_spans": statistics.median(per_step[False]),
               "recorder_cpu_us_batches": per_step[True],
               "export_process_cpu_us_per_step": export_cpu if wake.process else None}
        if args.loop:
            loop = ho.bench_loop(st, n, cpu_device, args.loop_steps, args.blocks, 300.0, 100.0)
            row.update(lost_us_per_step=loop["lost_us_per_step"], lost_us_blocks=loop["lost_us_blocks"])
        out.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    print("RESULT " + json.dumps(out), flush=True)


class Wake:
    """One wake-up of the recorder thread, for any of its designs: the exporters in the recorder
    thread (``_on_steps`` + ``_on_window`` before the export process existed; ``_wake`` with its
    ``analysis`` since) or the recorder thread shipping batches to the export process (``_wake``; the
    export process's CPU read from /proc)."""

    def __init__(self, rec: Any) -> None:
        self.rec = rec
        self.current = hasattr(rec, "_wake")
        self.process = getattr(rec, "export", None) is not None
        self.exporters = None if self.process else (rec.analysis if self.current else rec)
        self.otel = getattr(self.exporters, "_otel", None)
        if self.process:  # its start-up (imports, exporters) is not per step: wait until it is idle
            deadline, last = time.monotonic() + 30, -1.0
            while time.monotonic() < deadline and self.export_cpu_s() != last:
                last = self.export_cpu_s()
                time.sleep(0.5)

    def spans(self, on: bool) -> None:
        if self.exporters is not None:
            self.exporters._otel = self.otel if on else None

    def __call__(self) -> None:
        if self.current:
            if hasattr(self.rec, "_forward_at"):  # revisions that hand steps over only every so often
                self.rec._forward_at = float("-inf")  # measure a hand-off, not a wake-up that waits
            self.rec._wake()
        else:
            self.rec._on_steps()
            self.rec._on_window(force=False)

    def flush(self) -> None:
        if self.otel is not None:
            self.otel.force_flush()

    def export_cpu_s(self) -> float:
        """CPU seconds the export process has used so far (0 without one)."""
        if not self.process:  # revisions before the export process have no reader for it either
            return 0.0
        import hook_overhead as ho

        return ho.process_cpu_s(self.rec)

    def close(self) -> None:
        if self.process:
            self.rec.export.close()
            return
        self.spans(True)
        if self.current:
            self.exporters.close()
            return
        self.rec._prom.close()
        if self.otel is not None:
            self.otel.shutdown()


def run_child(checkout: Path, args: argparse.Namespace, env: dict[str, str]) -> list[dict]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--ns", args.ns,
           "--steps", str(args.steps), "--batches", str(args.batches),
           "--loop-steps", str(args.loop_steps), "--blocks", str(args.blocks),
           *(["--loop"] if args.loop else []),
           "--export", args.export if checkout == REPO else args.before_export]
    proc = subprocess.run(cmd, cwd=checkout, env={**env, "PYTHONPATH": str(checkout)}, capture_output=True,
                          text=True, timeout=3600)
    if proc.returncode:
        sys.exit(f"child in {checkout} failed:\n{proc.stderr[-3000:]}")
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", type=Path, help="checkout of the revision to compare with")
    ap.add_argument("--out", type=Path, default=None, help="JSON results file")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ns", default=",".join(map(str, NS)))
    ap.add_argument("--steps", type=int, default=125, help="steps per recorder batch (50 ms of 400 µs steps)")
    ap.add_argument("--batches", type=int, default=20)
    ap.add_argument("--loop-steps", type=int, default=1000)
    ap.add_argument("--blocks", type=int, default=3)
    ap.add_argument("--loop", action="store_true", help="also run hook_overhead.py's loop per N")
    ap.add_argument("--export", choices=("thread", "process"), default="thread",
                    help="HS_TRACER_EXPORT of the revision after (before: exporters in its thread)")
    ap.add_argument("--before-export", choices=("thread", "process"), default="thread",
                    help="HS_TRACER_EXPORT of the revision before (if it has the export process)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    if args.before is None:
        ap.error("--before DIR is required")
    sys.path.insert(0, str(REPO / "benchmarks"))
    from hook_overhead import COLLECTOR

    collector = subprocess.Popen([sys.executable, "-c", COLLECTOR], stdout=subprocess.PIPE, text=True)
    try:
        assert collector.stdout is not None
        port = int(collector.stdout.readline())
        env = {**os.environ, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://127.0.0.1:{port}/v1/traces",
               "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}
        runs: dict[str, list[list[dict]]] = {"before": [], "after": []}
        for _ in range(args.rounds):
            for name, checkout in (("before", args.before.resolve()), ("after", REPO)):
                runs[name].append(run_child(checkout, args, env))
                got = ", ".join(f"N={r['N']} {r['recorder_cpu_us_per_step']:.1f}" for r in runs[name][-1])
                print(f"{name} (scheduler process's recorder CPU µs per step): {got}", flush=True)
    finally:
        collector.kill()
    rows = []
    for i, n in enumerate(int(v) for v in args.ns.split(",")):
        row: dict = {"N": n}
        for name, per_round in runs.items():
            row[f"{name}_recorder_cpu_us"] = statistics.median(
                r[i]["recorder_cpu_us_per_step"] for r in per_round)
            row[f"{name}_recorder_cpu_us_no_spans"] = statistics.median(
                r[i]["recorder_cpu_us_per_step_no_spans"] for r in per_round)
            export = [r[i]["export_process_cpu_us_per_step"] for r in per_round]
            row[f"{name}_export_process_cpu_us"] = None if None in export else statistics.median(export)
            if args.loop:
                row[f"{name}_lost_us"] = statistics.median(r[i]["lost_us_per_step"] for r in per_round)
        rows.append(row)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    res = {"machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                       "python": platform.python_version(), "platform": platform.platform(),
                       "load_average_at_end": load,
                       "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")},
           "method": __doc__.strip(), "args": {k: str(v) for k, v in vars(args).items()},
           "rows": rows, "runs": runs}
    print("| N | scheduler process's recorder CPU µs/step, spans at 1%: before | after | ratio | without "
          "spans: before | after | ratio | export process CPU µs/step: after |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        b, a = r["before_recorder_cpu_us"], r["after_recorder_cpu_us"]
        b0, a0 = r["before_recorder_cpu_us_no_spans"], r["after_recorder_cpu_us_no_spans"]
        e = r["after_export_process_cpu_us"]
        print(f"| {r['N']} | {b:.1f} | {a:.1f} | {b / a:.1f}x | {b0:.1f} | {a0:.1f} | {b0 / a0:.1f}x | "
              f"{'-' if e is None else f'{e:.1f}'} |")
    if args.out is not None:
        res["source"] = source_state(Path(__file__).resolve().parents[1])  # the commit measured
        args.out.write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()

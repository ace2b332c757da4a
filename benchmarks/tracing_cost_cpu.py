"""What tracing costs a real SGLang EAGLE-3 engine on the CPU, and whether hs_tracer's own cost figure
accounts for it: alternating off/on pairs of the testbed pair in real SGLang, one run.

    flock /tmp/hs-engine.lock env PYTHONPATH=.:testbed python benchmarks/tracing_cost_cpu.py \\
        [--pairs 12] [--batch 8] [--new-tokens 96] [--variant NAME=DIR ...] [--out-dir benchmarks/results]

Engines, each in a child process of its own, all started before the first timed run and serving the
same batch in turn: ``off`` (no ``HS_TRACER``), ``on`` (``HS_TRACER=1``, the testbed's reference
profile, the default export process), and per ``--variant NAME=DIR`` one more traced engine whose
hs_tracer is imported from the checkout ``DIR`` (a scratch copy with a change under test; its
``hs_tracer`` must come first on the path, the result records the file it imported).

Method: ``--warmup`` untimed runs per engine, then ``--pairs`` rounds; each round runs every engine
once on the same greedy batch (``--batch`` prompts, ``--new-tokens`` tokens each, ignore_eos), the
order rotating every round so that no engine always follows another. Per engine and run:

* wall time of the ``generate`` call, and SGLang's verify steps (the longest request's
  ``spec_verify_ct``: one prefill batch serves them all, so every step holds every request);
* the CPU time of the engine's scheduler process (every thread: SGLang's scheduler loop and model on
  the CPU, hs_tracer's hooks and its recorder thread), from the kernel's per-process accounting
  (``psutil``), per verify step: the scheduler iteration's CPU cost, where a regression in any of
  hs_tracer's threads shows even when the wall time hides it.

Per traced engine against ``off``: throughput ratio on/off per round (off wall / on wall; median and
quartiles over rounds), scheduler CPU µs per step on - off and wall µs per step on - off (medians
over rounds), and beside them hs_tracer's self-measured cost per step over the timed runs (its
``/metrics``: hook host time, the recorder thread's CPU time, the kernel's GPU time, which is absent
on the CPU). The scheduler-CPU difference is the figure the self-measured total should explain.
On a shared machine other processes' load moves single runs; the alternation is what makes rounds
comparable. No figure here is a pass/fail threshold.
"""

from __future__ import annotations

import argparse
import contextlib
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
from scrape import counters

REPO = Path(__file__).resolve().parents[1]
COUNTERS = ("hs_tracer_verify_steps_total", "hs_tracer_drafts_total",
            "hs_tracer_thread_cpu_seconds_total", "hs_tracer_host_overhead_seconds_sum",
            "hs_tracer_host_overhead_seconds_count", "hs_tracer_fingerprint_kernel_gpu_seconds")


# ---- child: one engine ---------------------------------------------------------------------------
def child(name: str, batch: int, new_tokens: int, metrics_port: int, traced: bool) -> None:
    """Start one engine and answer the parent's commands (one JSON object a line on stdin/stdout)."""
    import psutil

    from hs_tracer_testbed import ensure_testbed
    from hs_tracer_testbed.corpus import prompts as corpus_prompts
    from hs_tracer_testbed.demo import testbed_profile
    from hs_tracer_testbed.runtime.launcher import start_engine

    tb = ensure_testbed(progress=False)
    env = {}
    if traced:
        env = {"HS_TRACER": "1", "HS_TRACER_PROFILE": str(testbed_profile(tb)),
               "HS_TRACER_METRICS_PORT": str(metrics_port), "HS_TRACER_METRICS_ADDR": "127.0.0.1"}
    # The command channel is a copy of stdout; stdout itself (inherited by SGLang's processes) goes to
    # stderr, so nothing SGLang prints can reach the parent's channel.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    engine = start_engine(tb.target, tb.draft, env=env, mem_fraction_static=0.3)
    procs = psutil.Process().children(recursive=True)
    (scheduler,) = [p for p in procs if "scheduler" in " ".join(p.cmdline())]
    import hs_tracer

    prompts = corpus_prompts(seed=4321, n=batch)
    params = {"temperature": 0.0, "max_new_tokens": new_tokens, "ignore_eos": True}

    def reply(obj: dict[str, Any]) -> None:
        out.write(json.dumps(obj) + "\n")
        out.flush()

    # where hs_tracer was imported from, relative to the checkout (a result names no machine's paths)
    source = Path(hs_tracer.__file__).resolve()
    where = str(source.relative_to(REPO)) if source.is_relative_to(REPO) else source.name
    reply({"ready": name, "hs_tracer": where, "scheduler_pid": scheduler.pid})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["do"] == "run":
            cpu0 = sum(scheduler.cpu_times()[:2])
            t0 = time.perf_counter()
            res = engine.generate(prompts, params)
            wall = time.perf_counter() - t0
            cpu = sum(scheduler.cpu_times()[:2]) - cpu0
            counts = [int(o["meta_info"].get("spec_verify_ct") or 0) for o in res]
            reply({"wall_s": wall, "scheduler_cpu_s": cpu, "verify_steps": max(counts),
                   "request_steps": sum(counts),
                   "tokens": sum(int(o["meta_info"]["completion_tokens"]) for o in res)})
        elif cmd["do"] == "metrics":
            reply(settled_metrics(metrics_port, cmd["drafts"]))
        else:
            break
    engine.shutdown()


def scrape(port: int) -> dict[str, float]:
    """hs_tracer's counters (and the kernel gauge) from its own /metrics, summed over label sets."""
    return counters(port, COUNTERS)


def settled_metrics(port: int, drafts: int, timeout_s: float = 60.0) -> dict[str, float]:
    """The counters once ``hs_tracer_drafts_total`` reads ``drafts`` (the request-steps SGLang
    counted: the recorder and the export process have caught up), else after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = scrape(port)
        if got.get("hs_tracer_drafts_total", 0) >= drafts or time.monotonic() > deadline:
            return got
        time.sleep(0.25)


# ---- parent --------------------------------------------------------------------------------------
class Engine:
    """A child process serving one engine."""

    def __init__(self, name: str, args: argparse.Namespace, traced: bool, port: int,
                 checkout: Path | None) -> None:
        self.name, self.traced, self.checkout = name, traced, checkout
        env = {k: v for k, v in os.environ.items() if not k.startswith("HS_TRACER")}
        path = [str(checkout)] if checkout is not None else []
        env["PYTHONPATH"] = os.pathsep.join([*path, str(REPO), str(REPO / "testbed"),
                                             str(REPO / "benchmarks")])
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", name, "--batch", str(args.batch),
               "--new-tokens", str(args.new_tokens), "--metrics-port", str(port)]
        self.log = Path(args.log_dir) / f"engine-{name}.log"
        self.proc = subprocess.Popen(cmd + (["--traced"] if traced else []), env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log.open("w"), text=True, cwd=REPO)
        self.request_steps = 0
        self.ready: dict[str, Any] | None = None

    def wait_ready(self) -> dict[str, Any]:
        self.ready = self._read()
        return self.ready

    def ask(self, cmd: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"engine {self.name} exited (code {self.proc.wait()}); its log: {self.log}")
        return json.loads(line)

    def run(self) -> dict[str, Any]:
        got = self.ask({"do": "run"})
        self.request_steps += got["request_steps"]
        return got

    def metrics(self) -> dict[str, float]:
        return self.ask({"do": "metrics", "drafts": self.request_steps}) if self.traced else {}

    def close(self) -> None:
        with contextlib.suppress(RuntimeError, OSError, ValueError):
            self.ask({"do": "quit"})
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _quartiles(xs: list[float]) -> list[float]:
    q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else [xs[0]] * 3
    return [round(q[0], 4), round(q[2], 4)]


def compare(off: list[dict[str, Any]], on: list[dict[str, Any]], before: dict[str, float],
            after: dict[str, float]) -> dict[str, Any]:
    """One traced engine against ``off`` over the same rounds (module docstring)."""
    ratios = [a["wall_s"] / b["wall_s"] for a, b in zip(off, on, strict=True)]
    cpu = [1e6 * (b["scheduler_cpu_s"] / b["verify_steps"] - a["scheduler_cpu_s"] / a["verify_steps"])
           for a, b in zip(off, on, strict=True)]
    wall = [1e6 * (b["wall_s"] / b["verify_steps"] - a["wall_s"] / a["verify_steps"])
            for a, b in zip(off, on, strict=True)]

    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    steps = delta("hs_tracer_verify_steps_total")
    hook = 1e6 * delta("hs_tracer_host_overhead_seconds_sum") / steps if steps else None
    thread = 1e6 * delta("hs_tracer_thread_cpu_seconds_total") / steps if steps else None
    kernel = after.get("hs_tracer_fingerprint_kernel_gpu_seconds")
    total = None if hook is None or thread is None else hook + thread + 1e6 * (kernel or 0.0)
    return {
        "on_over_off_throughput": {"median": round(statistics.median(ratios), 4),
                                   "quartiles": _quartiles(ratios), "rounds": [round(r, 4) for r in ratios]},
        "scheduler_cpu_us_per_step_on_minus_off": {"median": round(statistics.median(cpu), 1),
                                                   "quartiles": _quartiles(cpu)},
        "wall_us_per_step_on_minus_off": {"median": round(statistics.median(wall), 1),
                                          "quartiles": _quartiles(wall)},
        "self_measured_us_per_step": {
            "hook": None if hook is None else round(hook, 2),
            "thread_cpu": None if thread is None else round(thread, 2),
            "kernel_gpu": None if kernel is None else round(1e6 * kernel, 2),
            "total": None if total is None else round(total, 2)},
        "hs_tracer_verify_steps": steps,
        "hs_tracer_request_steps": delta("hs_tracer_drafts_total"),
        "sglang_request_steps": sum(r["request_steps"] for r in on),
    }


def machine() -> dict[str, Any]:
    load = os.getloadavg()
    return {"platform": platform.platform(), "processor": platform.machine(), "cpus": os.cpu_count(),
            "python": platform.python_version(), "load_average_at_start": [round(x, 2) for x in load]}


def markdown(r: dict[str, Any]) -> str:
    lines = [f"# Tracing cost on the real CPU engine ({r['date']})", "",
             f"Source: commit {r['source']['commit']} (dirty: {r['source']['dirty']}). Machine: "
             f"{r['machine']['platform']}, {r['machine']['cpus']} CPUs, load average at start "
             f"{r['machine']['load_average_at_start']}. SGLang {r['sglang']}.", "",
             f"Method: {r['method']}", ""]
    for note in r.get("notes", []):
        lines += [f"Note: {note}", ""]
    lines += ["| engine | hs_tracer from | tok/s (median) | wall ms/step | scheduler CPU ms/step |",
              "|---|---|---:|---:|---:|"]
    for name, e in r["engines"].items():
        lines.append(f"| {name} | {e.get('hs_tracer') or '-'} | {e['tokens_per_s']} | "
                     f"{e['wall_ms_per_step']} | {e['scheduler_cpu_ms_per_step']} |")
    lines += ["", "Against `off`, per round then median (quartiles); self-measured = hs_tracer's own "
              "metrics over the timed runs (hook host time + recorder thread CPU + kernel GPU time, none "
              "on the CPU):",
              "", "| engine | on/off throughput | scheduler CPU µs/step on - off | wall µs/step on - off | "
              "self-measured µs/step: hook + thread CPU = total | request-steps SGLang / hs_tracer |",
              "|---|---|---|---|---|---|"]
    for name, c in r["against_off"].items():
        t, cpu, wall, own = (c["on_over_off_throughput"], c["scheduler_cpu_us_per_step_on_minus_off"],
                             c["wall_us_per_step_on_minus_off"], c["self_measured_us_per_step"])
        lines.append(f"| {name} | {t['median']} ({t['quartiles']}) | "
                     f"{cpu['median']} ({cpu['quartiles']}) | {wall['median']} ({wall['quartiles']}) | "
                     f"{own['hook']} + {own['thread_cpu']} = "
                     f"{own['total']} | {c['sglang_request_steps']} / {c['hs_tracer_request_steps']:.0f} |")
    return "\n".join(lines) + "\n"



def _checkout_label(tree: Path | None) -> str:
    """Which tree an engine ran, without a machine's paths: this checkout, or a variant's folder name."""
    return "this checkout" if tree is None else f"variant tree {tree.name}"

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=DIR",
                    help="one more traced engine with hs_tracer imported from the checkout DIR")
    ap.add_argument("--note", action="append", default=[], help="a line for the result's notes")
    ap.add_argument("--out-dir", type=Path, default=REPO / "benchmarks" / "results")
    ap.add_argument("--tag", default="")
    ap.add_argument("--log-dir", default="/tmp", help="where each engine's own output goes")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--metrics-port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--traced", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args.child, args.batch, args.new_tokens, args.metrics_port, args.traced)
        return 0

    from hs_tracer_testbed import ensure_testbed
    from hs_tracer_testbed.demo import testbed_profile

    testbed_profile(ensure_testbed(progress=False))  # built once here, not by two engines at once
    import sglang

    base = 39700 + os.getpid() % 200
    specs = [("off", False, None), ("on", True, None)] + [
        (v.split("=", 1)[0], True, Path(v.split("=", 1)[1]).resolve()) for v in args.variant]
    engines = [Engine(name, args, traced, base + 10 * i, checkout)
               for i, (name, traced, checkout) in enumerate(specs)]
    runs: dict[str, list[dict[str, Any]]] = {e.name: [] for e in engines}
    try:
        ready = {e.name: e.wait_ready() for e in engines}
        print(f"engines ready: {ready}", flush=True)
        for _ in range(args.warmup):
            for e in engines:
                e.run()
        before = {e.name: e.metrics() for e in engines}
        for rnd in range(args.pairs):
            shift = rnd % len(engines)
            order = engines[shift:] + engines[:shift]
            if rnd % 2:
                order.reverse()
            for e in order:
                runs[e.name].append(e.run())
            print(f"round {rnd + 1}/{args.pairs}: " + ", ".join(
                f"{e.name} {runs[e.name][-1]['wall_s']:.3f}s" for e in engines), flush=True)
        after = {e.name: e.metrics() for e in engines}
    finally:
        for e in engines:
            e.close()

    def summary(name: str) -> dict[str, Any]:
        rs = runs[name]
        return {"hs_tracer": (ready[name] or {}).get("hs_tracer") if name != "off" else None,
                "checkout": _checkout_label(next(c for n, _t, c in specs if n == name)),
                "tokens_per_s": round(statistics.median(r["tokens"] / r["wall_s"] for r in rs), 1),
                "wall_ms_per_step": round(statistics.median(
                    1e3 * r["wall_s"] / r["verify_steps"] for r in rs), 3),
                "scheduler_cpu_ms_per_step": round(statistics.median(
                    1e3 * r["scheduler_cpu_s"] / r["verify_steps"] for r in rs), 3),
                "runs": rs}

    today = dt.date.today().isoformat()
    result = {
        "what": "tracing off vs on in real SGLang EAGLE-3 on the CPU (testbed pair), alternating rounds",
        "date": today, "source": source_state(REPO), "machine": machine(), "sglang": sglang.__version__,
        "method": (f"{len(engines)} engines (each its own process) started before timing; {args.warmup} "
                   f"untimed runs each; {args.pairs} rounds, each engine once per round on the same batch "
                   f"({args.batch} prompts x {args.new_tokens} new tokens, greedy, ignore_eos), order "
                   "rotated every round; per run the generate wall time and the scheduler process's CPU "
                   "time (all its threads, psutil) over SGLang's verify steps (longest request's "
                   "spec_verify_ct); on/off = off wall / on wall per round; self-measured from hs_tracer's "
                   "/metrics deltas over the timed rounds"),
        "batch": args.batch, "new_tokens": args.new_tokens, "pairs": args.pairs, "notes": args.note,
        "engines": {e.name: summary(e.name) for e in engines},
        "against_off": {e.name: compare(runs["off"], runs[e.name], before[e.name], after[e.name])
                        for e in engines if e.traced},
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"tracing_cost_cpu_{today}{args.tag}"
    (args.out_dir / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out_dir / f"{stem}.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

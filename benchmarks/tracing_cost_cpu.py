"""The CPU guard for hs_tracer's per-step path: what tracing costs a real SGLang EAGLE-3 engine on the
CPU, measured as the scheduler process's CPU time per verify step, precise to about 2 %, with an
untraced A/A control and the 2026-12-04 regression re-injected as a variant it must flag.

    env PYTHONPATH=.:testbed python benchmarks/tracing_cost_cpu.py \\
        [--pairs 24] [--batch 8] [--new-tokens 64] [--status-bug] [--variant NAME=DIR ...]

Engines, each in a child process of its own, all started before the first timed run and serving the
same batch in turn: ``off`` and ``control`` (both untraced: the A/A pair), ``on`` (``HS_TRACER=1``,
the testbed's reference profile, the default export process), with ``--status-bug`` a traced
``status_bug`` engine whose hs_tracer is a scratch copy of this checkout's with the 2026-12-04
regression put back (``status()`` looks the installed release's hook targets up through package
metadata once per patched target, every 2 s in the recorder thread), and per ``--variant NAME=DIR``
one more traced engine whose hs_tracer is imported from the checkout ``DIR``.

Method: every engine runs with SGLang's ``sleep_on_idle`` so that an engine waiting for its turn
sleeps instead of polling, and with ``OMP_NUM_THREADS=1``: with torch's default of one compute
thread per core, the idle OpenMP worker spun between parallel regions, so the scheduler's CPU time
tracked its wall time, other engineers' load included (one engine's CPU per step ranged 80-705 ms
from round to round); on one thread CPU time is the work done. hs_tracer's hooks and recorder thread
run as in any engine.

``--warmup`` untimed runs per engine, then ``--pairs`` rounds; each round runs every engine once on
the same greedy batch, the order rotating (and reversing every other round) so that no engine always
follows another. Per run: the scheduler process's CPU time (every thread: SGLang's loop and model,
hs_tracer's hooks and recorder thread) from the kernel's per-thread scheduler statistics (ns; the
per-process user + system times count 10 ms ticks, 2 % of a run), over SGLang's verify steps (the
longest request's ``spec_verify_ct``; one prefill batch serves them all). CPU time, unlike wall
time, does not count the time other engineers' processes hold the cores.

Per engine against ``off``: the CPU-per-step ratio of each round, its median over rounds and a 95 %
bootstrap interval of that median (2000 resamples, fixed seed), and the medians of the odd and the
even rounds (two half-runs: the run-to-run spread seen inside one run). ``control`` over ``off`` is
the A/A figure: it should read 1; its interval is the guard's precision. ``corrected`` is an
engine's ratio over the control's. An engine is flagged when its interval lies above the control's
and its median exceeds 1 + ``--budget`` (default 2 %). Wall time per step and hs_tracer's own cost
figures (``/metrics``: hook host time, recorder thread CPU) are reported beside, unjudged.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
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
    engine = start_engine(tb.target, tb.draft, env=env, mem_fraction_static=0.3, sleep_on_idle=True)
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
            cpu0 = process_cpu_s(scheduler.pid)
            t0 = time.perf_counter()
            res = engine.generate(prompts, params)
            wall = time.perf_counter() - t0
            cpu = process_cpu_s(scheduler.pid) - cpu0
            counts = [int(o["meta_info"].get("spec_verify_ct") or 0) for o in res]
            reply({"wall_s": wall, "scheduler_cpu_s": cpu, "verify_steps": max(counts),
                   "request_steps": sum(counts),
                   "tokens": sum(int(o["meta_info"]["completion_tokens"]) for o in res)})
        elif cmd["do"] == "metrics":
            reply(settled_metrics(metrics_port, cmd["drafts"]))
        else:
            break
    engine.shutdown()


def process_cpu_s(pid: int) -> float:
    """CPU time of all of ``pid``'s threads, seconds, at nanosecond resolution (each thread's
    ``schedstat``; the per-process user + system times count 10 ms ticks, 2 % of a run here)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            total += int((task / "schedstat").read_text().split()[0])
    return total / 1e9


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
        env["OMP_NUM_THREADS"] = "1"  # one compute thread: no spinning OpenMP worker (module docstring)
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


def cpu_per_step(run: dict[str, Any]) -> float:
    return run["scheduler_cpu_s"] / run["verify_steps"]


def median_interval(xs: list[float], resamples: int = 2000, seed: int = 0) -> list[float]:
    """95 % bootstrap interval of the median of ``xs`` (percentile method, fixed seed)."""
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(xs, k=len(xs))) for _ in range(resamples))
    return [meds[int(0.025 * resamples)], meds[int(0.975 * resamples) - 1]]


def ratio_summary(off: list[dict[str, Any]], other: list[dict[str, Any]]) -> dict[str, Any]:
    """Scheduler CPU per verify step, ``other`` over ``off``, per round: median, its 95 % interval,
    quartiles, and the medians of the odd and even rounds (two half-runs)."""
    ratios = [cpu_per_step(b) / cpu_per_step(a) for a, b in zip(off, other, strict=True)]
    lo, hi = median_interval(ratios)
    return {"median": round(statistics.median(ratios), 4), "interval95": [round(lo, 4), round(hi, 4)],
            "half_width": round((hi - lo) / 2, 4), "quartiles": _quartiles(ratios),
            "half_runs": [round(statistics.median(half), 4) for half in (ratios[0::2], ratios[1::2])],
            "rounds": [round(r, 4) for r in ratios]}


def compare(off: list[dict[str, Any]], on: list[dict[str, Any]], control: dict[str, Any],
            before: dict[str, float], after: dict[str, float], budget: float) -> dict[str, Any]:
    """One engine against ``off`` over the same rounds (module docstring); ``control`` is the A/A
    engine's :func:`ratio_summary`."""
    cpu = ratio_summary(off, on)
    cpu["corrected"] = round(cpu["median"] / control["median"], 4)
    cpu["flagged"] = cpu["interval95"][0] > control["interval95"][1] and cpu["median"] > 1 + budget
    # how far outside the A/A spread: (ratio - 1) in units of the control's interval half-width
    cpu["margin_in_control_half_widths"] = (round((cpu["corrected"] - 1) / control["half_width"], 1)
                                            if control["half_width"] else None)
    wall = [b["wall_s"] / a["wall_s"] for a, b in zip(off, on, strict=True)]
    cpu_us = [1e6 * (cpu_per_step(b) - cpu_per_step(a)) for a, b in zip(off, on, strict=True)]

    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    steps = delta("hs_tracer_verify_steps_total")
    hook = 1e6 * delta("hs_tracer_host_overhead_seconds_sum") / steps if steps else None
    thread = 1e6 * delta("hs_tracer_thread_cpu_seconds_total") / steps if steps else None
    return {
        "scheduler_cpu_per_step_over_off": cpu,
        "scheduler_cpu_us_per_step_minus_off": {"median": round(statistics.median(cpu_us), 1),
                                                "quartiles": _quartiles(cpu_us)},
        "wall_over_off": {"median": round(statistics.median(wall), 4), "quartiles": _quartiles(wall)},
        "self_measured_us_per_step": None if hook is None or thread is None else {
            "hook": round(hook, 2), "thread_cpu": round(thread, 2), "total": round(hook + thread, 2)},
        "hs_tracer_verify_steps": steps,
        "hs_tracer_request_steps": delta("hs_tracer_drafts_total"),
        "sglang_request_steps": sum(r["request_steps"] for r in on),
    }


def status_bug_tree(dest: Path) -> Path:
    """A scratch copy of this checkout's ``hs_tracer`` with the 2026-12-04 regression put back:
    ``status()`` tests each patched hook target against the installed family's targets looked up
    through package metadata (``importlib.metadata``) per target, instead of the set read once at
    install. Raises if this checkout's ``status()`` no longer has the line it replaces."""
    shutil.copytree(REPO / "hs_tracer", dest / "hs_tracer",
                    ignore=shutil.ignore_patterns("__pycache__"))
    state = dest / "hs_tracer" / "integrations" / "sglang" / "state.py"
    fixed = "if t in self.own_targets)"
    text = state.read_text()
    if text.count(fixed) != 1:
        raise SystemExit(f"--status-bug: {fixed!r} not found once in status(); update status_bug_tree")
    state.write_text(text.replace(fixed, "if t in _targets_looked_up())") + (
        "\n\ndef _targets_looked_up() -> set[str]:\n"
        "    from hs_tracer.integrations.sglang import versions\n\n"
        "    family = versions.installed_family() or versions.FAMILIES[0]\n"
        "    return {h.target for h in family.hooks}\n"))
    return dest


def machine() -> dict[str, Any]:
    load = os.getloadavg()
    return {"platform": platform.platform(), "processor": platform.machine(), "cpus": os.cpu_count(),
            "python": platform.python_version(), "load_average_at_start": [round(x, 2) for x in load]}


def markdown(r: dict[str, Any]) -> str:
    lines = [f"# Tracing cost on the real CPU engine: the CPU guard ({r['date']})", "",
             f"Source: commit {r['source']['commit']} (dirty: {r['source']['dirty']}). Machine: "
             f"{r['machine']['platform']}, {r['machine']['cpus']} CPUs, load average at start "
             f"{r['machine']['load_average_at_start']}, at end {r['machine'].get('load_average_at_end')}. "
             f"SGLang {r['sglang']}.", "",
             f"Method: {r['method']}", "",
             f"**Verdict**: {r['verdict']}", ""]
    for note in r.get("notes", []):
        lines += [f"Note: {note}", ""]
    lines += ["| engine | hs_tracer from | scheduler CPU ms/step | wall ms/step | tok/s |",
              "|---|---|---:|---:|---:|"]
    for name, e in r["engines"].items():
        lines.append(f"| {name} | {e.get('hs_tracer') or '-'} | {e['scheduler_cpu_ms_per_step']} | "
                     f"{e['wall_ms_per_step']} | {e['tokens_per_s']} |")
    lines += ["", "Scheduler CPU per verify step over `off`, per round, then median [95 % interval] "
              "(half-runs: odd / even rounds); corrected = over the A/A control's median; margin = "
              "corrected - 1 in control half-widths:", "",
              "| engine | CPU/step over off | half-runs | corrected | flagged | margin | CPU µs/step - off "
              "| wall over off | self-measured µs/step (hook + thread CPU) "
              "| request-steps SGLang / hs_tracer |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for name, c in r["against_off"].items():
        cpu, own = c["scheduler_cpu_per_step_over_off"], c["self_measured_us_per_step"]
        own_s = "-" if own is None else f"{own['hook']} + {own['thread_cpu']} = {own['total']}"
        steps = "-" if own is None else f"{c['sglang_request_steps']} / {c['hs_tracer_request_steps']:.0f}"
        lines.append(f"| {name} | {cpu['median']} {cpu['interval95']} | {cpu['half_runs']} | "
                     f"{cpu.get('corrected', '-')} | {cpu.get('flagged', '-')} | "
                     f"{cpu.get('margin_in_control_half_widths', '-')} | "
                     f"{c['scheduler_cpu_us_per_step_minus_off']['median']} | {c['wall_over_off']['median']} "
                     f"{c['wall_over_off']['quartiles']} | {own_s} | {steps} |")
    return "\n".join(lines) + "\n"


def _checkout_label(tree: Path | None) -> str:
    """Which tree an engine ran, without a machine's paths: this checkout, or a variant's folder name."""
    return "this checkout" if tree is None else f"variant tree {tree.name}"


def verdict(against: dict[str, Any], control: dict[str, Any], budget: float) -> str:
    """One line: the guard's precision, whether ``on`` is within budget, what was flagged."""
    precise = control["half_width"] <= budget and against["on"]["scheduler_cpu_per_step_over_off"][
        "half_width"] <= budget
    parts = [f"A/A control/off {control['median']} {control['interval95']} (half-width "
             f"{control['half_width']:.4f}: {'within' if precise else 'NOT within'} the +-{budget:.0%} "
             "precision)"]
    for name, c in against.items():
        cpu = c["scheduler_cpu_per_step_over_off"]
        parts.append(f"{name} {cpu['corrected']} corrected ({'FLAGGED' if cpu['flagged'] else 'not flagged'}"
                     f", margin {cpu['margin_in_control_half_widths']} control half-widths)")
    return "; ".join(parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=24)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--budget", type=float, default=0.02,
                    help="the regression the guard must resolve, as a fraction of scheduler CPU per step")
    ap.add_argument("--status-bug", action="store_true",
                    help="one more traced engine with the 2026-12-04 status() regression re-injected")
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

    scratch = tempfile.TemporaryDirectory(prefix="hs-cpu-guard-")
    base = 39700 + os.getpid() % 200
    specs = [("off", False, None), ("control", False, None), ("on", True, None)]
    if args.status_bug:
        specs.append(("status_bug", True, status_bug_tree(Path(scratch.name) / "status_bug")))
    specs += [(v.split("=", 1)[0], True, Path(v.split("=", 1)[1]).resolve()) for v in args.variant]
    engines = [Engine(name, args, traced, base + 10 * i, checkout)
               for i, (name, traced, checkout) in enumerate(specs)]
    runs: dict[str, list[dict[str, Any]]] = {e.name: [] for e in engines}
    load_start = machine()
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
                f"{e.name} {1e3 * cpu_per_step(runs[e.name][-1]):.1f} ms" for e in engines), flush=True)
        after = {e.name: e.metrics() for e in engines}
    finally:
        for e in engines:
            e.close()
        scratch.cleanup()

    def summary(name: str) -> dict[str, Any]:
        rs = runs[name]
        return {"hs_tracer": (ready[name] or {}).get("hs_tracer") if name not in ("off", "control") else None,
                "checkout": _checkout_label(next(c for n, _t, c in specs if n == name)),
                "tokens_per_s": round(statistics.median(r["tokens"] / r["wall_s"] for r in rs), 1),
                "wall_ms_per_step": round(statistics.median(
                    1e3 * r["wall_s"] / r["verify_steps"] for r in rs), 3),
                "scheduler_cpu_ms_per_step": round(statistics.median(1e3 * cpu_per_step(r) for r in rs), 3),
                "runs": rs}

    control = ratio_summary(runs["off"], runs["control"])
    against = {e.name: compare(runs["off"], runs[e.name], control, before[e.name], after[e.name], args.budget)
               for e in engines if e.traced}
    today = dt.date.today().isoformat()
    result = {
        "what": "CPU guard: scheduler CPU per verify step, traced vs untraced, with an A/A control, "
                "real SGLang EAGLE-3 on the CPU (testbed pair), alternating rounds",
        "date": today, "source": source_state(REPO),
        "machine": {**load_start, "load_average_at_end": [round(x, 2) for x in os.getloadavg()]},
        "sglang": sglang.__version__,
        "method": (f"{len(engines)} engines (each its own process, sleep_on_idle, OMP_NUM_THREADS=1) "
                   "started before timing; "
                   f"{args.warmup} untimed runs each; {args.pairs} rounds, each engine once per round on the "
                   f"same batch ({args.batch} prompts x {args.new_tokens} new tokens, greedy, ignore_eos), "
                   "order rotated every round and reversed every other; per run the scheduler process's "
                   "CPU time (all threads, /proc schedstat, ns) over SGLang's verify steps; per round each "
                   "engine's CPU/step over off's; median over rounds with a 95 % bootstrap interval; "
                   "control is a second untraced engine (A/A); flagged = interval above the control's "
                   f"and median above 1 + {args.budget}"),
        "batch": args.batch, "new_tokens": args.new_tokens, "pairs": args.pairs, "budget": args.budget,
        "notes": args.note + ([STATUS_BUG_NOTE] if args.status_bug else []),
        "engines": {e.name: summary(e.name) for e in engines},
        "control_over_off": control,
        "against_off": against,
        "verdict": verdict(against, control, args.budget),
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"tracing_cost_cpu_{today}{args.tag}"
    (args.out_dir / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out_dir / f"{stem}.md").write_text(markdown(result))
    print(markdown(result))
    return 0


STATUS_BUG_NOTE = ("status_bug: this checkout's hs_tracer with status() looking the installed release's hook "
                   "targets up through importlib.metadata once per patched target (the 2026-12-04 "
                   "regression), built by --status-bug as a scratch copy; only state.py differs")


if __name__ == "__main__":
    raise SystemExit(main())

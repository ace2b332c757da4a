"""Real SGLang 0.5.23 EAGLE-3 on CUDA GPUs with hs_tracer inside: lossless, diagnosis, accept length,
sync checks, and throughput with tracing on vs off at DeepSeek-V3 width. Writes JSON + Markdown.

Everything runs on real SGLang engines (``sgl.Engine``, one worker process each, configured with
SGLang's own command-line arguments) with CUDA graphs and the overlap scheduler on (SGLang's
defaults; nothing here turns them off), started through the hs_tracer GPU testbed runtime
(``hs_tracer_testbed.runtime.gpu``: sgl_kernel stand-in, Triton attention and MoE, PyTorch sampling,
no NVLink multicast). The engines of one part start in parallel on the same GPUs.

Parts:
* ``testbed``: the trained testbed target (tiny DeepSeek-V3) and its EAGLE-3 draft. Plain decoding;
  a chain (``--speculative-num-steps 3 --speculative-eagle-topk 1``) and a tree (topk 4, 8 draft
  tokens), each with and without ``HS_TRACER=1``; the ``ids_shifted`` miswired draft traced. Greedy,
  two rounds of the same prompts (the second is served from the radix cache). hs_tracer's hooks run
  under ``torch.cuda.set_sync_debug_mode("error")`` (``HS_TRACER_TESTBED_SYNC_DEBUG=1``). With
  ``--tp 2``: the same at TP=2, plus the chain traced with attention data parallelism
  (``--attn-dp-size 2``, what ``--enable-dp-attention --dp-size 2`` resolves to in 0.5.23).
* ``prod``: a DeepSeek-V3-width target (hidden 7168, MLA, 5 layers, 32 experts, random weights via
  ``--load-format dummy``) with an EAGLE-3 draft of the same width; two servers, tracing off and on,
  measured alternately at batch sizes 1, 8, 32, 128; hs_tracer's host time per step from its
  Prometheus histogram; GPU memory of each engine's processes.
* ``radix`` (TP=1): plain decoding with SGLang's compiled (Rust) radix TreeCore instead of the
  Python one, to record whether it still rejects the KV indices under this machine's torch.

Run on a CUDA machine with SGLang 0.5.23 installed (docs/gpu.md)::

    python benchmarks/gpu_sglang.py --out-dir benchmarks/results [--tp 2] [--parts testbed,prod]

``--dry-run`` prints the engines it would start and exits (no GPU needed).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import itertools
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT, ROOT / "testbed", ROOT / "benchmarks"):  # this checkout's packages, provenance
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from provenance import source_state  # noqa: E402

from hs_tracer_testbed.runtime.gpu import launcher  # noqa: E402
from hs_tracer_testbed.runtime.gpu.prodwidth import write_models  # noqa: E402

SGLANG_VERSION = "0.5.23"
CHAIN = ("--speculative-algorithm", "EAGLE3", "--speculative-num-steps", "3",
         "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4")
TREE = ("--speculative-algorithm", "EAGLE3", "--speculative-num-steps", "3",
        "--speculative-eagle-topk", "4", "--speculative-num-draft-tokens", "8")
FP32 = ("--dtype", "float32")
# prod: per batch size, alternating off/on pairs (at most; fewer if the deadline nears) and new
# tokens per request; a decode step at batch 128 is ~9x one at batch 1, so it gets fewer tokens
PROD_PLAN = {1: (18, 256), 8: (12, 256), 32: (6, 128), 128: (6, 64)}  # multiples of the 6 orders of 3
PROD_WARMUP = 2  # untimed runs per server and batch size, discarded
PROD_MIN_PAIRS = 3
# decode step time (s) per batch size at DeepSeek-V3 width on one H200 (the first run here): only to
# spread the time left over the batch sizes; replaced by the measured warm-up time of each
STEP_S_GUESS = {1: 0.0056, 8: 0.0077, 32: 0.0148, 128: 0.047}
LOGPROB_TOP = 2  # plain decoding's top-2 log-probabilities: the margin where EAGLE's output diverges
TRACE_ENV = {"HS_TRACER": "1", "HS_TRACER_WINDOW_TOKENS": "256", "HS_TRACER_TESTBED_SYNC_DEBUG": "1"}
BASE_PORT = 31000
METRICS_BASE_PORT = 39400
START_TIMEOUT_S = 360


@dataclass
class Server:
    """One engine of a part: its name, model, SGLang arguments, and whether hs_tracer runs in it."""

    name: str
    model: Path
    args: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    traced: bool = False
    report_dir: Path | None = None
    worker: launcher.EngineWorker | None = None
    log_path: Path | None = None
    startup_s: float | None = None
    error: str | None = None
    started: float = 0.0


# ---- running engines -----------------------------------------------------------------------------
def start_all(servers: list[Server], log_dir: Path, work: Path) -> None:
    """Start every engine at once, then wait for each; an engine that fails keeps its error."""
    for i, s in enumerate(servers):
        # distinct ports per engine (SGLang derives its NCCL and internal ports from this one)
        s.args = (*s.args, "--port", str(BASE_PORT + 100 * i))
        if s.traced:
            s.report_dir = work / f"report-{s.name}"
            s.report_dir.mkdir(parents=True, exist_ok=True)
            s.env = {**s.env, "HS_TRACER_REPORT_DIR": str(s.report_dir)}
        s.log_path = log_dir / f"server-{s.name}.log"
        s.started = time.monotonic()
        s.worker = launcher.EngineWorker(s.model, s.args, env=s.env, log=s.log_path.open("w"))
    for s in servers:
        assert s.worker is not None
        try:
            s.worker.wait_ready(max(START_TIMEOUT_S - (time.monotonic() - s.started), 1))
            s.startup_s = round(time.monotonic() - s.started, 1)
        except (RuntimeError, TimeoutError) as exc:
            s.error = f"{exc}; log tail: {tail(s.log_path)}"
            print(f"[{s.name}] failed to start: {exc}", flush=True)
        else:
            print(f"[{s.name}] ready after {s.startup_s} s", flush=True)


def stop_all(servers: list[Server]) -> None:
    with ThreadPoolExecutor(len(servers) or 1) as pool:
        list(pool.map(lambda s: s.worker.stop() if s.worker is not None else None, servers))
    for s in servers:
        s.worker = None


def tail(path: Path | None, n: int = 3000) -> str:
    if path is None or not path.exists():
        return ""
    return path.read_text(errors="replace")[-n:]


def generate(s: Server, payload: dict[str, Any], timeout_s: float = 240) -> list[dict[str, Any]]:
    assert s.worker is not None
    return s.worker.generate(payload, timeout_s)


def reports(s: Server, settle_s: float = 1.5, max_wait_s: float = 30.0) -> list[dict[str, Any]]:
    """The hs_tracer report of every scheduler process of ``s``, once the recorders have caught up:
    two reads ``settle_s`` apart with the same accept-length steps and windows (a recorder works off
    its steps in the background; under a loaded host it can trail the engine by seconds)."""
    if s.report_dir is None:
        return []

    def read() -> list[dict[str, Any]]:
        return [json.loads(p.read_text()) for p in sorted(s.report_dir.glob("scheduler-*.json"))]

    def progress(reps: list[dict[str, Any]]) -> list[Any]:
        return [((r.get("diagnosis") or {}).get("acceptance") or {}).get("steps") for r in reps] + [
            (r.get("diagnosis") or {}).get("windows") for r in reps]

    end = time.monotonic() + max_wait_s
    last = read()
    while time.monotonic() < end:
        time.sleep(settle_s)
        now = read()
        if progress(now) == progress(last):
            return now
        last = now
    return last


def gpu_memory_mib(s: Server) -> int | None:
    """GPU memory used by the engine's processes (nvidia-smi's per-process column)."""
    try:
        import psutil

        assert s.worker is not None
        pids = {s.worker.pid} | {c.pid for c in psutil.Process(s.worker.pid).children(recursive=True)}
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True,
                             check=True).stdout
    except Exception:
        return None
    used = 0
    for line in out.splitlines():
        pid, mib = (x.strip() for x in line.split(","))
        if int(pid) in pids:
            used += int(mib)
    return used


def scrape(port: int) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            return r.read().decode()
    except Exception as exc:
        return f"# scrape failed: {exc}"


def settled_scrape(port: int, settle_s: float = 1.5, max_wait_s: float = 15.0,
                   drafts: float | None = None) -> str:
    """``/metrics`` once hs_tracer's counters have caught up. With ``drafts`` (the request-steps
    SGLang itself counted, as ``hs_tracer_drafts_total`` should read): once they read that many.
    Otherwise, or after ``max_wait_s``, once the step counter has stopped moving: two reads
    ``settle_s`` apart with the same count. Stillness alone is not proof: a run's last steps reach
    the counter up to the recorder's 0.5 s hand-off plus the export process's 0.5 s flush and its
    idle flusher's 0.5 s period later, about as long as ``settle_s``, so an early read can miss the
    last hand-off (0.7 s did: 741 steps of SGLang's 765 at batch 32)."""
    text = scrape(port)
    end = time.monotonic() + max_wait_s
    while time.monotonic() < end:
        if drafts is not None and counter(text, "hs_tracer_drafts") >= drafts:
            return text
        time.sleep(settle_s if drafts is None else 0.25)
        again = scrape(port)
        steps = "hs_tracer_verify_steps"
        if drafts is None and counter(again, steps) == counter(text, steps):
            return again
        text = again
    return text


def gauge(text: str, name: str) -> float | None:
    """One gauge's value in Prometheus text format (the largest over label sets), None if absent."""
    values = [float(m.group(2)) for m in re.finditer(rf"^{name}(\{{[^}}]*\}})?\s+(\S+)$", text, re.M)]
    return max(values) if values else None


def self_measured(hook_s: float, thread_cpu_s: float, steps: float,
                  kernel_gpu_s: float | None, delay_s: float = 0.0) -> dict[str, Any]:
    """hs_tracer's own cost per verify step, µs, from its metrics' deltas over a run: the hooks'
    host time, the recorder thread's CPU time (both in the scheduler process), the kernel's GPU time
    (a per-step constant timed at warm-up; None on the CPU), and their total (an upper bound: all
    of the thread's CPU); ``serving_us``: what the steps lose, hooks + the steps' measured wait for
    the recorder thread (``hs_tracer_scheduler_delay_seconds``) + the kernel."""
    if not steps:
        return {"hook_us": None, "thread_cpu_us": None, "kernel_gpu_us": None, "total_us": None,
                "scheduler_delay_us": None, "serving_us": None}
    hook, thread, delay = 1e6 * hook_s / steps, 1e6 * thread_cpu_s / steps, 1e6 * delay_s / steps
    kernel = None if kernel_gpu_s is None else 1e6 * kernel_gpu_s
    return {"hook_us": round(hook, 3), "thread_cpu_us": round(thread, 3),
            "kernel_gpu_us": None if kernel is None else round(kernel, 3),
            "total_us": round(hook + thread + (kernel or 0.0), 3),
            "scheduler_delay_us": round(delay, 3), "serving_us": round(hook + delay + (kernel or 0.0), 3)}


def wall_diff_us_per_step(off_s: list[float], on_s: list[float], steps_per_run: float) -> dict[str, Any]:
    """What tracing added to the wall time of a decode step, µs: per pair (on wall - off wall) /
    decode steps per run; median and quartiles over pairs. The figure the self-measured total must
    explain."""
    if not steps_per_run or not off_s:
        return {"median_us": None, "iqr_us": None}
    diffs = sorted(1e6 * (on - off) / steps_per_run for off, on in zip(off_s, on_s, strict=True))
    return {"median_us": round(median(diffs), 3),
            "iqr_us": [round(_quantile(diffs, 0.25), 3), round(_quantile(diffs, 0.75), 3)]}


def histogram(text: str, name: str) -> dict[str, float]:
    """Sum, count and cumulative buckets of one histogram in Prometheus text format (summed over
    label sets)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(rf"^{name}_(sum|count|bucket)(\{{[^}}]*\}})?\s+(\S+)$", line)
        if not m:
            continue
        key = m.group(1)
        if key == "bucket":
            le = re.search(r'le="([^"]+)"', m.group(2) or "")
            key = f"le_{le.group(1)}" if le else "le_?"
        out[key] = out.get(key, 0.0) + float(m.group(3))
    return out


def counter(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{name}(_total)?(\{{[^}}]*\}})?\s+(\S+)$", line)
        if m:
            total += float(m.group(3))
    return total


# ---- part: testbed -------------------------------------------------------------------------------
def testbed_servers(target: Path, draft: Path, shifted: Path, profile: Path, tp: int,
                    deterministic: bool = False) -> list[Server]:
    """With ``deterministic``, every engine runs SGLang's ``--enable-deterministic-inference``
    (batch-invariant kernels: the same prompt gives the same tokens whatever it is batched with), and
    the float32 engines get untraced twins, so tracing on/off is compared in both dtypes."""
    par = ("--tp-size", str(tp)) if tp > 1 else ()
    if deterministic:
        par = (*par, "--enable-deterministic-inference")
    # prefill graphs up to 512 tokens (SGLang's default captures up to 4096): the testbed's prefills
    # are under 512 tokens, so they still replay graphs, and startup captures fewer shapes
    common = (*par, "--mem-fraction-static", "0.85", "--max-total-tokens", "16384",
              "--cuda-graph-max-bs-decode", "16", "--cuda-graph-max-bs-prefill", "512",
              "--max-running-requests", "16", "--random-seed", "0")
    traced = {**TRACE_ENV, "HS_TRACER_PROFILE": str(profile)}
    chain = (*common, *CHAIN, "--speculative-draft-model-path", str(draft))
    tree = (*common, *TREE, "--speculative-draft-model-path", str(draft))
    servers = [
        Server("plain", target, common),
        Server("chain_off", target, chain),
        Server("chain_on", target, chain, traced, True),
        Server("shifted_on", target, (*common, *CHAIN, "--speculative-draft-model-path", str(shifted)),
               traced, True),
        Server("tree_off", target, tree),
        Server("tree_on", target, tree, traced, True),
    ]
    if tp == 1:  # the lossless comparison again in float32, where bf16 near-ties cannot flip
        servers += [Server("plain_fp32", target, (*common, *FP32)),
                    Server("chain_fp32_on", target, (*chain, *FP32), traced, True),
                    Server("tree_fp32_on", target, (*tree, *FP32), traced, True)]
        if deterministic:
            servers += [Server("chain_fp32_off", target, (*chain, *FP32)),
                        Server("tree_fp32_off", target, (*tree, *FP32))]
    if tp > 1:
        dp = (*common, "--attn-dp-size", str(tp), *CHAIN, "--speculative-draft-model-path", str(draft))
        servers += [Server("dp_attention_off", target, dp),
                    Server("dp_attention_on", target, dp,
                           {**traced, "HS_TRACER_METRICS_PORT": str(METRICS_BASE_PORT)}, True)]
    return servers


def run_testbed(servers: list[Server], prompts: list[str], max_new_tokens: int,
                reference: list[list[int]] | None = None, rounds: int = 2) -> dict[str, Any]:
    sampling = {"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": True}
    runs: dict[str, Any] = {}
    live = [s for s in servers if s.error is None]

    def one(s: Server) -> tuple[str, dict[str, Any]]:
        outputs = []
        for _ in range(rounds):  # rounds 2.. re-send the prompts: served from the radix cache
            outputs.append(generate(s, {"prompt": prompts, "sampling_params": sampling}))
        logprobs = None
        if s.name == "plain":  # once more with the top-2 log-probabilities of every output token
            logprobs = generate(s, {"prompt": prompts, "sampling_params": sampling, "return_logprob": True,
                                    "top_logprobs_num": LOGPROB_TOP})
        reps = reports(s)
        metrics = None
        if "HS_TRACER_METRICS_PORT" in s.env:  # each emitting scheduler serves its own port
            from hs_tracer.export.prometheus import metrics_port_for
            from hs_tracer.records import Ranks

            metrics = [scrape(metrics_port_for(Ranks(**rep["ranks"]), METRICS_BASE_PORT))
                       for rep in reps if rep.get("emitting") and rep.get("ranks")]
        return s.name, {"rounds": outputs, "reports": reps, "metrics": metrics, "logprobs": logprobs}

    with ThreadPoolExecutor(len(live) or 1) as pool:
        for name, res in pool.map(one, live):
            runs[name] = res
    return summarize_testbed(servers, runs, reference)


def _spec_counts(outs: list[dict[str, Any]]) -> dict[str, Any]:
    metas = [o["meta_info"] for o in outs]
    verify = [int(m.get("spec_verify_ct") or 0) for m in metas]
    correct = [int(m.get("spec_num_correct_drafts") or 0) for m in metas]
    per_request = [float(m["spec_accept_length"]) for m in metas if m.get("spec_accept_length") is not None]
    return {
        "verify_steps": sum(verify),
        "correct_drafts": sum(correct),
        # tokens committed per verify step over all (request, step) pairs, bonus token included
        "pooled_accept_length": 1 + sum(correct) / sum(verify) if sum(verify) else None,
        # SGLang's own per-request figure (meta_info.spec_accept_length), averaged over requests
        "per_request_mean_accept_length": sum(per_request) / len(per_request) if per_request else None,
        "cached_tokens": sum(int(m.get("cached_tokens") or 0) for m in metas),
    }


def _same(a: list[list[int]], b: list[list[int]]) -> dict[str, Any]:
    """Exact equality of two runs' greedy outputs, and how many sequences differ."""
    differ = sum(x != y for x, y in zip(a, b, strict=True))
    return {"identical": differ == 0, "sequences_differing": differ, "sequences": len(a)}


# (traced, untraced) engines whose greedy outputs must be identical: hs_tracer must change nothing
ON_OFF = (("chain_on", "chain_off"), ("tree_on", "tree_off"), ("chain_fp32_on", "chain_fp32_off"),
          ("tree_fp32_on", "tree_fp32_off"), ("dp_attention_on", "dp_attention_off"))


def plain_reference(name: str) -> str:
    """The plain-decoding engine an EAGLE engine's output must equal (same dtype)."""
    return "plain_fp32" if "_fp32" in name else "plain"


def _top(entry: Any) -> list[tuple[float, int]]:
    """``(logprob, token id)`` of one output position's ``output_top_logprobs`` entry, best first
    (SGLang gives None for a position without log-probabilities)."""
    return [(float(x[0]), int(x[1])) for x in entry or ()]


def _margin(top: list[tuple[float, int]]) -> float | None:
    return top[0][0] - top[1][0] if len(top) >= 2 else None


def divergence_margins(plain_ids: list[list[int]], plain_top: list[list[Any]],
                       other: list[list[int]]) -> dict[str, Any]:
    """Where ``other`` first differs from plain decoding, plain's log-probability margin between its
    own token and the runner-up, against the margins at every output position: tiny margins at the
    divergences (near-ties) mean numerics, not a wrong token committed by the speculative path."""
    firsts = []
    for i, (a, b) in enumerate(zip(plain_ids, other, strict=True)):
        p = next((j for j, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
        if p is None:
            continue
        top = _top(plain_top[i][p] if p < len(plain_top[i]) else None)
        firsts.append({"sequence": i, "position": p, "plain_token": a[p], "eagle_token": b[p],
                       "margin": _margin(top), "plain_token_is_top1": bool(top) and top[0][1] == a[p],
                       "eagle_token_is_top2": len(top) >= 2 and top[1][1] == b[p]})
    margins = sorted(m for seq in plain_top for e in seq if (m := _margin(_top(e))) is not None)
    worst = max((f["margin"] for f in firsts if f["margin"] is not None), default=None)
    return {
        "first_divergences": firsts,
        "max_margin_at_divergence": worst,
        "all_positions": len(margins),
        "median_margin_all_positions": margins[len(margins) // 2] if margins else None,
        # share of all output positions whose margin is at most the largest one at a divergence
        "share_of_positions_at_or_below_max": (sum(m <= worst for m in margins) / len(margins)
                                                if margins and worst is not None else None),
    }


def summarize_testbed(servers: list[Server], runs: dict[str, Any],
                      reference: list[list[int]] | None = None) -> dict[str, Any]:
    ids = {name: [[o["output_ids"] for o in rnd] for rnd in r["rounds"]] for name, r in runs.items()}
    out: dict[str, Any] = {"servers": {}, "lossless_vs_plain": {}, "tracing_on_vs_off": {},
                           "radix_round_2_vs_round_1": {}, "rounds_vs_round_1": {}, "output_ids": ids}
    for s in servers:
        entry: dict[str, Any] = {"args": list(s.args), "traced": s.traced, "startup_s": s.startup_s,
                                 "error": s.error}
        r = runs.get(s.name)
        if r is not None:
            for i, rnd in enumerate(r["rounds"]):
                entry[f"round_{i + 1}"] = _spec_counts(rnd)
            entry["both_rounds"] = _spec_counts([o for rnd in r["rounds"] for o in rnd])  # all rounds
            entry["sample_text"] = r["rounds"][0][0].get("text", "")[:120]
            entry["schedulers"] = [_report_summary(rep) for rep in r["reports"]]
            if r["metrics"] is not None:  # one scrape per emitting scheduler
                entry["metrics_verify_steps"] = [counter(t, "hs_tracer_verify_steps") for t in r["metrics"]]
                entry["metrics_rank_labels"] = [
                    {lab: sorted(set(re.findall(rf'(?<![a-z_]){lab}="(\d+)"', t)))
                     for lab in ("tp_rank", "dp_rank", "attn_dp_rank")} for t in r["metrics"]]
            if s.traced:
                entry["accept_length_reconciliation"] = _reconcile(entry["both_rounds"], entry["schedulers"])
        out["servers"][s.name] = entry
        if s.name in ids:
            # round 2 re-sends round 1's prompts: its prefill is served from the radix cache
            out["radix_round_2_vs_round_1"][s.name] = _same(ids[s.name][0], ids[s.name][1])
            # the engine against itself: run-to-run variation (identical in deterministic mode)
            out["rounds_vs_round_1"][s.name] = [_same(ids[s.name][0], rnd) for rnd in ids[s.name][1:]]
            ref = plain_reference(s.name)
            if ref in ids and not s.name.startswith("plain"):
                out["lossless_vs_plain"][s.name] = [_same(a, b) for a, b in zip(ids[ref], ids[s.name],
                                                                                  strict=True)]
    for on, off in ON_OFF:
        if on in ids and off in ids:
            out["tracing_on_vs_off"][f"{on} vs {off}"] = [_same(a, b) for a, b in zip(ids[on], ids[off],
                                                                                      strict=True)]
    lp = (runs.get("plain") or {}).get("logprobs")
    if lp:
        plain_top = [o["meta_info"]["output_top_logprobs"] for o in lp]
        lp_ids = [o["output_ids"] for o in lp]
        out["plain_logprob_round_identical"] = _same(ids["plain"][0], lp_ids)
        out["near_ties_bf16"] = {name: [divergence_margins(lp_ids, plain_top, rnd) for rnd in ids[name]]
                                 for name in ids if plain_reference(name) == "plain" and name != "plain"}
    if reference is not None:  # plain decoding of the same target on CPU, float32 (runs.py)
        out["cpu_fp32_reference"] = {name: [_same(reference, rnd) for rnd in ids[name]]
                                     for name in ("plain", "plain_fp32") if name in ids}
    return out


def _report_summary(rep: dict[str, Any]) -> dict[str, Any]:
    diag = rep.get("diagnosis") or {}
    acc = diag.get("acceptance") or {}
    return {
        "pid": rep.get("pid"), "ranks": rep.get("ranks"), "emitting": rep.get("emitting"),
        "enabled": rep.get("enabled"), "hook_errors": rep.get("hook_errors"),
        "disabled_reason": rep.get("disabled_reason"), "dropped_records": rep.get("dropped_records"),
        "hooks_applied": len(rep.get("hooks_applied") or []),
        "layers_to_capture": (rep.get("target") or {}).get("layers_to_capture"),
        "draft_graph_width": (rep.get("draft") or {}).get("graph_width"),
        "status": diag.get("status"), "windows": diag.get("windows"),
        "slots": [{k: sl.get(k) for k in ("index", "expected_source", "observed_source", "score")}
                  for sl in diag.get("slots") or []],
        "findings": [f.get("code") for f in diag.get("findings") or []],
        "acceptance_steps": acc.get("steps"), "mean_accept_length": acc.get("mean_accept_length"),
        "probe_launches": (rep.get("probes") or {}).get("launches"),
        "identity": rep.get("identity"), "measured_identity": diag.get("measured_identity"),
    }


def _reconcile(sglang: dict[str, Any], schedulers: list[dict[str, Any]]) -> dict[str, Any]:
    emitting = [s for s in schedulers if s.get("emitting")]
    steps = sum(s.get("acceptance_steps") or 0 for s in emitting)
    tracer = None
    if steps:
        tracer = sum((s.get("mean_accept_length") or 0) * (s.get("acceptance_steps") or 0)
                     for s in emitting) / steps
    return {
        "hs_tracer_request_steps": steps,
        "sglang_verify_steps": sglang["verify_steps"],
        "hs_tracer_pooled_accept_length": tracer,
        "sglang_pooled_accept_length": sglang["pooled_accept_length"],
        "sglang_per_request_mean_accept_length": sglang["per_request_mean_accept_length"],
        "pooled_equal": tracer is not None and sglang["pooled_accept_length"] is not None
        and abs(tracer - sglang["pooled_accept_length"]) < 1e-9 and steps == sglang["verify_steps"],
    }


# ---- part: production width ---------------------------------------------------------------------
def prod_servers(models: Path, tp: int) -> list[Server]:
    par = ("--tp-size", str(tp)) if tp > 1 else ()
    common = (*par, "--load-format", "dummy", "--speculative-draft-load-format", "dummy",
              "--skip-tokenizer-init", "--context-length", "2048", "--mem-fraction-static", "0.85",
              "--max-total-tokens", "131072", "--max-running-requests", "128",
              "--cuda-graph-max-bs-decode", "128", "--cuda-graph-max-bs-prefill", "512",
              "--random-seed", "0", *CHAIN,
              "--speculative-draft-model-path", str(models / "draft"))
    return [
        Server("prod_off", models / "target", common),
        Server("prod_on", models / "target", common,
               {"HS_TRACER": "1", "HS_TRACER_METRICS_PORT": str(METRICS_BASE_PORT + 1000)}, True),
        Server("prod_off_b", models / "target", common),  # the A/A control: a second untraced engine
    ]


def run_prod(servers: list[Server], deadline: float, prompt_len: int = 64,
             progress: Callable[[dict[str, Any]], None] | None = None,
             batches: list[int] | None = None, warmup: int = PROD_WARMUP) -> dict[str, Any]:
    """Decode throughput with tracing off and on, per batch size, with an A/A control: warm-up runs
    discarded, then rounds ("pairs") in which each engine serves the same batch once, the order
    cycling through every permutation of the engines so that none always runs first or after
    another. ``on_over_off`` is the median over pairs of off wall / on wall;
    ``control_on_over_off`` the same for the second untraced engine in the role of ``on`` (off wall
    / off_b wall): what two untraced engines differ by under the same method, i.e. the method's bias
    and noise. ``corrected_on_over_off`` is their quotient with a 95 % bootstrap interval over pairs.
    Pairs are capped so the part ends before ``deadline`` (``time.monotonic()``), at least
    ``PROD_MIN_PAIRS`` each. ``progress`` gets the results so far after each batch size (a run
    stopped from outside keeps them). ``batches``: a subset of ``PROD_PLAN``'s batch sizes. Without
    ``prod_off_b`` (or if it failed to start) the pairs are off/on only."""
    import random

    plan = {bs: PROD_PLAN[bs] for bs in (batches or PROD_PLAN)}
    by_name = {s.name: s for s in servers}
    off, on = by_name["prod_off"], by_name["prod_on"]
    off_b = by_name.get("prod_off_b")
    if off_b is not None and off_b.error:
        off_b = None
    engines = [(off, "off"), (on, "on")] + ([(off_b, "off_b")] if off_b is not None else [])
    orders = list(itertools.permutations(engines))
    out: dict[str, Any] = {"servers": {s.name: {"startup_s": s.startup_s, "error": s.error,
                                                 "args": list(s.args)} for s in servers},
                           "plan": {str(bs): {"max_pairs": p, "new_tokens": n} for bs, p, n in
                                    ((bs, *plan[bs]) for bs in plan)},
                           "warmup_runs_per_server": warmup}
    if off.error or on.error:
        return out
    rng = random.Random(0)
    metrics_port = METRICS_BASE_PORT + 1000
    # hs_tracer_drafts_total must read this many: its value before the first run, plus SGLang's
    # request-steps on the traced server since (warm-ups included)
    drafts_on = counter(settled_scrape(metrics_port), "hs_tracer_drafts")
    step_s = dict(STEP_S_GUESS)
    results = []
    for n, bs in enumerate(plan):
        max_pairs, new_tokens = plan[bs]
        ids = [[rng.randrange(100, 30000) for _ in range(prompt_len)] for _ in range(bs)]
        payload = {"input_ids": ids, "sampling_params": {"temperature": 0.0, "max_new_tokens": new_tokens,
                                                          "ignore_eos": True}}
        warm = []
        for _ in range(warmup):
            for s, _label in engines:
                t0 = time.perf_counter()
                res = generate(s, payload)
                warm.append(time.perf_counter() - t0)
                if s is on:
                    drafts_on += sum(int(o["meta_info"].get("spec_verify_ct") or 0) for o in res)
        step_s[bs] = median(warm) / new_tokens
        time.sleep(1.0)  # hs_tracer's counters are flushed every 0.5 s: the warm-up's steps land first
        # the time left, shared over this and the remaining batch sizes by their planned cost
        cost = {b: len(engines) * plan[b][0] * plan[b][1] * step_s[b] for b in list(plan)[n:]}
        left = deadline - time.monotonic()
        mine = left * cost[bs] / sum(cost.values()) if left != float("inf") else float("inf")
        pairs = max_pairs if mine == float("inf") else int(mine / (len(engines) * median(warm)))
        pairs = max(PROD_MIN_PAIRS, min(max_pairs, pairs))
        before_text = settled_scrape(metrics_port, drafts=drafts_on)
        before = histogram(before_text, "hs_tracer_host_overhead_seconds")
        steps_before = counter(before_text, "hs_tracer_verify_steps")
        drafts_before = counter(before_text, "hs_tracer_drafts")
        cpu_before = counter(before_text, "hs_tracer_thread_cpu_seconds")
        delay_before = counter(before_text, "hs_tracer_scheduler_delay_seconds")
        times: dict[str, list[float]] = {label: [] for _s, label in engines}
        verify: dict[str, int] = {label: 0 for _s, label in engines}
        request_steps = 0  # SGLang's per-request verify counts of the traced runs, summed
        for pair in range(pairs):
            for s, label in orders[pair % len(orders)]:
                t0 = time.perf_counter()
                res = generate(s, payload)
                times[label].append(time.perf_counter() - t0)
                # SGLang's verify steps of the batch: its longest request's count (a lower bound of
                # the batch's distinct steps, equal when every request is prefilled in one batch)
                counts = [int(o["meta_info"].get("spec_verify_ct") or 0) for o in res]
                verify[label] += max(counts)
                if label == "on":
                    request_steps += sum(counts)  # what hs_tracer_drafts_total must add, exactly
                    drafts_on += sum(counts)
        text = settled_scrape(metrics_port, drafts=drafts_on)
        after = histogram(text, "hs_tracer_host_overhead_seconds")
        dh = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
        ratios = sorted(a / b for a, b in zip(times["off"], times["on"], strict=True))
        control = aa_control(times) if off_b is not None else {}
        if control:  # the wall time tracing adds per step once the A/A bias is taken out, µs
            step_us = 1e6 * median(times["off"]) * pairs / max(verify["off"], 1)
            ratio = control["corrected_on_over_off"]
            control["corrected_wall_us_per_step"] = round(step_us * (1 / ratio - 1), 3)
            control["corrected_wall_us_interval95"] = [round(step_us * (1 / c - 1), 3)
                                                       for c in reversed(control["corrected_interval95"])]
        tokens = bs * new_tokens
        hs_steps = counter(text, "hs_tracer_verify_steps") - steps_before
        own = self_measured(dh.get("sum", 0.0), counter(text, "hs_tracer_thread_cpu_seconds") - cpu_before,
                            hs_steps, gauge(text, "hs_tracer_fingerprint_kernel_gpu_seconds"),
                            counter(text, "hs_tracer_scheduler_delay_seconds") - delay_before)
        wall = wall_diff_us_per_step(times["off"], times["on"], verify["on"] / pairs)
        results.append({
            "batch_size": bs, "new_tokens_per_request": new_tokens, "prompt_tokens": prompt_len,
            "pairs": pairs, "warmup_wall_s": [round(x, 4) for x in warm],
            "wall_s": {k: [round(x, 4) for x in v] for k, v in times.items()},
            "tokens_per_s_off": round(tokens / median(times["off"]), 1),
            "tokens_per_s_on": round(tokens / median(times["on"]), 1),
            # on/off throughput = off wall / on wall of the same pair
            "on_over_off_pairs": [round(x, 4) for x in ratios],
            "on_over_off": round(median(ratios), 4),
            "on_over_off_min": round(ratios[0], 4), "on_over_off_max": round(ratios[-1], 4),
            "on_over_off_iqr": [round(_quantile(ratios, 0.25), 4), round(_quantile(ratios, 0.75), 4)],
            **control,
            "decode_step_ms_off": round(1e3 * median(times["off"]) * pairs / max(verify["off"], 1), 3),
            "sglang_verify_steps": verify,
            "hs_tracer_verify_steps": hs_steps,
            # request-steps: both count each (request, verify step) SGLang committed, so they must agree
            "sglang_request_steps": request_steps,
            "hs_tracer_request_steps": counter(text, "hs_tracer_drafts") - drafts_before,
            "host_overhead_histogram_delta": dh,
            "host_overhead_mean_us": (1e6 * dh["sum"] / dh["count"]) if dh.get("count") else None,
            # hs_tracer's self-measured cost per step (hooks + recorder thread CPU + kernel GPU), and
            # the on/off wall-time difference per step it should explain
            "self_measured_us_per_step": own,
            "on_minus_off_wall_us_per_step": wall,
        })
        print(f"[prod] bs {bs}: {pairs} pairs, on/off median {results[-1]['on_over_off']:.4f} "
              f"control {control.get('control_on_over_off')} "
              f"corrected {control.get('corrected_on_over_off')} "
              f"{control.get('corrected_interval95')} "
              f"[{ratios[0]:.4f}, {ratios[-1]:.4f}], host {results[-1]['host_overhead_mean_us']} us/step, "
              f"self-measured {own['total_us']} us/step, on-off wall {wall['median_us']} us/step", flush=True)
        if progress is not None:
            progress({**out, "throughput": results})
    out["throughput"] = results
    out["gpu_memory_mib"] = {label: gpu_memory_mib(s) for s, label in engines}
    out["final_metrics_host_overhead"] = histogram(scrape(metrics_port), "hs_tracer_host_overhead_seconds")
    out["schedulers"] = [_report_summary(r) for r in reports(on)]
    return out


def add_kernel_floor(prod: dict[str, Any], floor: dict[str, Any]) -> None:
    """The fingerprint kernel's GPU time and floor at each batch size's verify rows (measured by
    ``kernel_floor_gpu.py`` on the same machine) into the prod part's throughput rows."""
    prod["kernel_floor"] = {k: floor[k] for k in ("copy_bandwidth_gb_s", "method", "machine", "source")}
    for t in prod.get("throughput") or []:
        row = floor["by_batch"].get(str(t["batch_size"]))
        if row is not None:
            t.update({k: row[k] for k in ("kernel_gpu_us", "kernel_floor_us", "kernel_bytes_floor_us",
                                          "launch_floor_us", "kernel_device_digest_us", "reference")})
            own = t.get("self_measured_us_per_step") or {}
            if own.get("serving_us") is not None:  # the kernel at this batch's rows, not at warm-up's
                own["serving_us"] = round(own["serving_us"] - (own["kernel_gpu_us"] or 0.0)
                                          + row["kernel_gpu_us"], 3)
                own["serving_kernel_from"] = "kernel_floor_gpu.py at this batch size's rows"


def aa_control(times: dict[str, list[float]], resamples: int = 2000) -> dict[str, Any]:
    """The A/A figures of one batch size from the wall times of the same pairs: off / off_b per pair
    (median, quartiles), and on/off divided by it, with a 95 % bootstrap interval (pairs resampled,
    the quotient of the two medians each time; fixed seed)."""
    import random

    off, on, off_b = times["off"], times["on"], times["off_b"]
    pairs = list(zip(off, on, off_b, strict=True))

    def corrected(sample: list[tuple[float, float, float]]) -> float:
        return median([a / b for a, b, _c in sample]) / median([a / c for a, _b, c in sample])

    rng = random.Random(0)
    boot = sorted(corrected(rng.choices(pairs, k=len(pairs))) for _ in range(resamples))
    control = sorted(a / c for a, _b, c in pairs)
    return {"control_on_over_off_pairs": [round(x, 4) for x in control],
            "control_on_over_off": round(median(control), 4),
            "control_on_over_off_iqr": [round(_quantile(control, q), 4) for q in (0.25, 0.75)],
            "corrected_on_over_off": round(corrected(pairs), 4),
            "corrected_interval95": [round(boot[int(0.025 * resamples)], 4),
                                     round(boot[int(0.975 * resamples) - 1], 4)]}


def _quantile(xs: list[float], q: float) -> float:
    """Linear-interpolated quantile of a sorted list."""
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


# ---- part: radix --------------------------------------------------------------------------------
def radix_servers(target: Path) -> list[Server]:
    return [Server("radix_rust_treecore", target,
                   ("--mem-fraction-static", "0.85", "--max-total-tokens", "16384",
                    "--cuda-graph-max-bs-decode", "16"),
                   {"SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND": "rust"})]


def run_radix(servers: list[Server], prompts: list[str]) -> dict[str, Any]:
    s = servers[0]
    res: dict[str, Any] = {"startup_s": s.startup_s, "error": s.error}
    if s.error is None:
        try:
            outs = generate(s, {"prompt": prompts[:4] * 2, "sampling_params": {"temperature": 0.0,
                                                                                "max_new_tokens": 8}},
                            timeout_s=60)
            res["served"] = len(outs)
            res["cached_tokens"] = sum(int(o["meta_info"].get("cached_tokens") or 0) for o in outs)
        except Exception as exc:
            res["request_error"] = repr(exc)
    log = tail(s.log_path, 200000)
    m = re.search(r"[^\n]*must be an int64 tensor[^\n]*", log)
    res["int64_error_line"] = m.group(0)[-300:] if m else None
    return res


# ---- orchestration -------------------------------------------------------------------------------
def card() -> str:
    """The GPU model for result file names ("h200", "h100"; "gpu" where it is none of those)."""
    import torch

    name = torch.cuda.get_device_name(0).lower() if torch.cuda.is_available() else ""
    return next((c for c in ("h200", "h100", "b200", "a100") if c in name), "gpu")


def environment() -> dict[str, Any]:
    info: dict[str, Any] = {"python": platform.python_version(), "host": platform.node()}
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda"] = torch.version.cuda
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception as exc:
        info["torch_error"] = repr(exc)
    try:
        from importlib.metadata import version

        info["sglang"] = version("sglang")
        info["triton"] = version("triton")
    except Exception as exc:
        info["version_error"] = repr(exc)
    with contextlib.suppress(Exception):
        info["nvidia_smi"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                                             "--format=csv,noheader"], capture_output=True, text=True,
                                            timeout=30).stdout.strip().splitlines()
    return info


def multicast_check(servers: list[Server]) -> dict[str, Any]:
    """Log lines that would show a symmetric-memory / multicast path was taken (expected: none)."""
    hits: dict[str, list[str]] = {}
    for s in servers:
        lines = [ln for ln in tail(s.log_path, 10**7).splitlines()
                 if re.search(r"multicast|symm_mem|symmetric memory|NVLS|multimem", ln, re.I)
                 and "server_args=" not in ln]
        hits[s.name] = lines[:10]
    return hits


def measure(name: str, servers: list[Server],
            body: Callable[[list[Server]], dict[str, Any]]) -> dict[str, Any]:
    """Run one part's workload on its (already started) engines, then stop them."""
    t0 = time.monotonic()
    try:
        result = body(servers)
    except Exception as exc:
        import traceback

        result = {"error": repr(exc), "traceback": traceback.format_exc()[-4000:]}
    finally:
        stop_all(servers)
    result["workload_wall_s"] = round(time.monotonic() - t0, 1)
    result["multicast_log_lines"] = multicast_check(servers)
    print(f"== {name}: done in {result['workload_wall_s']} s", flush=True)
    return result


def testbed_inputs(args: argparse.Namespace, work: Path) -> tuple[Path, Path, Path, Path]:
    """Target, draft, the ids_shifted copy of the draft, and the testbed profile."""
    from hs_tracer_testbed.miswire import write_variant

    if args.target is None:
        from hs_tracer_testbed import ensure_testbed
        from hs_tracer_testbed.demo import testbed_profile

        tb = ensure_testbed()
        target, draft, profile = tb.target, tb.draft, testbed_profile(tb)
    else:
        target, draft, profile = args.target.resolve(), args.draft.resolve(), args.profile.resolve()
    shifted = write_variant(draft, work / "draft_ids_shifted", "ids_shifted")
    return target, draft, shifted, profile


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--parts", default="testbed,prod,radix")
    ap.add_argument("--target", type=Path, help="testbed target (default: build/reuse the testbed)")
    ap.add_argument("--draft", type=Path)
    ap.add_argument("--profile", type=Path)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--servers", help="only these engines of the chosen parts (comma-separated names)")
    ap.add_argument("--deadline-s", type=float, default=0,
                    help="end the prod part's measurements this many seconds after the start (0: none); "
                         "pairs per batch size shrink to fit, to no fewer than 3")
    ap.add_argument("--reference-ids", type=Path,
                    help="runs.py output of plain decoding of the same prompts on CPU in float32 "
                         "(compared with the GPU's plain decoding)")
    ap.add_argument("--tag", default="", help="suffix of the result file names")
    ap.add_argument("--prod-batches", help="only these of the prod part's batch sizes (comma-separated; "
                    f"default all of {sorted(PROD_PLAN)})")
    ap.add_argument("--prod-warmup", type=int, default=PROD_WARMUP,
                    help="untimed runs per server and batch size before the prod part's pairs")
    ap.add_argument("--kernel-floor", type=Path, help="kernel_floor_gpu.py's result on this machine: its "
                    "kernel_gpu_us / kernel_floor_us per batch size go beside each batch's throughput")
    ap.add_argument("--host-breakdown", action="store_true",
                    help="time hs_tracer's per-step functions inside the traced prod engine, per batch "
                         "size, with a canary workload beside them (the testbed's HostBreakdown patch)")
    ap.add_argument("--deterministic", action="store_true",
                    help="testbed engines with SGLang's --enable-deterministic-inference (and untraced "
                         "float32 twins): tracing on/off and EAGLE/plain must be identical in every round")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of the testbed prompts per engine")
    ap.add_argument("--identity-every", type=int, default=None,
                    help="HS_TRACER_IDENTITY_EVERY of every traced server (same-token layer identity on 1 "
                         "in N prefill forwards; 0 off); default: the environment's, else hs_tracer's")
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    if args.target is not None and (args.draft is None or args.profile is None):
        ap.error("--target needs --draft and --profile")
    parts = [p for p in args.parts.split(",") if p]
    t_start = time.monotonic()
    deadline = t_start + args.deadline_s if args.deadline_s else float("inf")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so `timeout` still stops the engines

    from hs_tracer_testbed.corpus import prompts as corpus_prompts

    prompts = corpus_prompts(seed=1234, n=16)
    reference = None
    if args.reference_ids is not None:
        runs = json.loads(args.reference_ids.read_text())
        reference = next(r["output_ids"] for r in runs if r["config"]["name"] == "plain")
    work = Path(tempfile.mkdtemp(prefix="hs-tracer-gpu-"))
    target, draft, shifted, profile = testbed_inputs(args, work)
    models = write_models(work / "prodwidth")
    plan = {"testbed": testbed_servers(target, draft, shifted, profile, args.tp, args.deterministic),
            "prod": prod_servers(models, args.tp), "radix": radix_servers(target) if args.tp == 1 else []}
    identity = (str(args.identity_every) if args.identity_every is not None
                else os.environ.get("HS_TRACER_IDENTITY_EVERY"))
    if identity is not None:  # passed to every traced server, so throughput is measured with it
        for servers in plan.values():
            for s in servers:
                if s.traced:
                    s.env = {**s.env, "HS_TRACER_IDENTITY_EVERY": identity}
    if args.servers:
        keep = set(args.servers.split(","))
        plan = {part: [s for s in servers if s.name in keep] for part, servers in plan.items()}
    if args.dry_run:
        for part in parts:
            for i, s in enumerate(plan[part]):
                cmd = launcher.worker_command(s.model, (*s.args, "--port", str(BASE_PORT + 100 * i)))
                print(f"[{part}/{s.name}] traced={s.traced} env={s.env}\n  {' '.join(cmd)}")
        shutil.rmtree(work)
        return 0

    today = datetime.date.today().isoformat()
    stem = f"gpu_sglang_{card()}_tp{args.tp}_{today}{args.tag}"
    log_dir = args.out_dir / f"{stem}_logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    if args.host_breakdown:
        from hs_tracer_testbed.runtime.gpu.patches import BREAKDOWN_FLAG

        for s in plan["prod"]:
            if s.traced:
                s.env = {**s.env, BREAKDOWN_FLAG: str(log_dir)}
    result: dict[str, Any] = {
        "what": "real SGLang 0.5.23 EAGLE-3 servers with hs_tracer inside, hs_tracer GPU testbed runtime",
        "date": today, "source": source_state(ROOT), "sglang": SGLANG_VERSION, "tp": args.tp,
        "deterministic_inference": args.deterministic, "rounds": args.rounds,
        "identity_every": identity if identity is not None else "hs_tracer's default",
        "cuda_graphs": "on (SGLang default: target verify, draft decode, draft extend)",
        "overlap_scheduler": "on (SGLang default, spec v2)",
        "radix_cache": "on (SGLang's Python TreeCore)",
        "server_flags": list(launcher.SERVER_FLAGS), "runtime_env": launcher.RUNTIME_ENV,
        "environment": environment(), "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
        "method": ("servers of a part start in parallel on the same GPUs; greedy; ignore_eos; testbed: "
                   f"{args.rounds} rounds of the same 16 prompts (plain decoding once more with top-2 "
                   "log-probabilities); "
                   f"prod: per batch size {args.prod_warmup} warm-up runs per server discarded, then pairs "
                   "in which each server (off, on, and the untraced A/A control off_b) runs once, the order "
                   "cycling through every permutation; on/off = median over pairs of the pair's "
                   "off wall / on wall, control = the same with off_b for on, corrected = on/off over "
                   "control with a 95 % bootstrap interval over pairs; spread = min/max and quartiles "
                   "over pairs; tokens/s = batch * new "
                   "tokens / median wall (prefill of 64 prompt tokens included); hs_tracer host time per "
                   "step = its own histogram (observed every verify step) over the timed runs; "
                   "self-measured cost per step = that + hs_tracer_thread_cpu_seconds_total's increase "
                   "over its verify steps + hs_tracer_fingerprint_kernel_gpu_seconds; on - off wall per "
                   "step = per pair (on wall - off wall) / SGLang's verify steps per run, median over "
                   "pairs; counters read once hs_tracer_drafts_total has reached SGLang's summed "
                   "per-request spec_verify_ct"),
    }
    # All engines start at once (startup dominates); parts are then measured one after the other, each
    # part's engines stopped before the next part's workload, so prod throughput runs on a quiet GPU.
    active = {part: plan[part] for part in ("testbed", "radix", "prod") if part in parts and plan[part]}
    everything = [s for servers in active.values() for s in servers]
    print(f"== starting {len(everything)} engines: {[s.name for s in everything]}", flush=True)
    t0 = time.monotonic()
    opcheck = subprocess.Popen([sys.executable, "-m", "hs_tracer_testbed.runtime.gpu.opcheck"],
                               env=launcher.runtime_env(), stdout=subprocess.PIPE,
                               stderr=(log_dir / "opcheck.log").open("w"), text=True)
    start_all(everything, log_dir, work)
    result["startup_wall_s"] = round(time.monotonic() - t0, 1)
    result["startup_s"] = {s.name: s.startup_s if s.error is None else s.error[:2000] for s in everything}
    try:
        line = opcheck.communicate(timeout=120)[0].strip().splitlines()
        result["opcheck"] = json.loads(line[-1]) if line else {"error": tail(log_dir / "opcheck.log")}
    except Exception as exc:
        result["opcheck"] = {"error": repr(exc)}
    bodies: dict[str, Callable[[list[Server]], dict[str, Any]]] = {
        "testbed": lambda ss: run_testbed(ss, prompts, args.max_new_tokens, reference, args.rounds),
        "radix": lambda ss: run_radix(ss, prompts),
        "prod": lambda ss: run_prod(ss, deadline, progress=lambda part: write(args.out_dir, stem,
                                                                               {**result, "prod": part}),
                                    batches=[int(b) for b in args.prod_batches.split(",")]
                                    if args.prod_batches else None, warmup=args.prod_warmup),
    }
    try:
        for part, servers in active.items():
            result[part] = measure(part, servers, bodies[part])
            if part == "prod":
                result[part]["models"] = json.loads((models / "summary.json").read_text())
                time.sleep(2.5)  # the breakdown files are rewritten every 2 s
                result[part]["host_breakdown"] = {p.name: json.loads(p.read_text())
                                                  for p in sorted(log_dir.glob("host-breakdown-*.json"))}
                if args.kernel_floor is not None and args.kernel_floor.exists():
                    add_kernel_floor(result[part], json.loads(args.kernel_floor.read_text()))
            write(args.out_dir, stem, result)
    finally:
        stop_all(everything)
    shutil.rmtree(work, ignore_errors=True)
    return 0


def write(out_dir: Path, stem: str, result: dict[str, Any]) -> None:
    (out_dir / f"{stem}.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    (out_dir / f"{stem}.md").write_text(markdown(result))


def markdown(r: dict[str, Any]) -> str:
    env = r.get("environment", {})
    src = r.get("source") or {}
    lines = [f"# Real SGLang {r['sglang']} EAGLE-3 with hs_tracer, TP={r['tp']} ({r['date']})", "",
             f"Source: commit {src.get('commit') or 'unknown'}"
             f"{' with uncommitted changes' if src.get('dirty') else ''}"
             f"{' (clean tree)' if src.get('dirty') is False else ''}.",
             f"GPU: {', '.join(env.get('gpus') or []) or env.get('nvidia_smi')}; torch {env.get('torch')}, "
             f"CUDA {env.get('cuda')}, SGLang {env.get('sglang')}, Python {env.get('python')}.",
             f"CUDA graphs: {r['cuda_graphs']}. Overlap scheduler: {r['overlap_scheduler']}. "
             f"Radix cache: {r['radix_cache']}.", f"Method: {r['method']}.",
             f"Flags: `{' '.join(r['server_flags'])}`.", "",
             *(f"Note: {note}" for note in r.get("notes") or ()), ""]
    oc = r.get("opcheck")
    if oc:
        lines += ["## Stand-in ops on the GPU (vs SGLang's references, eager under sync-debug 'error', and "
                  "replayed from a captured CUDA graph)", "", "| op | equal | graph equal | detail |",
                  "|---|---|---|---|"]
        for name, v in oc.items():
            if isinstance(v, dict):
                detail = {k: x for k, x in v.items() if k not in ("equal", "graph_equal")}
                lines.append(f"| {name} | {v.get('equal')} | {v.get('graph_equal', '-')} | {detail or ''} |")
        lines.append("")
    tb = r.get("testbed")
    if tb:
        lines += ["## Testbed target + draft", "",
                  "| server | start s | lossless vs plain | SGLang pooled AL | SGLang per-request mean AL | "
                  "hs_tracer pooled AL | steps equal | status | hook errors | emitting ranks | slots |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for name, s in (tb.get("servers") or {}).items():
            both = s.get("both_rounds") or {}
            rec = s.get("accept_length_reconciliation") or {}
            sch = s.get("schedulers") or []
            slots = "; ".join(f"{x['index']}: {x['expected_source']}->{x['observed_source']}"
                              for sc in sch if sc.get("emitting") for x in sc.get("slots") or [])
            lines.append(
                f"| {name} | {s.get('startup_s')} | "
                f"{_identical(tb.get('lossless_vs_plain', {}).get(name))} | "
                f"{_f(both.get('pooled_accept_length'))} | "
                f"{_f(both.get('per_request_mean_accept_length'))} | "
                f"{_f(rec.get('hs_tracer_pooled_accept_length'))} | {rec.get('pooled_equal', '-')} | "
                f"{', '.join(str(sc.get('status')) for sc in sch if sc.get('emitting')) or '-'} | "
                f"{sum(sc.get('hook_errors') or 0 for sc in sch) if sch else '-'} | "
                f"{[sc.get('ranks') for sc in sch if sc.get('emitting')] if sch else '-'} | {slots or '-'} |")
            if s.get("error"):
                lines.append(f"|  | error: {s['error'][:300].replace('|', '/')} |||||||||| ")
        lines += ["", "Same-token layer identity inside each traced engine (forwards sampled / recorded / "
                  "run eagerly instead of replaying a prefill graph; what each slot's rows equal):", "",
                  "| server | sampled | recorded | eager prefills | samples measured | slots measured |",
                  "|---|---|---|---|---|---|"]
        for name, s in (tb.get("servers") or {}).items():
            for sc in s.get("schedulers") or []:
                ident, meas = sc.get("identity") or {}, sc.get("measured_identity") or {}
                if sc.get("emitting") and ident:
                    got = "; ".join(
                        f"{m['index']}: " + ("/".join(m["sources"]) or f"none, nearest {m['nearest']}")
                        for m in meas.get("slots") or [])
                    lines.append(f"| {name} | {ident.get('sampled')} | {ident.get('recorded')} | "
                                 f"{ident.get('eager_prefills', '-')} | {meas.get('samples', 0)} | "
                                 f"{got or '-'} |")
        lines += ["", f"Greedy outputs, identical per round (round 1 / round 2 / ...; rounds after the first "
                  f"are served from the radix cache; deterministic inference: "
                  f"{'on' if r.get('deterministic_inference') else 'off'}):", ""]
        for pair, same in (tb.get("tracing_on_vs_off") or {}).items():
            lines.append(f"- tracing on vs off, {pair}: {_identical(same)}")
        for name, same in (tb.get("rounds_vs_round_1") or {}).items():
            lines.append(f"- {name}, rounds 2.. vs round 1 (the engine against itself): {_identical(same)}")
        if "plain_logprob_round_identical" in tb:
            lines.append("- plain, round with log-probabilities vs round 1: "
                         f"{_identical([tb['plain_logprob_round_identical']])}")
        for name, same in (tb.get("cpu_fp32_reference") or {}).items():
            lines.append(f"- {name} vs plain decoding on CPU in float32 (testbed engine): {_identical(same)}")
        ties = tb.get("near_ties_bf16") or {}
        if ties:
            lines += ["", "Where a bf16 EAGLE engine first differs from plain decoding: plain's "
                      "log-probability margin between its token and the runner-up (round 1 / round 2), "
                      "against the margins at all output positions:", "",
                      "| server | divergences | margins at divergence | EAGLE token = plain's runner-up | "
                      "median margin, all positions | share of positions with margin <= the largest |",
                      "|---|---|---|---|---|---|"]
            for name, rounds in ties.items():
                firsts = [f for rnd in rounds for f in rnd["first_divergences"]]
                margins = ", ".join("-" if f["margin"] is None else format(f["margin"], ".3g")
                                    for f in firsts) or "-"
                lines.append(
                    f"| {name} | {' / '.join(str(len(rnd['first_divergences'])) for rnd in rounds)} | "
                    f"{margins} | "
                    f"{sum(f['eagle_token_is_top2'] for f in firsts)}/{len(firsts)} | "
                    f"{_f(rounds[0]['median_margin_all_positions'])} | "
                    f"{' / '.join(_f(rnd['share_of_positions_at_or_below_max']) for rnd in rounds)} |")
        for name, s in (tb.get("servers") or {}).items():
            if s.get("metrics_rank_labels"):
                lines.append(f"- {name}: each emitting scheduler's own metrics port carries the labels "
                             f"{s['metrics_rank_labels']} (verify steps {s.get('metrics_verify_steps')})")
        if tb.get("error"):
            lines += ["", f"Part error: {tb['error']}"]
        lines.append("")
    rx = r.get("radix")
    if rx:
        lines += ["## Compiled (Rust) radix TreeCore under this torch", "",
                  f"startup_s {rx.get('startup_s')}, served {rx.get('served')}, error line: "
                  f"`{rx.get('int64_error_line')}`, request error: {rx.get('request_error')}", ""]
    pr = r.get("prod")
    if pr:
        lines += ["## DeepSeek-V3 width, random weights: tracing on vs off", "",
                  f"Models: {json.dumps(pr.get('models'))}", "",
                  "| batch | new tokens | pairs | tok/s off | tok/s on | on/off (median of pairs) | "
                  "min-max | quartiles | decode step ms (off) | hs_tracer host us/step (mean) | steps "
                  "observed / hs_tracer steps / SGLang steps (on) |", "|---" * 11 + "|"]
        for t in pr.get("throughput") or []:
            lines.append(f"| {t['batch_size']} | {t['new_tokens_per_request']} | {t['pairs']} | "
                         f"{t['tokens_per_s_off']} | {t['tokens_per_s_on']} | {t['on_over_off']} | "
                         f"{t['on_over_off_min']}-{t['on_over_off_max']} | {t['on_over_off_iqr']} | "
                         f"{t['decode_step_ms_off']} | {_f(t.get('host_overhead_mean_us'))} | "
                         f"{t['host_overhead_histogram_delta'].get('count')} / "
                         f"{t['hs_tracer_verify_steps']} / "
                         f"{t['sglang_verify_steps']['on']} |")
        rows = [t for t in pr.get("throughput") or [] if "self_measured_us_per_step" in t]
        if rows:
            lines += ["", "hs_tracer's self-measured cost per verify step (its metrics over the timed runs: "
                      "hooks' host time + recorder thread CPU in the scheduler process + fingerprint "
                      "kernel GPU time, timed at warm-up) next to what tracing added to the wall time of "
                      "a decode step (per pair (on - off) / SGLang's steps per run; median, quartiles); "
                      "request-steps: SGLang's summed per-request verify counts and hs_tracer's "
                      "`hs_tracer_drafts_total`, which must be equal:", "",
                      "| batch | hook us | thread CPU us | kernel GPU us | self-measured total us | "
                      "on - off wall us (median) | quartiles | request-steps SGLang / hs_tracer |",
                      "|---" * 8 + "|"]
            for t in rows:
                own, wall = t["self_measured_us_per_step"], t["on_minus_off_wall_us_per_step"]
                lines.append(f"| {t['batch_size']} | {_f(own['hook_us'])} | {_f(own['thread_cpu_us'])} | "
                             f"{_f(own['kernel_gpu_us'])} | {_f(own['total_us'])} | "
                             f"{_f(wall['median_us'])} | {wall['iqr_us']} | "
                             f"{t.get('sglang_request_steps')} / "
                             f"{_f(t.get('hs_tracer_request_steps'))} |")
        aa = [t for t in pr.get("throughput") or [] if "control_on_over_off" in t]
        if aa:
            lines += ["", "A/A control: a second untraced engine (`prod_off_b`) in the same pairs, every "
                      "order of the three engines in turn; control = off wall / off_b wall; corrected = "
                      "on/off over control, 95 % bootstrap interval over pairs; the corrected wall "
                      "difference per step is what tracing adds once the bias is out:", "",
                      "| batch | pairs | on/off | control on/off | control quartiles | corrected on/off | "
                      "interval | corrected on - off wall us/step | interval | self-measured serving "
                      "us/step (hooks + scheduler delay + kernel) |",
                      "|---" * 10 + "|"]
            for t in aa:
                lines.append(f"| {t['batch_size']} | {t['pairs']} | {t['on_over_off']} | "
                             f"{t['control_on_over_off']} | {t['control_on_over_off_iqr']} | "
                             f"{t['corrected_on_over_off']} | {t['corrected_interval95']} | "
                             f"{t['corrected_wall_us_per_step']} | {t['corrected_wall_us_interval95']} | "
                             f"{_f((t.get('self_measured_us_per_step') or {}).get('serving_us'))} |")
        kf = [t for t in pr.get("throughput") or [] if "kernel_floor_us" in t]
        if kf:
            lines += ["", "Fingerprint kernel per step (`kernel_floor_gpu.py`, same machine): the masked "
                      "launch as recorded in the target-verify graph, graph replays; floor = bytes / copy "
                      f"bandwidth ({pr['kernel_floor']['copy_bandwidth_gb_s']} GB/s) + an empty kernel's "
                      "graph node:", "",
                      "| batch | kernel_gpu_us | digest in device memory us "
                      "| kernel_floor_us (bytes + launch) | x floor | reference (max rel. error, counts "
                      "equal) |", "|---" * 6 + "|"]
            for t in kf:
                ref = t["reference"]
                lines.append(f"| {t['batch_size']} | {t['kernel_gpu_us']} | {t['kernel_device_digest_us']} | "
                             f"{t['kernel_floor_us']} "
                             f"({t['kernel_bytes_floor_us']} + {t['launch_floor_us']}) | "
                             f"{round(t['kernel_gpu_us'] / t['kernel_floor_us'], 2)} | "
                             f"{ref['max_rel_error']:.1e}, {ref['counts_equal']} |")
        lines += ["", f"GPU memory (MiB, all processes of the server): {pr.get('gpu_memory_mib')}", ""]
        lines += _breakdown_lines(pr.get("host_breakdown") or {})
        if pr.get("error"):
            lines += [f"Part error: {pr['error']}", ""]
    return "\n".join(lines) + "\n"


BREAKDOWN_ROWS = ("observe_decode", "probe_observe_rows", "graph_replay_native", "graph_replay_ctypes",
                  "record", "step_log_append", "window_close", "canary")


def _breakdown_lines(files: dict[str, Any]) -> list[str]:
    """The traced engine's per-function host times (``--host-breakdown``), median µs per call and
    calls, per batch size."""
    lines = []
    for name, per_batch in files.items():
        sizes = [bs for bs in per_batch if bs != "0"]
        lines += [f"hs_tracer's per-step functions inside the engine ({name}; median µs per call, "
                  "calls in brackets; nested: observe_decode holds probe_observe_rows, which holds the "
                  "graph replay; record holds step_log_append; the canary is a fixed workload timed "
                  "before every decode hook):", "",
                  "| function | " + " | ".join(f"batch {bs}" for bs in sizes) + " |",
                  "|---|" + "---:|" * len(sizes)]
        for row in BREAKDOWN_ROWS:
            cells = [per_batch[bs].get(row) for bs in sizes]
            if any(cells):
                lines.append(f"| {row} | " + " | ".join(
                    f"{c['median_us']:.1f} ({c['count']})" if c else "-" for c in cells) + " |")
        lines.append("")
    return lines


def _identical(rounds: list[dict[str, Any]] | None) -> str:
    if not rounds:
        return "-"
    return " / ".join("identical" if r["identical"] else f"{r['sequences_differing']}/{r['sequences']} differ"
                      for r in rounds)


def _f(x: Any) -> str:
    return f"{x:.4f}" if isinstance(x, float) else str(x if x is not None else "-")


if __name__ == "__main__":
    raise SystemExit(main())

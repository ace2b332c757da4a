"""What hs_tracer costs SGLang's scheduler thread per decode step: the per-step hooks through SGLang's
own HookRegistry wrappers, plus the tracer's threads in the scheduler process sharing the GIL.

    PYTHONPATH=. python benchmarks/hook_overhead.py [--device cuda|cpu] [--out DIR] [--tag TAG]
                                                   [--export process|thread] [--launch in_graph|replay]

The two hooks that run every decode step (before ``EagleDraftWorker._draft_extend_for_decode``,
after ``_resolve_spec_v2_tokens``) are wrapped by SGLang 0.5.23's ``hook_registry._wrap_fn``,
exactly as the plugin registers them, and compared with the same unwrapped calls in one run. N is
the number of draft-input rows (batch x 4 draft tokens; batch = max(1, N/4) real SGLang ``Req``
objects); the draft input is a static ``[N, 3*7168]`` bf16 buffer, as SGLang's target CUDA graph
hands it over. On CUDA each step starts with a replay of a stand-in for SGLang's target-verify
graph (one small kernel; its output address is the draft input's), plain and traced alike. With
``--launch in_graph`` (the default, as ``HS_TRACER_IN_GRAPH``'s) the traced graph also holds the
probe's kernel, recorded at capture exactly as the plugin records it into SGLang's, and the launch
hook only notes the step; with ``--launch replay`` the launch hook replays the probe's own launch
graph (what runs under eager mode, trees and batches above the largest graph).

Headline: what the scheduler thread pays per step, the hooks alone ("hooks" below) plus the recorder
thread's CPU per step (it shares the scheduler's GIL); target <= 10 µs. "loop": the same measured as
what a scheduler loop loses per step (noisier: the spread of its block pairs is reported). One step
in SGLang's overlap order: the launch hook (it enqueues the probe), then the
step's next GPU work is enqueued (``torch.cuda._sleep`` of ``--gpu-us``), then, while the GPU works,
the previous step's result hook and the scheduler's own Python (a fixed loop calibrated to take
``--python-us`` with no other thread running), then the wait for this step's GPU work. The GPU work
(probe kernel included, <= ~55 µs) is shorter than the Python, so the wait finds it done: GPU time
overlaps Python and the loop's wall time is the scheduler thread's host time. (On CPU the GPU work
is a ``time.sleep`` at the wait, which, like SGLang's waits, releases the GIL; nothing overlaps it.)
Off: plain calls. On: traced calls. One real ``Recorder`` thread runs through all blocks of an N at its
production cadence (as in serving; idle in the off blocks, whose calls hand it nothing). With ``--export
process`` (``HS_TRACER_EXPORT``'s default) the recorder thread only batches the steps and writes them
down a pipe to hs_tracer's export process, which runs the exporters; with ``--export thread`` they run
in the recorder thread. Exporters: Prometheus (its HTTP server up), OpenTelemetry step spans at the
default 1% sample shipped over OTLP/HTTP to a collector stand-in in a child process, diagnosis windows
closing at the default ``HS_TRACER_WINDOW_TOKENS`` (on CUDA the real probe's; on CPU a stand-in probe
that counts and hands the recorder a window of DeepSeek-V3 width every time one closes) and the online
diagnosis when ``--profile`` is given. The recorder thread's CPU time is read from its thread clock over all
blocks and divided by the on steps (an on block's last hand-off can land in the next off block), and
broken down into window folds, batch building and pipe writes (thread-clock wrappers); the
export process's (another process: it does not hold the scheduler's GIL) from ``/proc`` in clock ticks
(10 ms), so that column is coarse. The loop is scheduler-bound, so whatever the tracer takes from the
scheduler thread, the hooks and the GIL time of the tracer's threads in this process, lengthens the
step. Off and on blocks alternate; the figure is the median over block pairs of (on - off) wall time per
step, with their mean and quartiles beside it (a block should span a few of the recorder's wake-ups, or the
median can miss them; the mean cannot). ``--switch-interval``
sets ``sys.setswitchinterval`` for the whole run (Python's default is 5 ms).

"hooks": the hooks alone, per-step median of ``perf_counter_ns`` around the pair of calls, plain
and traced rounds interleaved, the recorder's work (taking the pending steps) outside the timing.
On CUDA the real ``FingerprintProbe`` runs (graph-replayed launch, digest ring); on CPU the
stand-in probe. The GPU is paced (a sync every 8 steps, outside the timing).
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
from array import array
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from provenance import source_state
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.plugins.hook_registry import HookType, _wrap_fn
from sglang.srt.sampling.sampling_params import SamplingParams

from hs_tracer.config import TracerConfig
from hs_tracer.core.steps import StepPath
from hs_tracer.fingerprint.stats import DIGEST_WIDTH, ChannelStats
from hs_tracer.integrations.sglang import hooks, state
from hs_tracer.records import Ranks, WiringRecord

HIDDEN, SLOTS, DRAFT_TOKENS = 7168, 3, 4
NS = (1, 16, 64, 256, 1024, 4096)

COLLECTOR = r"""
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200); self.send_header("Content-Length", "0"); self.end_headers()
    def log_message(self, *a):
        pass
s = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
print(s.server_address[1], flush=True)
s.serve_forever()
"""


class StandInProbe:
    """CPU stand-in for FingerprintProbe: no tensor work, same calls; a closed window yields
    DeepSeek-V3-width channel stats (what the recorder folds and diagnoses)."""

    ring_size = 1024
    num_slots, hidden = SLOTS, HIDDEN

    def __init__(self) -> None:
        self.pending: list[tuple[int, int, np.ndarray]] = []
        self.windows = 0
        self._raw = np.zeros((SLOTS, DIGEST_WIDTH))
        self._raw[:, 0] = 1.0
        rng = np.random.default_rng(0)
        self._window = ChannelStats(count=np.full((SLOTS, HIDDEN), 64, dtype=np.int64),
                                    sum=rng.standard_normal((SLOTS, HIDDEN)),
                                    sumsq=64 + rng.random((SLOTS, HIDDEN)))

    def observe_rows(self, x: torch.Tensor, step_id: int) -> int:
        n = int(x.shape[0])
        self.pending.append((step_id, n, self._raw))
        return n

    def end_window(self) -> None:
        self.windows += 1

    def read_window(self, block: bool = False) -> ChannelStats | None:
        if not self.windows:
            return None
        self.windows = 0
        return self._window

    def landed_windows(self) -> list[tuple[int, ChannelStats]]:
        return [(-1, self.read_window())] if self.windows else []

    def release_windows(self, slots: list[int]) -> None:
        pass

    def drain_raw(self) -> list:
        out, self.pending = self.pending, []
        return out

    def drain_block(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        out = self.drain_raw()  # the CUDA ring copies the landed rows as one block
        steps, tokens, _raws = zip(*out, strict=False) if out else ((), (), ())
        raws = np.broadcast_to(self._raw, (len(out), SLOTS, DIGEST_WIDTH))
        return np.array(steps, dtype=np.int64), np.array(tokens, dtype=np.int64), raws

    def digest_of(self, tokens: int, raw: np.ndarray):
        from hs_tracer.fingerprint.stats import StepDigest

        return StepDigest.from_raw(tokens, raw)


def draft_extend_for_decode(self: object, batch: object, batch_result: object, *, kv_loc_plan=None):
    return None


def resolve_spec_v2_tokens(self: object, result: object, batch: object):
    return None


TRACED_DECODE = _wrap_fn(draft_extend_for_decode, hooks.before_draft_extend_for_decode, HookType.BEFORE)
TRACED_RESOLVE = _wrap_fn(resolve_spec_v2_tokens, hooks.after_resolve_spec_v2_tokens, HookType.AFTER)
PROCESSOR = SimpleNamespace(enable_overlap=True, enable_overlap_mlx=False)  # SGLang's default scheduler


def make_state(device: torch.device, profile: Path | None, export: str | None = None) -> state.TracerState:
    """Tracer state as ``finish_startup`` leaves it, minus the recorder (each "on" block starts one)."""
    st = state.install(TracerConfig(metrics_port=0, profile=profile, export=export or TracerConfig().export))
    st.wiring = WiringRecord(model="bench", target_arch="DeepseekV3ForCausalLM", num_layers=61,
                             hidden_size=HIDDEN, layers_to_capture=[2, 30, 58],
                             sources=["block:1", "block:29", "block:57"],
                             spec_args={"speculative_num_steps": 3, "speculative_eagle_topk": 1,
                                        "speculative_num_draft_tokens": DRAFT_TOKENS})
    st.spec_args = dict(st.wiring.spec_args)
    st.ranks = Ranks()
    if device.type == "cuda":
        from hs_tracer.fingerprint.probe import FingerprintProbe

        probe = FingerprintProbe(SLOTS, HIDDEN, device, ring_size=st.RING_SIZE, warmup_dtype=torch.bfloat16)
    else:
        probe = StandInProbe()
    st.steps = StepPath(probe, probe, st.config.window_tokens, st.ranks, st.config.queue_size)  # type: ignore[arg-type]
    return st


def step_inputs(n: int, device: torch.device) -> tuple[SimpleNamespace, SimpleNamespace,
                                                       list[SimpleNamespace]]:
    """The running batch (launched every step), the snapshot of it SGLang resolves (``batch.copy()``),
    and two results that alternate as under the overlap scheduler."""
    bs = max(1, n // DRAFT_TOKENS)
    dev = device if device.type == "cuda" else torch.device("meta")
    features = torch.zeros(n, SLOTS * HIDDEN, dtype=torch.bfloat16, device=dev)
    if device.type == "cuda":
        features.normal_()
    params = SamplingParams(max_new_tokens=1 << 20)
    reqs = [Req(f"req-{i}", "", array("i", [1, 2, 3]), params) for i in range(bs)]
    results = [SimpleNamespace(logits_output=SimpleNamespace(hidden_states=features),
                               speculative_num_draft_tokens=DRAFT_TOKENS) for _ in range(2)]
    return SimpleNamespace(reqs=reqs), SimpleNamespace(reqs=reqs[:]), results


def target_graph(st: state.TracerState, results: list[SimpleNamespace], launch: str):
    """SGLang's target-verify CUDA graph as the step path meets it: replayed once per step before the
    hooks, its output (here the static draft input) the draft's input. Returns the replays for the
    plain and the traced calls. ``launch="in_graph"``: the traced calls' graph also holds the probe's
    kernel, recorded while it is captured as the plugin records it into SGLang's (over every row:
    all KV slots non-zero), so the launch hook only notes the step; ``"replay"``: both graphs are
    the same and the launch hook replays the probe's own launch graph. On CPU, no graph."""
    features = results[0].logits_output.hidden_states
    if features.device.type != "cuda":
        return (lambda: None), (lambda: None)
    probe = st.steps.decode.probe
    probe.in_graph_inputs.clear()  # the previous N's graph and buffers are gone
    slots = torch.arange(1, features.shape[0] + 1, dtype=torch.int64, device=features.device)
    graphs = []
    side = torch.cuda.Stream()
    for traced in (False, True):
        side.wait_stream(torch.cuda.current_stream())
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=side):
            slots.add_(0)  # the target's own work, reduced to one small kernel
            if traced and launch == "in_graph":
                assert probe.record_in_graph(features, slots), "the probe refused to record into the graph"
        graphs.append(g)
    torch.cuda.synchronize()
    return graphs[0].replay, graphs[1].replay


def fresh_accept(result: SimpleNamespace, bs: int) -> None:
    """SGLang hands over a fresh CPU tensor of accept lengths every step."""
    result.accept_lens = torch.randint(1, DRAFT_TOKENS + 1, (bs,), dtype=torch.int32)


def bench_hooks(st: state.TracerState, n: int, device: torch.device, steps: int, rounds: int,
                launch: str) -> dict:
    """Per step, SGLang's overlap order: the target's graph replays, launch step i (draft extend),
    then resolve step i - 1 (the replay is timed with the calls, plain and traced alike: with
    ``launch="in_graph"`` the traced graph holds the probe's kernel). "fallback": launch and resolve
    of one step back to back (SGLang processed the result before the next launch, e.g. a prefill
    came in between): every request is tested."""
    running, snapshot, results = step_inputs(n, device)
    bs = len(running.reqs)
    cuda = device.type == "cuda"
    accepts = [torch.randint(1, DRAFT_TOKENS + 1, (bs,), dtype=torch.int32) for _ in range(64)]
    state_ = {"i": 0}
    target_plain, target_traced = target_graph(st, results, launch)

    def plain() -> None:
        i = state_["i"] = state_["i"] + 1
        target_plain()
        draft_extend_for_decode(None, running, results[i % 2])
        resolve_spec_v2_tokens(PROCESSOR, results[(i - 1) % 2], snapshot)

    def traced() -> None:
        i = state_["i"] = state_["i"] + 1
        target_traced()
        TRACED_DECODE(None, running, results[i % 2])
        TRACED_RESOLVE(PROCESSOR, results[(i - 1) % 2], snapshot)

    def fallback() -> None:
        target_traced()
        TRACED_DECODE(None, running, results[0])
        TRACED_RESOLVE(PROCESSOR, results[0], snapshot)

    def decode_only() -> None:  # the launch hook alone (the replay before it and the result hook untimed)
        i = state_["i"] = state_["i"] + 1
        TRACED_DECODE(None, running, results[i % 2])
        state_["pending"] = results[(i - 1) % 2]

    def resolve_only() -> None:
        TRACED_RESOLVE(PROCESSOR, state_["pending"], snapshot)

    medians: dict[str, list[float]] = {"plain": [], "traced": [], "fallback": [], "decode": [], "resolve": []}
    for r in range(rounds + 1):  # round 0 warms up (captures the launch graph)
        split: dict[str, list[int]] = {"decode": [], "resolve": []}
        for i in range(steps):  # each hook timed on its own, in the overlap order
            results[0].accept_lens = results[1].accept_lens = accepts[i % 64]
            target_traced()
            for name, fn in (("decode", decode_only), ("resolve", resolve_only)):
                t0 = time.perf_counter_ns()
                fn()
                split[name].append(time.perf_counter_ns() - t0)
            if i % 8 == 7:
                if cuda:
                    torch.cuda.synchronize()
                take_steps(st)
        if r:
            for name, samples in split.items():
                medians[name].append(statistics.median(samples) / 1000)
        for name, fn in (("plain", plain), ("traced", traced), ("fallback", fallback)):
            samples = []
            for i in range(steps):
                results[0].accept_lens = results[1].accept_lens = accepts[i % 64]
                t0 = time.perf_counter_ns()
                fn()
                samples.append(time.perf_counter_ns() - t0)
                if i % 8 == 7:
                    if cuda:
                        torch.cuda.synchronize()
                    take_steps(st)
            if r:
                medians[name].append(statistics.median(samples) / 1000)
    assert st.enabled, st.disabled_reason
    out = {"N": n, "batch": bs,
           "unhooked_us": statistics.median(medians["plain"]),
           "hooked_us": statistics.median(medians["traced"]),
           "fallback_us": statistics.median(medians["fallback"]),
           "decode_hook_us": statistics.median(medians["decode"]),
           "resolve_hook_us": statistics.median(medians["resolve"]),
           "rounds_hooked_us": medians["traced"]}
    out["hs_tracer_us"] = out["hooked_us"] - out["unhooked_us"]
    out["hs_tracer_fallback_us"] = out["fallback_us"] - out["unhooked_us"]
    probe = st.steps.decode.probe
    if cuda:
        launcher, ring = probe.launcher, probe._ring
        torch.cuda.synchronize()
        # every launch noted on the host ran on the device (the kernel counts its runs)
        res = probe._ig_ring
        out.update(launch=launch, graph_replays=launcher.replays, direct_launches=launcher.direct,
                   graphs=launcher.graphs, ring_noted=ring.launched, ring_ran=int(ring.seq.item()) >> 32,
                   in_graph_noted=res.launched, in_graph_ran=int(res.seq.item()),
                   in_graph_fault=probe.in_graph_fault,
                   graph_launch_way=sorted({g.way for g in launcher._graphs.values()}))
    return out


def busy(iterations: int) -> int:
    """The scheduler's own Python: a fixed amount of work (not a deadline, which would hide the time
    another thread holds the GIL in the middle of it)."""
    x = 0
    for i in range(iterations):
        x += i
    return x


def busy_iterations(us: float) -> int:
    """Iterations of :func:`busy` that take ``us`` on this machine, no other thread running."""
    n = 10_000
    times = []
    for _ in range(21):
        t0 = time.perf_counter()
        busy(n)
        times.append(time.perf_counter() - t0)
    return max(1, round(us * 1e-6 / statistics.median(times) * n))


def bench_loop(st: state.TracerState, n: int, device: torch.device, steps: int, blocks: int,
               python_us: float, gpu_us: float, launch: str) -> dict:
    from hs_tracer.core.recorder import Recorder

    running, snapshot, results = step_inputs(n, device)
    target_plain, target_traced = target_graph(st, results, launch)
    bs = len(running.reqs)
    cuda = device.type == "cuda"
    done = torch.cuda.Event() if cuda else None
    cycles = int(gpu_us * 1.98e3)  # ~1.98 GHz SM clock under load
    accepts = [torch.randint(1, DRAFT_TOKENS + 1, (bs,), dtype=torch.int32) for _ in range(64)]
    work = busy_iterations(python_us)

    def run(count: int, traced: bool) -> float:
        """SGLang's overlap order (module docstring): launch step i, enqueue its GPU work, resolve
        step i - 1 and run the scheduler's Python while the GPU works, then wait for step i."""
        decode = TRACED_DECODE if traced else draft_extend_for_decode
        resolve = TRACED_RESOLVE if traced else resolve_spec_v2_tokens
        target = target_traced if traced else target_plain
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(count):
            target()
            decode(None, running, results[i % 2])
            if cuda:
                torch.cuda._sleep(cycles)
                done.record()
            previous = results[(i - 1) % 2]
            previous.accept_lens = accepts[i % 64]
            resolve(PROCESSOR, previous, snapshot)
            busy(work)
            if cuda:
                done.synchronize()
            else:
                time.sleep(gpu_us * 1e-6)
        return (time.perf_counter() - t0) / count * 1e6

    run(20, True)
    run(20, False)
    take_steps(st)
    recorder = Recorder(st)  # one for all blocks, as in serving; idle in the off blocks
    st.recorder = recorder
    recorder.start()
    while recorder.export is None and recorder.analysis is None and recorder.is_alive():
        time.sleep(0.001)  # set-up (exporters, server, export process) is not per step
    wait_idle(recorder)
    clock = time.pthread_getcpuclockid(recorder.ident)
    parts = time_recorder_parts(recorder)
    off, on = [], []
    e0, c0 = process_cpu_s(recorder), time.clock_gettime(clock)
    for _ in range(blocks):
        off.append(run(steps, False))
        on.append(run(steps, True))
    time.sleep(0.6)  # the last hand-off of the on steps
    recorder_cpu = time.clock_gettime(clock) - c0  # all blocks: the off blocks see the on steps' hand-offs
    export_cpu = process_cpu_s(recorder) - e0
    recorder.stop()
    recorder.join(timeout=10)
    steps_seen = windows = 0
    if recorder.analysis is not None:
        steps_seen, windows = recorder.analysis.acceptance.steps, recorder.analysis.window_reports
        spans = recorder.analysis._otel is not None
    else:
        spans = bool(os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))
    assert st.enabled, st.disabled_reason
    lost = [b - a for a, b in zip(off, on, strict=True)]
    quartiles = statistics.quantiles(lost, n=4)
    return {"N": n, "batch": bs, "launch": launch, "steps_per_block": steps, "blocks": blocks,
            "python_us": python_us, "gpu_us": gpu_us,
            "step_us_off": statistics.median(off), "step_us_on": statistics.median(on),
            "lost_us_per_step": statistics.median(lost), "lost_us_mean": statistics.fmean(lost),
            "lost_us_quartiles": [quartiles[0], quartiles[2]], "lost_us_blocks": lost,
            "recorder_cpu_us_per_step": recorder_cpu / (blocks * steps) * 1e6,
            "recorder_cpu_parts_us_per_step": {k: v / (blocks * steps) * 1e6 for k, v in parts.items()},
            "export": st.config.export,
            "export_process_cpu_us_per_step": (export_cpu / (blocks * steps) * 1e6
                                               if recorder.export is not None else None),
            "recorded_request_steps": steps_seen if recorder.analysis is not None else None,
            "windows": windows if recorder.analysis is not None else None,
            "spans": spans, "steps_dropped": st.dropped}


def take_steps(st: state.TracerState) -> None:
    """What the recorder takes off the step path (also for revisions before the step log, so one
    copy of this script measures either side by side)."""
    if hasattr(st.steps, "take_batch"):
        st.steps.take_batch()
    else:
        st.steps.take_pending()
        st.steps.take_digests()


def time_recorder_parts(recorder: object) -> dict[str, float]:
    """Thread CPU seconds the recorder spends folding windows, building step batches and writing
    to the export process, summed as it runs (wrappers around those three calls; the rest of its
    CPU is wake-ups and bookkeeping)."""
    parts = {"windows": 0.0, "batches": 0.0, "writes": 0.0}
    steps, export = recorder.st.steps, getattr(recorder, "export", None)
    if not hasattr(steps, "take_batch"):  # revisions before the step log: the total only
        return {}

    def timed(name: str, fn):
        def call(*args, **kwargs):
            t0 = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                parts[name] += time.thread_time() - t0
        return call

    probe = recorder._probe() if hasattr(recorder, "_probe") else None
    if probe is not None and hasattr(probe, "landed_windows"):  # windows sent unmerged
        probe.landed_windows = timed("windows", probe.landed_windows)
    else:
        recorder._read_window = timed("windows", recorder._read_window)
    steps.take_batch = timed("batches", steps.take_batch)
    if export is not None:
        export.flush = timed("writes", export.flush)
    return parts


def wait_idle(recorder: object, timeout_s: float = 30.0) -> None:
    """Until the export process (if any) stops using CPU: its start-up (imports, exporters) is not
    per step."""
    if getattr(recorder, "export", None) is None:
        return
    deadline, last = time.monotonic() + timeout_s, -1.0
    while time.monotonic() < deadline and process_cpu_s(recorder) != last:
        last = process_cpu_s(recorder)
        time.sleep(0.5)


def process_cpu_s(recorder: object) -> float:
    """CPU seconds the recorder's export process has used so far (0 without one). /proc counts in
    clock ticks (10 ms): only sums over many steps mean anything."""
    export = getattr(recorder, "export", None)
    if export is None:
        return 0.0
    fields = Path(f"/proc/{export.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def markdown(res: dict) -> str:
    m = res["machine"]
    thread = res["args"].get("export", "thread") == "thread"
    where = "the recorder thread" if thread else "the export process"
    lines = [f"# hs_tracer: scheduler-thread cost per decode step ({m['date_utc']})", "",
             f"Machine: {m['host']}, {m['cpu']} ({m['cores']} cores), {m['gpu']}; Python {m['python']}, "
             f"torch {m['torch']}; switch interval {res['switch_interval_s'] * 1e3:g} ms. "
             f"Method: benchmarks/hook_overhead.py docstring (exporters: {res['exporters']}; they run in "
             f"{where}). Probe launch: {res['args'].get('launch', 'replay')}. Target: <= 10 µs per "
             "step at every N.", "",
             "Headline: what hs_tracer costs the scheduler thread per step, the hooks (hooked - unhooked, "
             "the target graph's replay in both) plus the recorder thread's CPU per step (it shares the "
             "scheduler's GIL). The loop columns measure the same as a scheduler loop's lost time "
             "(GPU work overlaps the scheduler's Python, as in SGLang's overlap scheduler); their "
             "spread shows how much the median of a few block pairs can be trusted.", "",
             "| N | batch | hooks + recorder µs/step | meets 10 µs | hooks alone µs (hooked - unhooked) "
             "| launch hook / result hook µs | recorder thread CPU µs/step | unhooked µs "
             "| step µs off | step µs on | lost µs/step (median of pairs) | mean, quartiles "
             "| export process CPU µs/step (10 ms ticks) "
             "| hooks alone, every request tested (fallback) µs |",
             "|---:|---:|---:|:---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    hooks_by_n = {r["N"]: r for r in res["hooks"]}
    nan = float("nan")
    for n in sorted({r["N"] for r in res["loop"]} | set(hooks_by_n)):
        r = next((row for row in res["loop"] if row["N"] == n), {})
        h = hooks_by_n.get(n, {})
        total = h.get("hs_tracer_us", nan) + r.get("recorder_cpu_us_per_step", nan)
        export_cpu = r.get("export_process_cpu_us_per_step")
        lines.append(f"| {n} | {r.get('batch', h.get('batch'))} | {total:.1f} | "
                     f"{('yes' if total <= 10 else 'NO') if r and h else '-'} | "
                     f"{h.get('hs_tracer_us', nan):.1f} | {h.get('decode_hook_us', nan):.1f} / "
                     f"{h.get('resolve_hook_us', nan):.1f} | {r.get('recorder_cpu_us_per_step', nan):.1f} | "
                     f"{h.get('unhooked_us', nan):.2f} | {r.get('step_us_off', nan):.1f} | "
                     f"{r.get('step_us_on', nan):.1f} | {r.get('lost_us_per_step', nan):.1f} | "
                     f"{r.get('lost_us_mean', nan):.1f}, {_span(r.get('lost_us_quartiles'))} | "
                     f"{'-' if export_cpu is None else f'{export_cpu:.0f}'} | "
                     f"{h.get('hs_tracer_fallback_us', nan):.1f} |")
    return "\n".join(lines) + "\n"


def _span(pair: list[float] | None) -> str:
    return "-" if not pair else f"{pair[0]:.0f} to {pair[1]:.0f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    ap.add_argument("--tag", default=None, help="file name part (default: gpu or cpu)")
    ap.add_argument("--ns", default=",".join(map(str, NS)))
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--loop-steps", type=int, default=1500)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--python-us", type=float, default=300.0)
    ap.add_argument("--gpu-us", type=float, default=100.0)
    ap.add_argument("--switch-interval", type=float, default=None, help="seconds (sys.setswitchinterval)")
    ap.add_argument("--profile", type=Path, default=None, help="HS_TRACER_PROFILE for the online diagnosis")
    ap.add_argument("--no-otel", action="store_true", help="no OpenTelemetry collector, no spans")
    ap.add_argument("--skip-hooks", action="store_true")
    ap.add_argument("--skip-loop", action="store_true")
    ap.add_argument("--export", choices=("process", "thread"), default=TracerConfig().export,
                    help="where the exporters run (HS_TRACER_EXPORT; default: its default)")
    ap.add_argument("--launch", choices=("in_graph", "replay"), default="in_graph",
                    help="CUDA: the probe's kernel recorded into the target's graph (HS_TRACER_IN_GRAPH's "
                         "default) or launched by the hook, a replay of its own graph")
    args = ap.parse_args()
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    collector = None
    if not args.no_otel:
        collector = subprocess.Popen([sys.executable, "-c", COLLECTOR], stdout=subprocess.PIPE, text=True)
        port = int(collector.stdout.readline())
        os.environ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] = f"http://127.0.0.1:{port}/v1/traces"
        os.environ.setdefault("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    try:
        device = torch.device(args.device)
        st = make_state(device, args.profile, args.export)
        ns = [int(v) for v in args.ns.split(",")]
        exporters = ["Prometheus"] + ([] if args.no_otel else ["OpenTelemetry spans"]) + (
            ["online diagnosis"] if args.profile else [])
        gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "none (CPU stand-in probe)"
        res: dict = {"machine": {
            "host": platform.node(), "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(), "gpu": gpu,
            "python": platform.python_version(), "torch": torch.__version__,
            "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")},
            "method": __doc__.strip(), "switch_interval_s": sys.getswitchinterval(),
            "exporters": ", ".join(exporters), "args": {k: str(v) for k, v in vars(args).items()},
            "hooks": [], "loop": []}
        if not args.skip_hooks:
            bench_hooks(st, ns[0], device, max(100, args.steps // 4), 1, args.launch)  # warm-up, not reported
            for n in ns:
                row = bench_hooks(st, n, device, args.steps, args.rounds, args.launch)
                res["hooks"].append(row)
                print(json.dumps(row), flush=True)
        for n in () if args.skip_loop else ns:
            row = bench_loop(st, n, device, args.loop_steps, args.blocks, args.python_us, args.gpu_us,
                             args.launch)
            res["loop"].append(row)
            print(json.dumps(row), flush=True)
    finally:
        if collector is not None:
            collector.kill()
    args.out.mkdir(parents=True, exist_ok=True)
    tag = args.tag or ("gpu" if device.type == "cuda" else "cpu")
    res["source"] = source_state(Path(__file__).resolve().parents[1])  # the commit measured
    (args.out / f"hook_overhead_{tag}.json").write_text(json.dumps(res, indent=2) + "\n")
    md = markdown(res)
    (args.out / f"hook_overhead_{tag}.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Decode-step throughput with the fingerprint probe vs without, in one run, on a GPU.

    PYTHONPATH=. python3 benchmarks/step_overhead_gpu.py --out DIR

The step mimics SGLang 0.5.23's EAGLE-3 decode on one GPU, at DeepSeek-V3 width (H=7168):
1. target verify: a CUDA graph of 4 decoder layers (RMSNorm, MLA-shaped projections q_a 7168->1536,
   q_b 1536->128x192, kv_a 7168->576, o 16384->7168 with the attention scores replaced by a cheap
   elementwise mix, dense MLP 7168->2x18432->7168), replayed; it writes the aux hidden states of 3
   layers, concatenated [N, 3*7168], into graph-private memory (as LogitsProcessor does);
2. the probe, where hs_tracer's BEFORE hook on EagleDraftWorker._draft_extend_for_decode applies it:
   ``probe.observe(aux, step)`` between the target replay and the draft-extend replay;
3. draft extend: copy aux into the draft graph's static buffer (EAGLEDraftExtendCudaGraphRunner
   does this), replay a graph of fc 21504->7168 plus one layer; its output feeds the next step;
4. results: a small async copy to pinned memory + event; the CPU waits for the previous step's event
   (one step behind, like the overlap scheduler), then ``probe.drain()`` (the AFTER hook).
Probe windows end every 32 steps. With and without the probe alternate in blocks (off, on, off,
on, ...); the ratio is the median over block pairs of steps/s on / steps/s off (robust to clock
drift between pairs; the ratio of the medians is recorded too). A real DeepSeek-V3 step runs 61
layers, so this 5-layer step makes the probe's share ~10x larger than in production: a conservative bound.
A separate pass runs the probe calls under torch.cuda.set_sync_debug_mode("error").
Writes step_overhead_gpu.json and .md under --out.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from provenance import source_state

from hs_tracer.fingerprint.probe import FingerprintProbe

H, K = 7168, 3
DEV = torch.device("cuda")
DT = torch.bfloat16


class Layer:
    """DeepSeek-V3-width decoder layer (dense MLP, MLA projection shapes), random weights."""

    def __init__(self, gen: torch.Generator) -> None:
        def w(o: int, i: int) -> torch.Tensor:
            return (torch.randn((o, i), device=DEV, generator=gen) * i**-0.5).to(DT)

        self.q_a, self.q_b = w(1536, H), w(128 * 192, 1536)
        self.kv_a, self.o = w(576, H), w(H, 128 * 128)
        self.gate_up, self.down = w(2 * 18432, H), w(H, 18432)

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        x = F.rms_norm(h, (H,))
        q = F.linear(F.linear(x, self.q_a), self.q_b)[:, : 128 * 128]
        kv = F.linear(x, self.kv_a)
        h = h + F.linear(q * torch.sigmoid(kv.mean(-1, keepdim=True)), self.o)
        g, u = F.linear(F.rms_norm(h, (H,)), self.gate_up).chunk(2, dim=-1)
        return h + F.linear(F.silu(g) * u, self.down)


def capture(fn, *args) -> tuple[torch.cuda.CUDAGraph, object]:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn(*args)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn(*args)
    return g, out


def bench_n(n: int, target: list[Layer], draft: Layer, fc: torch.Tensor, blocks: int, steps: int) -> dict:
    tgt_in = torch.randn((n, H), device=DEV).to(DT)
    draft_in = torch.zeros((n, K * H), device=DEV, dtype=DT)

    def target_fwd(h: torch.Tensor) -> torch.Tensor:
        aux = []
        for i, layer in enumerate(target):
            h = layer(h)
            if i in (0, 1, 3):
                aux.append(h)
        return torch.cat(aux, dim=-1)

    def draft_fwd(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = draft(F.linear(a, fc))
        return F.rms_norm(h, (H,)), h[:, :1024].argmax(-1)

    g_tgt, aux_out = capture(target_fwd, tgt_in)
    g_draft, (draft_h, draft_ids) = capture(draft_fwd, draft_in)
    probe = FingerprintProbe(K, H, DEV, ring_size=64, window_steps=32)
    ids_host = [torch.empty((n,), dtype=torch.int64, pin_memory=True) for _ in range(2)]
    done = [torch.cuda.Event() for _ in range(2)]
    step = [0]
    torch.cuda.synchronize()

    def hook(fn, *args) -> None:
        torch.cuda.set_sync_debug_mode("error")  # any sync inside the probe raises
        try:
            fn(*args)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    def run(count: int, with_probe: bool, debug_sync: bool = False) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(count):
            step[0] += 1
            g_tgt.replay()
            if with_probe:
                if debug_sync:
                    hook(probe.observe, aux_out, step[0])
                else:
                    probe.observe(aux_out, step[0])
            draft_in.copy_(aux_out)
            g_draft.replay()
            tgt_in.copy_(draft_h)
            ids_host[i % 2].copy_(draft_ids, non_blocking=True)
            done[i % 2].record()
            if i:
                done[(i - 1) % 2].synchronize()
            if with_probe:
                if debug_sync:
                    hook(probe.drain)
                else:
                    probe.drain()
        torch.cuda.synchronize()
        return count / (time.perf_counter() - t0)

    run(10, False)
    run(10, True)
    off, on = [], []
    for _ in range(blocks):
        off.append(run(steps, False))
        on.append(run(steps, True))
    run(steps, True, debug_sync=True)  # raises if observe/drain/end_window synchronise
    drained = probe.drain()
    window = probe.read_window(block=True)
    gpu_us = {}
    for name, flag in (("off", False), ("on", True)):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run(steps, flag)
        b.record()
        b.synchronize()
        gpu_us[name] = a.elapsed_time(b) * 1e3 / steps
    pairs = [a / b for a, b in zip(on, off, strict=True)]
    return {"N": n, "steps_per_block": steps, "blocks": blocks,
            "steps_per_s_off": statistics.median(off), "steps_per_s_on": statistics.median(on),
            "ratio": statistics.median(pairs),
            "ratio_of_medians": statistics.median(on) / statistics.median(off),
            "ratio_blocks": pairs,
            "step_us_off": 1e6 / statistics.median(off), "gpu_step_us_off": gpu_us["off"],
            "gpu_step_us_on": gpu_us["on"], "probe_dropped": probe.dropped, "probe_steps": probe.steps,
            "last_drain_len": len(drained), "window_read": window is not None,
            "graph_replays": probe.launcher.replays, "sync_debug_pass": True}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--ns", default="32,256,1024")
    ap.add_argument("--blocks", type=int, default=15)
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    import triton

    p = torch.cuda.get_device_properties(DEV)
    res = {"machine": {"gpu": p.name, "torch": torch.__version__, "triton": triton.__version__,
                       "host": platform.node(),
                       "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")},
           "step": "4 target layers (graph) + probe + fc and 1 draft layer (graph), H=7168, K=3, bf16",
           "rows": []}
    gen = torch.Generator(device=DEV)
    gen.manual_seed(int(time.time()))
    target = [Layer(gen) for _ in range(4)]
    draft = Layer(gen)
    fc = (torch.randn((H, K * H), device=DEV, generator=gen) * (K * H) ** -0.5).to(DT)
    for n in (int(v) for v in args.ns.split(",")):
        row = bench_n(n, target, draft, fc, args.blocks, args.steps)
        res["rows"].append(row)
        print(json.dumps(row), flush=True)
    m = res["machine"]
    lines = [f"# Decode-step overhead of the probe on {m['gpu']} ({m['date_utc']})", "",
             f"Step: {res['step']}. Method: benchmarks/step_overhead_gpu.py docstring. "
             f"torch {m['torch']}, triton {m['triton']}.", "",
             "| N | step µs (no probe) | steps/s off | steps/s on | ratio on/off (median of pairs) "
             "| ratio of medians | GPU µs/step off | GPU µs/step on |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in res["rows"]:
        lines.append(f"| {r['N']} | {r['step_us_off']:.0f} | {r['steps_per_s_off']:.1f} "
                     f"| {r['steps_per_s_on']:.1f} | {r['ratio']:.4f} | {r['ratio_of_medians']:.4f} "
                     f"| {r['gpu_step_us_off']:.0f} "
                     f"| {r['gpu_step_us_on']:.0f} |")
    md = "\n".join(lines) + "\n"
    res["source"] = source_state(Path(__file__).resolve().parents[1])  # the commit measured
    (args.out / "step_overhead_gpu.json").write_text(json.dumps(res, indent=2))
    (args.out / "step_overhead_gpu.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())

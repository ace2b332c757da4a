"""The per-step fingerprint kernel against its floor, at the row counts of the production-width
benchmark's batch sizes, as it runs in serving: the masked launch recorded into a CUDA graph,
partial sums into the probe's pinned in-graph ring.

    PYTHONPATH=.:benchmarks python3 benchmarks/kernel_floor_gpu.py --out FILE.json

Shape: x [N, K*H] bf16, K=3, H=7168 (DeepSeek-V3), N = batch x 4 (the chain's verify rows) for
batch 1, 8, 32, 128. Per N (every time a median of three medians of graph replays over rotating
random inputs, ``fingerprint_gpu.time_graph``):

* ``kernel_gpu_us``: the masked launch into a real probe's in-graph ring (pinned host memory),
  what SGLang's target-verify graph replays each step;
* ``kernel_device_digest_us``: the same launch into a one-row ring in device memory: how much of
  the time the host-visible ring costs;
* ``kernel_floor_us``: the fastest one-launch *read* of the same bytes found here: plain Triton
  kernels that load every value of x once and store one float per program, over the grids of
  ``READ_SHAPES`` (row chunks of 1024 columns, as the kernel used to launch, and one program per
  column block over all rows, as it does now). No kernel that reads x once in one launch can beat
  the fastest of them by much: this is the card's read bandwidth measured at the size read,
  launch and memory latency included. ``read_floor_us_by_shape`` lists each;
* beside it, ``kernel_bytes_floor_us`` = bytes of x / the card's copy bandwidth (a 1 GiB
  device-to-device copy, bytes read + written over its median time) and ``launch_floor_us``, an
  empty kernel's graph node: the two parts no read can avoid;
* ``within_2x``: ``kernel_gpu_us`` <= 2 x ``kernel_floor_us``;
* reference check: the masked launch's digest (the host's sum of the ring row) for a fresh random
  input against ``fingerprint_reference`` in float64 (relative error of the sums, exact counts).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np
import torch
import triton
import triton.language as tl
from fingerprint_gpu import DEV, H, K, copy_bandwidth, inputs, machine, time_graph
from provenance import source_state

from hs_tracer.fingerprint.kernel import DEFAULT_TIERS, FingerprintWorkspace, RingTarget, fingerprint_fused
from hs_tracer.fingerprint.probe import FingerprintProbe
from hs_tracer.fingerprint.reference import fingerprint_reference
from hs_tracer.fingerprint.ring import DigestRing

ROWS_PER_REQUEST = 4  # the chain's verify rows per request (3 draft tokens + 1)
BATCHES = (1, 8, 32, 128)
# read kernels: (columns per program, rows per loop step, warps, row chunks per column block or 0:
# enough chunks for about two programs per multiprocessor)
READ_SHAPES = ((1024, 8, 4, 0), (32, 4, 1, 1), (32, 8, 1, 1), (64, 16, 2, 1), (64, 64, 4, 1))
ROOT = Path(__file__).resolve().parents[1]


@triton.jit
def _empty(x_ptr):
    pass


@triton.jit
def _read(x_ptr, out_ptr, stride_row, n_rows, rows_per_chunk, chunks, col_blocks, hidden,
          BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr):
    """Every value of this program's rows and columns loaded once, one float stored."""
    pid = tl.program_id(0)
    chunk = pid % chunks
    rest = pid // chunks
    slot = rest // col_blocks
    cols = (rest % col_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_ptr = x_ptr + (slot * hidden + cols).to(tl.int64)
    start = chunk * rows_per_chunk
    end = tl.minimum(start + rows_per_chunk, n_rows)
    acc = tl.zeros([BLOCK_N, BLOCK_H], dtype=tl.float32)
    for r0 in range(start, end, BLOCK_N):
        rows = r0 + tl.arange(0, BLOCK_N)
        m = (rows < end)[:, None] & (cols < hidden)[None, :]
        ptrs = col_ptr[None, :] + rows.to(tl.int64)[:, None] * stride_row
        acc += tl.load(ptrs, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(tl.sum(acc, axis=0), axis=0))


def median3(fn, nbuf: int) -> float:
    return statistics.median(time_graph(fn, nbuf) for _ in range(3))


def read_floor(xs: list[torch.Tensor], n: int) -> dict[str, float]:
    """Each read shape's time over the same inputs (microseconds)."""
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    out = torch.zeros(1 << 16, device=DEV)
    times = {}
    for bh, bn, warps, chunks in READ_SHAPES:
        col_blocks = triton.cdiv(H, bh)
        if not chunks:
            chunks = max(1, min(triton.cdiv(n, bn), triton.cdiv(2 * sms, K * col_blocks), 64))
        per = triton.cdiv(triton.cdiv(n, chunks), bn) * bn
        chunks = triton.cdiv(n, per)
        grid = (K * col_blocks * chunks,)
        times[f"{bh}x{bn}/{warps}w/{chunks}c"] = round(median3(
            lambda i, g=grid, p=per, c=chunks, cb=col_blocks, b=(bn, bh, warps): _read[g](
                xs[i], out, xs[i].stride(0), n, p, c, cb, H, b[0], b[1], num_warps=b[2]), len(xs)), 3)
    return times


def reference_error(n: int) -> dict[str, float]:
    """Max relative error of the masked launch's digest against float64, fresh random input."""
    x = (torch.randn((n, K * H), device=DEV) * torch.rand((1, K * H), device=DEV) * 3).to(torch.bfloat16)
    ws = FingerprintWorkspace(K, H, DEV)
    valid = torch.arange(1, n + 1, dtype=torch.int64, device=DEV)
    enable = torch.ones(1, dtype=torch.int32, device=DEV)
    ring = DigestRing(K, H, 2, DEV, pinned=True, programs=ws.programs)
    ring.note(0, n)
    fingerprint_fused(x, ws, ring=RingTarget(ring.records, ring.seq), valid=valid, enable=enable)
    torch.cuda.synchronize()
    ref = fingerprint_reference(x, K, H, compute_dtype=torch.float64).cpu().numpy()
    [(_step, _tokens, raw)] = ring.drain()
    got = raw.astype(np.float64)
    rel = float((np.abs(got[:, 1:4] - ref[:, 1:4]) / np.maximum(np.abs(ref[:, 1:4]), 1e-30)).max())
    return {"max_rel_error": rel, "counts_equal": bool(np.array_equal(got[:, 0], ref[:, 0]))}


def bench(n: int, bw: float, l2: int, floor_launch: float) -> dict:
    xs = inputs(n, l2)
    probe = FingerprintProbe(K, H, DEV, ring_size=64)
    valid = torch.arange(1, n + 1, dtype=torch.int64, device=DEV)  # every row real: the most it reads
    device_ws = FingerprintWorkspace(K, H, DEV)
    enable = torch.ones(1, dtype=torch.int32, device=DEV)

    def in_graph(i: int) -> None:  # as StepProbe records it into SGLang's graphs
        fingerprint_fused(xs[i], probe._ig_ws, ring=probe._ig_target, valid=valid, enable=probe._ig_on)

    def device_digest(i: int) -> None:
        fingerprint_fused(xs[i], device_ws, valid=valid, enable=enable)

    nbytes = n * K * H * 2
    gpu = median3(in_graph, len(xs))
    reads = read_floor(xs, n)
    floor = min(reads.values())
    device = median3(device_digest, len(xs))
    return {"rows": n, "bytes": nbytes, "buffers": len(xs), "tier": str(device_ws.config(n)),
            "kernel_gpu_us": round(gpu, 3), "kernel_device_digest_us": round(device, 3),
            "kernel_floor_us": floor, "read_floor_us_by_shape": reads,
            "kernel_bytes_floor_us": round(nbytes / bw * 1e6, 3), "launch_floor_us": round(floor_launch, 3),
            "over_floor": round(gpu / floor, 2), "within_2x": gpu <= 2 * floor,
            "reference": reference_error(n)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("kernel_floor_gpu: needs a CUDA GPU", file=sys.stderr)
        return 2
    bw = copy_bandwidth()
    l2 = torch.cuda.get_device_properties(DEV).L2_cache_size
    dummy = torch.zeros(1, device=DEV)
    floor_launch = median3(lambda _i: _empty[(1,)](dummy), 1)
    rows = {str(bs): bench(bs * ROWS_PER_REQUEST, bw, l2, floor_launch) for bs in BATCHES}
    res = {"what": "per-step fingerprint kernel vs its floor (masked in-graph launch, pinned ring)",
           "source": source_state(ROOT), "machine": machine(), "copy_bandwidth_gb_s": round(bw / 1e9, 1),
           "tiers": [[most, str(cfg)] for most, cfg in DEFAULT_TIERS],
           "method": __doc__.split("\n\n", 2)[2].strip(), "by_batch": rows}
    args.out.write_text(json.dumps(res, indent=1) + "\n")
    print(f"{'batch':>5} {'rows':>5} {'gpu us':>8} {'dev-ring us':>11} {'floor us':>9} {'x floor':>7} ref")
    for bs, r in rows.items():
        print(f"{bs:>5} {r['rows']:>5} {r['kernel_gpu_us']:>8} {r['kernel_device_digest_us']:>11} "
              f"{r['kernel_floor_us']:>9} {r['over_floor']:>7} {r['reference']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

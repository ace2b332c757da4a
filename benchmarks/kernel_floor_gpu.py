"""The per-step fingerprint kernel against its floor, at the row counts of the production-width
benchmark's batch sizes, as it runs in serving: the masked launch recorded into a CUDA graph,
digest into the probe's pinned in-graph ring.

    PYTHONPATH=.:benchmarks python3 benchmarks/kernel_floor_gpu.py --out FILE.json

Shape: x [N, K*H] bf16, K=3, H=7168 (DeepSeek-V3), N = batch x 4 (the chain's verify rows) for
batch 1, 8, 32, 128. Per N (every time a median of graph replays over rotating random inputs,
``fingerprint_gpu.time_graph``):

* ``kernel_gpu_us``: the masked launch into a real probe's in-graph ring (pinned host memory, the
  system-scope fence before the stamp), what SGLang's target-verify graph replays each step;
* ``kernel_device_digest_us``: the same launch with its digest in device memory (no host write, no
  system-scope fence): how much of the time the host-visible digest costs;
* ``kernel_bytes_floor_us`` = bytes of x / the card's copy bandwidth (a 1 GiB device-to-device
  copy, bytes read + written over its median time);
* ``launch_floor_us``: an empty Triton kernel (one program) per graph node: what any kernel costs;
* ``kernel_floor_us`` = bytes floor + launch floor: no single-launch kernel that reads x once can
  take less; ``within_2x`` compares ``kernel_gpu_us`` with twice it;
* reference check: the masked launch's digest for a fresh random input against
  ``fingerprint_reference`` in float64 (relative error of the sums, exact counts).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import triton
from fingerprint_gpu import DEV, H, K, copy_bandwidth, inputs, machine, time_graph
from provenance import source_state

from hs_tracer.fingerprint.kernel import FingerprintWorkspace, RingTarget, fingerprint_fused
from hs_tracer.fingerprint.probe import FingerprintProbe
from hs_tracer.fingerprint.reference import fingerprint_reference
from hs_tracer.fingerprint.ring import DigestRing

ROWS_PER_REQUEST = 4  # the chain's verify rows per request (3 draft tokens + 1)
BATCHES = (1, 8, 32, 128)
ROOT = Path(__file__).resolve().parents[1]


@triton.jit
def _empty(x_ptr):
    pass


def launch_floor_us() -> float:
    dummy = torch.zeros(1, device=DEV)
    return time_graph(lambda _i: _empty[(1,)](dummy), 1)


def reference_error(n: int) -> dict[str, float]:
    """Max relative error of the masked launch's digest against float64, fresh random input."""
    x = (torch.randn((n, K * H), device=DEV) * torch.rand((1, K * H), device=DEV) * 3).to(torch.bfloat16)
    ws = FingerprintWorkspace(K, H, DEV)
    valid = torch.arange(1, n + 1, dtype=torch.int64, device=DEV)
    enable = torch.ones(1, dtype=torch.int32, device=DEV)
    ring = DigestRing(K, 2, DEV, pinned=True)
    ring.digests.fill_(float("nan"))  # poisoned: every value must be written
    fingerprint_fused(x, ws, ring=RingTarget(ring.digests, ring.stamps, ring.seq), valid=valid, enable=enable)
    torch.cuda.synchronize()
    ref = fingerprint_reference(x, K, H, compute_dtype=torch.float64).cpu()
    got = ring.digests[1, :K * 5].reshape(K, 5).double()  # launch 1 fills row 1
    rel = ((got[:, 1:4] - ref[:, 1:4]).abs() / ref[:, 1:4].abs().clamp_min(1e-30)).max().item()
    return {"max_rel_error": rel, "counts_equal": bool(torch.equal(got[:, 0], ref[:, 0])),
            "all_written": bool(torch.isfinite(got).all())}


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
    gpu = statistics.median(time_graph(in_graph, len(xs)) for _ in range(3))
    bytes_floor = nbytes / bw * 1e6
    floor = bytes_floor + floor_launch
    return {"rows": n, "bytes": nbytes, "buffers": len(xs),
            "kernel_gpu_us": round(gpu, 3),
            "kernel_device_digest_us": round(time_graph(device_digest, len(xs)), 3),
            "kernel_bytes_floor_us": round(bytes_floor, 3), "launch_floor_us": round(floor_launch, 3),
            "kernel_floor_us": round(floor, 3), "over_floor": round(gpu / floor, 2),
            "within_2x": gpu <= 2 * floor, "reference": reference_error(n)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("kernel_floor_gpu: needs a CUDA GPU", file=sys.stderr)
        return 2
    bw = copy_bandwidth()
    l2 = torch.cuda.get_device_properties(DEV).L2_cache_size
    floor_launch = launch_floor_us()
    rows = {str(bs): bench(bs * ROWS_PER_REQUEST, bw, l2, floor_launch) for bs in BATCHES}
    res = {"what": "per-step fingerprint kernel vs its floor (masked in-graph launch, pinned ring)",
           "source": source_state(ROOT), "machine": machine(), "copy_bandwidth_gb_s": round(bw / 1e9, 1),
           "method": __doc__.split("\n\n", 2)[2].strip(), "by_batch": rows}
    args.out.write_text(json.dumps(res, indent=1) + "\n")
    print(f"{'batch':>5} {'rows':>5} {'gpu us':>8} {'dev-digest us':>13} {'floor us':>9} {'x floor':>7} ref")
    for bs, r in rows.items():
        print(f"{bs:>5} {r['rows']:>5} {r['kernel_gpu_us']:>8} {r['kernel_device_digest_us']:>13} "
              f"{r['kernel_floor_us']:>9} {r['over_floor']:>7} {r['reference']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

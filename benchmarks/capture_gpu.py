"""CUDA check and host cost of the capture sink's scheduler-thread path (``CaptureSink.offer_prefill``).

Checks, on a real GPU:
* no host-device synchronisation: ``torch.cuda.set_sync_debug_mode("error")`` raises on any sync
  inside ``offer_prefill`` (sampled and unsampled steps);
* the copy is stream-ordered: the source buffer is overwritten by the next kernel right after the
  offer (as the next CUDA-graph replay does) and the shard still holds the old values;
* the recorder side writes only after the event completed (``poll`` never blocks).
Measures the host time of ``offer_prefill`` (median over steps) at DeepSeek-V3 / Kimi-K2.5 width.

Usage: ``python benchmarks/capture_gpu.py --out results.json`` (needs CUDA).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

from provenance import source_state


def main() -> None:
    import numpy as np
    import torch

    from hs_tracer.export.capture import CaptureSink
    from hs_tracer.profile.capture_format import iter_shards, read_manifest
    from hs_tracer.records import WiringRecord

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    assert torch.cuda.is_available(), "needs CUDA"
    k, h, n = 3, 7168, args.tokens
    wiring = WiringRecord(model="kimi-k2.5-shape", target_arch="DeepseekV3ForCausalLM", num_layers=61,
                          hidden_size=h, layers_to_capture=[2, 30, 58],
                          sources=["block:1", "block:29", "block:57"])
    dev = torch.device("cuda")
    feats = torch.randn(n, k * h, device=dev, dtype=torch.bfloat16)
    ids = torch.randint(0, 160000, (n,), device=dev)
    nxt = torch.randint(0, 160000, (4,), device=dev)
    lens = [n // 4] * 4
    results: dict = {"machine": torch.cuda.get_device_name(0), "torch": torch.__version__,
                     "python": platform.python_version(), "date": time.strftime("%Y-%m-%d"),
                     "shape": [n, k * h], "dtype": "bfloat16"}
    with tempfile.TemporaryDirectory() as tmp:
        # 1. correctness under buffer reuse, no sync
        sink = CaptureSink(Path(tmp) / "a", wiring, rate=1.0, max_bytes=1 << 30)
        expected = feats.float().cpu().numpy()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        sink.offer_prefill(feats, ids, nxt, [0] * 4, lens)
        feats.mul_(0)  # the next "replay" overwrites the buffer on the same stream
        torch.cuda.set_sync_debug_mode("default")
        while not sink.pending[0].ready():  # what the recorder does: poll, never synchronize
            time.sleep(0.001)
        sink.poll()
        ((_name, shard),) = list(iter_shards(sink.path, read_manifest(sink.path)))
        results["copy_survives_buffer_reuse"] = bool(np.array_equal(shard.features, expected))
        feats.copy_(torch.randn_like(feats))

        # 2. host cost per step, sampled (rate 1) and unsampled (rate 0.01: 99 of 100 steps)
        for rate in (1.0, 0.01):
            sink = CaptureSink(Path(tmp) / f"r{rate}", wiring, rate=rate, max_bytes=1 << 34)
            times = []
            torch.cuda.set_sync_debug_mode("error")
            for _ in range(args.steps):
                t0 = time.perf_counter()
                sink.offer_prefill(feats, ids, nxt, [0] * 4, lens)
                times.append(time.perf_counter() - t0)
                torch.cuda.set_sync_debug_mode("default")
                sink.poll()  # keep the pending queue drained, as the recorder thread does
                torch.cuda.set_sync_debug_mode("error")
            torch.cuda.set_sync_debug_mode("default")
            torch.cuda.synchronize()
            sink.flush()
            results[f"offer_prefill_host_us_rate_{rate}"] = {
                "median": statistics.median(times) * 1e6, "p90": sorted(times)[int(0.9 * len(times))] * 1e6,
                "steps": len(times), "written": sink.written, "dropped": sink.dropped}
        results["no_sync"] = True  # set_sync_debug_mode("error") would have raised
    results["method"] = ("host wall time around offer_prefill on the scheduler-side thread; sync debug mode "
                         "'error' on during the offers; poll() between steps like the recorder")
    results["source"] = source_state(Path(__file__).resolve().parents[1])  # the commit measured
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

"""GPU check of how the recorder hands diagnosis windows to the export process (CI has no GPU; run on
one, keep the output): ``FingerprintProbe.landed_windows`` / ``release_windows``.

    PYTHONPATH=. python3 benchmarks/gpu_check_window_handoff.py

Closes 3 x 8 windows of random bf16 inputs on a CUDA probe (8 snapshot slots), reads each landed
window's sums from its pinned slot and compares them with the inputs' (count exact; sum and sum of
squares within 1e-4 relative or 1e-2 absolute), keeps one slot handed out and unreleased from
round 2 on (it must never be handed out again), releases the others (they must be reused). Prints
``WINCHECK PASS`` and the slots each round got (benchmarks/results/window_handoff_check_h200_*.log).
"""
import json

import numpy as np
import torch

from hs_tracer.fingerprint.probe import _WINDOW_SLOTS, FingerprintProbe

K, H, N = 3, 256, 32
p = FingerprintProbe(K, H, "cuda", ring_size=64)
out = {"rounds": [], "slots": _WINDOW_SLOTS}
torch.manual_seed(0)
held = None
for r in range(3 * _WINDOW_SLOTS):
    xs = [torch.randn(N, K * H, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    for x in xs:
        assert p.observe(x, r + 1)
    p.end_window()
    torch.cuda.synchronize()
    landed = p.landed_windows()
    ref = torch.cat(xs).double().reshape(-1, K, H).cpu().numpy()
    if r == 2:  # keep one slot held across the next rounds: it must never come back or be folded
        held = landed
        assert len(landed) == 1
        continue
    got = [w for s, w in landed]
    assert held is None or all(s != held[0][0] for s, _ in landed), "held slot handed out twice"
    w = got[-1]
    ok = (np.all(w.count == ref.shape[0]) and np.allclose(w.sum, ref.sum(0), rtol=1e-4, atol=1e-2)
          and np.allclose(w.sumsq, (ref ** 2).sum(0), rtol=1e-4, atol=1e-2))
    out["rounds"].append({"round": r, "landed": [s for s, _ in landed], "ok": bool(ok)})
    assert ok, r
    p.release_windows([s for s, _ in landed])
p.release_windows([held[0][0]])
out["skips"] = p.window_skips
out["snapshot_graphs"] = p._win_snapshots is not None
print("WINCHECK PASS" if all(x["ok"] for x in out["rounds"]) else "WINCHECK FAIL", json.dumps(out))

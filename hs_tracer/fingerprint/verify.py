"""Float64 numpy ground truth for fingerprints and the stated tolerances (tests and GPU checks).

Input dtypes bf16/fp16/fp32 upcast to float32 exactly, so the only error in a fingerprint is the
rounding of its sums. The bounds therefore depend on the dtype the sums are computed in, and are the
same for every input dtype:

* counts, non-finite counts and absmax: exact;
* sums: ``|sum - ref| <= rtol * sum(|x|)`` (relative to the magnitude summed, since the mean of
  centred data is near zero);
* sums of squares: ``|sumsq - ref| <= rtol * ref``;

per slot for the step digest and per channel for the window sums, with ``rtol`` from
:data:`RTOL` by compute dtype.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from hs_tracer.fingerprint.stats import DIGEST_WIDTH, ChannelStats

# float32: sequential adds over <= a few hundred row blocks, then tree reductions; the worst case
# is ~ (blocks + log2 terms) * 2**-24, the typical case ~100x smaller.
RTOL = {"float32": 2e-5, "float64": 1e-12}


def fingerprint_float64(x: np.ndarray, num_slots: int,
                        hidden: int) -> tuple[np.ndarray, ChannelStats, np.ndarray]:
    """Ground truth for ``x [N, K*H]``: raw digest ``[K, 5]``, per-channel stats, and per-channel
    sum of ``|x|`` over finite values (the scale the sum tolerance is relative to)."""
    v = np.asarray(x, dtype=np.float64).reshape(-1, num_slots, hidden)
    ok = np.isfinite(v)
    vf = np.where(ok, v, 0.0)
    count = ok.sum(0).astype(np.float64)
    col_sum = vf.sum(0)
    col_sumsq = (vf * vf).sum(0)
    raw = np.zeros((num_slots, DIGEST_WIDTH))
    raw[:, 0] = count.sum(1)
    raw[:, 1] = col_sum.sum(1)
    raw[:, 2] = col_sumsq.sum(1)
    raw[:, 3] = np.abs(vf).max(axis=(0, 2)) if v.shape[0] else 0.0
    raw[:, 4] = v.shape[0] * hidden - raw[:, 0]
    return raw, ChannelStats(count, col_sum, col_sumsq), np.abs(vf).sum(0)


def digest_errors(raw: np.ndarray, ref: np.ndarray, abs_sum: np.ndarray) -> dict[str, float]:
    """Errors of a raw digest against :func:`fingerprint_float64`: exact fields as absolute
    differences, sums normalised as in the module docstring (compare with :data:`RTOL`)."""
    raw = np.asarray(raw, dtype=np.float64)
    slot_abs = abs_sum.sum(1)
    return {
        "count": float(np.abs(raw[:, 0] - ref[:, 0]).max()),
        "nonfinite": float(np.abs(raw[:, 4] - ref[:, 4]).max()),
        "absmax": float(np.abs(raw[:, 3] - ref[:, 3]).max()),
        "sum": float((np.abs(raw[:, 1] - ref[:, 1]) / np.maximum(slot_abs, 1e-30)).max()),
        "sumsq": float((np.abs(raw[:, 2] - ref[:, 2]) / np.maximum(ref[:, 2], 1e-30)).max()),
    }


def channel_errors(stats: ChannelStats, ref: ChannelStats, abs_sum: np.ndarray) -> dict[str, float]:
    """Per-channel errors of window stats against :func:`fingerprint_float64`, normalised likewise."""
    return {
        "count": float(np.abs(stats.count - ref.count).max()),
        "sum": float((np.abs(stats.sum - ref.sum) / np.maximum(abs_sum, 1e-30)).max()),
        "sumsq": float((np.abs(stats.sumsq - ref.sumsq) / np.maximum(ref.sumsq, 1e-30)).max()),
    }


def within_tolerance(errors: dict[str, float], rtol: float) -> bool:
    """Exact fields exactly, sums within ``rtol``; NaN never passes."""
    exact = ("count", "nonfinite", "absmax")
    return all((v == 0.0) if k in exact else (v <= rtol) for k, v in errors.items())


def fresh_seed() -> int:
    """A new seed per run, so checks see fresh data (``HS_TRACER_TEST_SEED`` pins one to reproduce)."""
    pinned = os.environ.get("HS_TRACER_TEST_SEED")
    return int(pinned) if pinned else int(np.random.SeedSequence().entropy % (2**32))


def random_draft_input(rng: np.random.Generator, n: int, num_slots: int, hidden: int, dtype: torch.dtype,
                       nonfinite: bool = True) -> torch.Tensor:
    """Hidden-state-like ``[n, K*H]`` rows on the CPU: per-slot offset and scale, a few
    massive-activation channels, and (optionally) a NaN row, an Inf slot row and scattered
    non-finite values."""
    v = rng.standard_normal((n, num_slots, hidden))
    v *= rng.uniform(0.1, 3.0, size=(1, num_slots, 1))
    v += rng.uniform(-1.0, 1.0, size=(1, num_slots, 1))
    heavy = rng.choice(hidden, size=max(1, hidden // 64), replace=False)
    v[:, :, heavy] *= 100.0
    if nonfinite and n >= 3:
        v[rng.integers(n)] = np.nan
        v[rng.integers(n), rng.integers(num_slots)] = np.inf
        k = max(1, v.size // 500)
        flat = v.reshape(-1)
        flat[rng.choice(flat.size, size=k, replace=False)] = rng.choice([np.nan, np.inf, -np.inf], size=k)
    elif nonfinite and n >= 1:
        v[0, 0, 0] = np.nan
        v[-1, -1, -1] = -np.inf
    return torch.from_numpy(v.reshape(n, num_slots * hidden)).to(dtype)

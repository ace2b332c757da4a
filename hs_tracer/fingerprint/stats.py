"""The fingerprint definition: what is measured per step and per window, and how it merges.

Per step and slot (a :class:`StepDigest`): token count, mean, RMS, absmax and the number of
non-finite values, all over the finite values only (a NaN row must not hide the other rows).

Per window and slot (a :class:`ChannelStats`): per-channel count, sum and sum of squares. These are
plain sums, so merging windows, ranks or profile shards is addition; means and variances are derived
at the end. Per-channel moments identify a layer far better than scalars (massive-activation channels
and the norm profile differ from layer to layer), which is what diagnosis relies on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# Column order of the per-slot step digest as the kernels write it: [K, DIGEST_WIDTH] fp32.
DIGEST_FIELDS = ("count", "sum", "sumsq", "absmax", "nonfinite")
DIGEST_WIDTH = len(DIGEST_FIELDS)


@dataclass(frozen=True)
class SlotDigest:
    """Scalars of one slot in one step, over its finite values."""

    count: int  # finite values seen (tokens x channels)
    mean: float
    rms: float
    absmax: float
    nonfinite: int


@dataclass(frozen=True)
class StepDigest:
    """Per-slot scalars of one step's draft input ``[N, K*H]``."""

    tokens: int
    slots: tuple[SlotDigest, ...]

    @classmethod
    def from_raw(cls, tokens: int, raw: np.ndarray) -> StepDigest:
        """Build from the kernels' ``[K, DIGEST_WIDTH]`` array of (count, sum, sumsq, absmax, nonfinite)."""
        slots = []
        for count, total, sumsq, absmax, nonfinite in np.asarray(raw, dtype=np.float64).tolist():
            n = max(count, 1.0)
            slots.append(SlotDigest(int(count), total / n, math.sqrt(sumsq / n), absmax, int(nonfinite)))
        return cls(tokens, tuple(slots))

    @classmethod
    def from_kernel(cls, tokens: int, raw: np.ndarray, hidden: int) -> StepDigest:
        """Build from the raw sums a probe drained for ``tokens`` rows of hidden size ``hidden``, the
        count made exact on the host (:func:`with_exact_count`)."""
        return cls.from_raw(tokens, with_exact_count(raw, tokens, hidden))

    def raw(self) -> np.ndarray:
        """The ``[K, DIGEST_WIDTH]`` float64 sums this digest came from (inverse of :meth:`from_raw`)."""
        return np.array([[s.count, s.mean * s.count, s.rms * s.rms * s.count, s.absmax, s.nonfinite]
                         for s in self.slots], dtype=np.float64).reshape(len(self.slots), DIGEST_WIDTH)

    def merge(self, other: StepDigest) -> StepDigest:
        """Digest of the union of both digests' rows (two shards of one batch, or two DP ranks)."""
        return StepDigest.from_raw(self.tokens + other.tokens, merge_digest_raw(self.raw(), other.raw()))


def with_exact_count(raw: np.ndarray, tokens: int, hidden: int) -> np.ndarray:
    """``raw`` with its count recomputed as ``tokens * H - nonfinite``, as the probe does: a float32
    count is exact only up to 2**24 values per slot (N*H exceeds that from N=2341 at H=7168), the
    non-finite count up to 2**24 non-finite values."""
    raw = np.array(raw, dtype=np.float64)
    raw[:, 0] = tokens * hidden - raw[:, 4]
    return raw


def merge_digest_raw(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Merge two ``[K, DIGEST_WIDTH]`` raw digests: counts and sums add, ``absmax`` takes the maximum."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.shape != b.shape or a.shape[-1] != DIGEST_WIDTH:
        raise ValueError(f"cannot merge raw digests of shape {a.shape} and {b.shape}; "
                         f"both must be [num_slots, {DIGEST_WIDTH}] ({', '.join(DIGEST_FIELDS)})")
    out = a + b
    absmax = DIGEST_FIELDS.index("absmax")
    out[:, absmax] = np.maximum(a[:, absmax], b[:, absmax])
    return out


@dataclass
class ChannelStats:
    """Per-slot, per-channel sums over a window: ``count``/``sum``/``sumsq`` are ``[K, H]`` float64.

    ``count`` is per channel because non-finite values are excluded value by value.
    Merge is elementwise addition (:meth:`merge`), exact up to float64 rounding.
    """

    count: np.ndarray
    sum: np.ndarray
    sumsq: np.ndarray

    @classmethod
    def zeros(cls, num_slots: int, hidden: int) -> ChannelStats:
        shape = (num_slots, hidden)
        return cls(np.zeros(shape), np.zeros(shape), np.zeros(shape))

    @property
    def num_slots(self) -> int:
        return self.sum.shape[0]

    @property
    def hidden(self) -> int:
        return self.sum.shape[1]

    def merge(self, other: ChannelStats) -> ChannelStats:
        self._check_shape(other)
        return ChannelStats(self.count + other.count, self.sum + other.sum, self.sumsq + other.sumsq)

    def add(self, other: ChannelStats) -> None:
        """:meth:`merge` in place. A DeepSeek-V3-wide window is three 170 KB arrays: allocating fresh
        ones at every fold costs page faults worth hundreds of µs on a GPU host."""
        self._check_shape(other)
        self.count += other.count
        self.sum += other.sum
        self.sumsq += other.sumsq

    def clear(self) -> None:
        """Zero the sums in place."""
        for a in (self.count, self.sum, self.sumsq):
            a.fill(0)

    def _check_shape(self, other: ChannelStats) -> None:
        if self.sum.shape != other.sum.shape:
            raise ValueError(f"cannot merge channel stats of shape {self.sum.shape} and {other.sum.shape}")

    def mean(self) -> np.ndarray:
        return self.sum / np.maximum(self.count, 1.0)

    def var(self) -> np.ndarray:
        m = self.mean()
        return np.maximum(self.sumsq / np.maximum(self.count, 1.0) - m * m, 0.0)

    def slot(self, k: int) -> ChannelStats:
        return ChannelStats(self.count[k : k + 1], self.sum[k : k + 1], self.sumsq[k : k + 1])

"""Streaming accumulation of per-channel statistics, plus a mergeable sample of calibration pieces.

Everything here is a sum, so shards add up to the single build exactly (up to float64 rounding):

* :class:`StatsAccumulator` - per-row (slot or candidate source) :class:`ChannelStats` over all tokens.
* :class:`PieceSample` - a deterministic "bottom-M by hash" sample of short token pieces (their own
  per-channel sums). Diagnosis pools pieces into windows the size of a live window to learn how far a
  *correct* window can stray from the reference (the calibration). Which pieces are kept depends only
  on each piece's key (source file, record, piece index), never on the order or the sharding, so the
  merge of shard samples equals the sample of the single build.
"""

from __future__ import annotations

import hashlib

import numpy as np

from hs_tracer.errors import InputError
from hs_tracer.fingerprint.stats import ChannelStats


def stable_hash(key: str) -> int:
    """64-bit hash of a piece key, identical on every machine and Python run (unlike ``hash``)."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") >> 1


_LANE_TOKENS = 4  # tokens added per step: [4, K, H] float32 lanes stay in cache (344 KB at 3 x 7168)
_FLUSH_TOKENS = 64  # float32 lanes are flushed into float64 at least this often


def channel_sums(x) -> tuple[np.ndarray, np.ndarray]:
    """Per-row, per-channel ``(sum, sumsq)`` in float64 over the tokens of ``[T, R, H]`` (numpy, or a torch
    tensor in any float dtype: a bf16 dump is converted a few tokens at a time, never as a whole).

    Tokens are added 4 at a time into float32 lanes with in-place ops (``add_``, ``addcmul_``), which
    are flushed into float64 every 64 tokens: at most 16 float32 additions per lane, a relative error
    below 1e-6 of the summed magnitudes (typically 1e-8), under the rounding of the bf16 values
    themselves (4e-3). On one core this is 5-8x faster than converting the whole record to float64 and
    reducing it; the build reads dumps at close to their load speed because of it.
    """
    import torch

    t = torch.from_numpy(x) if isinstance(x, np.ndarray) else x
    n, rows, hidden = t.shape
    lanes = torch.zeros((_LANE_TOKENS, rows, hidden), dtype=torch.float32)
    lanes_sq = torch.zeros_like(lanes)
    v = torch.empty_like(lanes)
    total = torch.zeros((rows, hidden), dtype=torch.float64)
    total_sq = torch.zeros_like(total)
    for flush in range(0, n, _FLUSH_TOKENS):
        for start in range(flush, min(flush + _FLUSH_TOKENS, n), _LANE_TOKENS):
            m = min(_LANE_TOKENS, n - start)
            if m == _LANE_TOKENS:
                v.copy_(t[start : start + m])
                lanes.add_(v)
                lanes_sq.addcmul_(v, v)
            else:
                v[:m].copy_(t[start : start + m])
                lanes[:m].add_(v[:m])
                lanes_sq[:m].addcmul_(v[:m], v[:m])
        total += lanes.sum(0, dtype=torch.float64)
        total_sq += lanes_sq.sum(0, dtype=torch.float64)
        lanes.zero_()
        lanes_sq.zero_()
    return total.numpy(), total_sq.numpy()


class StatsAccumulator:
    """Per-row, per-channel count/sum/sumsq of ``[T, R, H]`` arrays; non-finite values are excluded
    value by value (as the GPU probe does) and counted."""

    def __init__(self, rows: int, hidden: int) -> None:
        self.stats = ChannelStats.zeros(rows, hidden)
        self.nonfinite = 0
        self.tokens = 0

    def add(self, x) -> tuple[np.ndarray, np.ndarray] | None:
        """Add ``[T, R, H]`` (numpy or torch). Returns its float64 ``(sum, sumsq)`` when every value was
        finite (the calibration pieces reuse them), else None."""
        if x.ndim != 3 or tuple(x.shape[1:]) != self.stats.sum.shape:
            raise InputError(
                f"expected [T, {self.stats.num_slots}, {self.stats.hidden}], got {tuple(x.shape)}"
            )
        self.tokens += x.shape[0]
        s, sq = channel_sums(x)
        # a NaN or inf anywhere makes its channel's sums non-finite, so finite sums prove every value
        # finite (values whose squares overflow float32 take the exact path below as well)
        if np.isfinite(s).all() and np.isfinite(sq).all():
            self.stats.count += x.shape[0]
            self.stats.sum += s
            self.stats.sumsq += sq
            return s, sq
        a = x if isinstance(x, np.ndarray) else x.float().numpy()
        for start in range(0, a.shape[0], self.CHUNK):  # bounded float64 temporaries for wide targets
            self._add_masked(a[start : start + self.CHUNK])
        return None

    CHUNK = 256

    def _add_masked(self, x: np.ndarray) -> None:
        ok = np.isfinite(x)
        self.nonfinite += int(x.size - ok.sum())
        v = np.where(ok, x, 0.0).astype(np.float64)
        self.stats.count += ok.sum(0)
        self.stats.sum += v.sum(0)
        self.stats.sumsq += np.einsum("trh,trh->rh", v, v)


class PieceSample:
    """Up to ``max_pieces`` pieces of ``piece_tokens`` consecutive tokens, those with the smallest hash.

    Each kept piece stores its key hash, its token count and float32 per-channel sum/sumsq ``[K, H]``.
    Pieces holding a non-finite value are not sampled (the totals still count their finite values).
    Memory stays bounded: the buffer is pruned back to ``max_pieces`` whenever it doubles.
    """

    def __init__(self, num_slots: int, hidden: int, piece_tokens: int, max_pieces: int) -> None:
        if piece_tokens < 1 or max_pieces < 0:
            raise InputError("piece_tokens must be >= 1 and max_pieces >= 0")
        self.shape = (num_slots, hidden)
        self.piece_tokens = piece_tokens
        self.max_pieces = max_pieces
        self._keys: list[int] = []
        self._tokens: list[int] = []
        self._sum: list[np.ndarray] = []
        self._sumsq: list[np.ndarray] = []

    def offer(self, key: str, tokens: int, s: np.ndarray, sq: np.ndarray) -> None:
        """One piece with its float64 sums; kept while its key hash is among the smallest."""
        if self.max_pieces == 0 or tokens < max(1, self.piece_tokens // 2):
            return
        self._keys.append(stable_hash(key))
        self._tokens.append(tokens)
        self._sum.append(s.astype(np.float32))
        self._sumsq.append(sq.astype(np.float32))
        if len(self._keys) >= 2 * self.max_pieces:
            self._prune()

    def _prune(self) -> None:
        order = sorted(range(len(self._keys)), key=self._keys.__getitem__)[: self.max_pieces]
        self._keys = [self._keys[i] for i in order]
        self._tokens = [self._tokens[i] for i in order]
        self._sum = [self._sum[i] for i in order]
        self._sumsq = [self._sumsq[i] for i in order]

    def arrays(self) -> dict[str, np.ndarray]:
        """The kept pieces sorted by key: ``keys`` [M] int64, ``tokens`` [M], ``sum``/``sumsq`` [M, K, H]."""
        self._prune()
        m = len(self._keys)
        return {
            "keys": np.asarray(self._keys, dtype=np.int64).reshape(m),
            "tokens": np.asarray(self._tokens, dtype=np.int64).reshape(m),
            "sum": np.stack(self._sum) if m else np.zeros((0, *self.shape), np.float32),
            "sumsq": np.stack(self._sumsq) if m else np.zeros((0, *self.shape), np.float32),
        }


def add_record(totals: StatsAccumulator, sample: PieceSample, record_key: str, x) -> None:
    """Add one record's ``[T, K, H]`` slots to ``totals`` piece by piece and offer each piece to ``sample``
    (the sums are computed once for both). A tail shorter than half a piece is counted, not sampled;
    a piece holding a non-finite value is not sampled."""
    p = sample.piece_tokens
    for i, start in enumerate(range(0, x.shape[0], p)):
        piece = x[start : start + p]
        sums = totals.add(piece)
        if sums is not None:
            sample.offer(f"{record_key}#{i}", piece.shape[0], *sums)


def merge_piece_arrays(
    a: dict[str, np.ndarray], b: dict[str, np.ndarray], max_pieces: int
) -> dict[str, np.ndarray]:
    """Union of two piece samples, keeping the ``max_pieces`` smallest keys (a key kept twice is an error:
    the same records were counted in two shards)."""
    keys = np.concatenate([a["keys"], b["keys"]])
    if len(np.unique(keys)) != len(keys):
        raise InputError(
            "the same calibration pieces appear in both profiles: were the same records built twice?"
        )
    order = np.argsort(keys, kind="stable")[:max_pieces]
    return {name: np.concatenate([a[name], b[name]])[order] for name in ("keys", "tokens", "sum", "sumsq")}

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

from hs_tracer.fingerprint.stats import ChannelStats


def stable_hash(key: str) -> int:
    """64-bit hash of a piece key, identical on every machine and Python run (unlike ``hash``)."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") >> 1


class StatsAccumulator:
    """Per-row, per-channel count/sum/sumsq of ``[T, R, H]`` arrays; non-finite values are excluded
    value by value (as the GPU probe does) and counted."""

    def __init__(self, rows: int, hidden: int) -> None:
        self.stats = ChannelStats.zeros(rows, hidden)
        self.nonfinite = 0
        self.tokens = 0

    def add(self, x: np.ndarray) -> None:
        if x.ndim != 3 or x.shape[1:] != self.stats.sum.shape:
            raise ValueError(f"expected [T, {self.stats.num_slots}, {self.stats.hidden}], got {x.shape}")
        for start in range(0, x.shape[0], self.CHUNK):  # bounded float64 temporaries for wide targets
            self._add(x[start : start + self.CHUNK])
        self.tokens += x.shape[0]

    CHUNK = 256

    def _add(self, x: np.ndarray) -> None:
        ok = np.isfinite(x)
        if ok.all():
            v = x.astype(np.float64)
            self.stats.count += x.shape[0]
        else:
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
            raise ValueError("piece_tokens must be >= 1 and max_pieces >= 0")
        self.shape = (num_slots, hidden)
        self.piece_tokens = piece_tokens
        self.max_pieces = max_pieces
        self._keys: list[int] = []
        self._tokens: list[int] = []
        self._sum: list[np.ndarray] = []
        self._sumsq: list[np.ndarray] = []

    def add(self, record_key: str, x: np.ndarray) -> None:
        """Split one record's ``[T, K, H]`` slots into pieces; a tail shorter than half a piece is dropped."""
        if self.max_pieces == 0:
            return
        p = self.piece_tokens
        for i, start in enumerate(range(0, x.shape[0], p)):
            piece = x[start : start + p]
            if piece.shape[0] < max(1, p // 2) or not np.isfinite(piece).all():
                continue
            v = piece.astype(np.float64)
            self._keys.append(stable_hash(f"{record_key}#{i}"))
            self._tokens.append(piece.shape[0])
            self._sum.append(v.sum(0).astype(np.float32))
            self._sumsq.append(np.einsum("tkh,tkh->kh", v, v).astype(np.float32))
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


def merge_piece_arrays(
    a: dict[str, np.ndarray], b: dict[str, np.ndarray], max_pieces: int
) -> dict[str, np.ndarray]:
    """Union of two piece samples, keeping the ``max_pieces`` smallest keys (a key kept twice is an error:
    the same records were counted in two shards)."""
    keys = np.concatenate([a["keys"], b["keys"]])
    if len(np.unique(keys)) != len(keys):
        raise ValueError(
            "the same calibration pieces appear in both profiles: were the same records built twice?"
        )
    order = np.argsort(keys, kind="stable")[:max_pieces]
    return {name: np.concatenate([a[name], b[name]])[order] for name in ("keys", "tokens", "sum", "sumsq")}

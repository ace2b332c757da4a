"""A dump's rows together with the whole token sequence they were computed on, sampled for recomputation.

Why: recomputing the target on a row's tokens names the layer the row holds exactly, but only when
the recomputation sees everything the row saw: causal attention makes a row depend on every token
before it. A training record (SpecForge, speculators) is one whole sequence from position 0. A
capture shard holds several requests' prefill rows, each the extend tokens after its prefix; a
request whose prefix is 0 holds its whole sequence, one whose prefix came from the cache (or an
earlier chunk) does not, and is left out and counted rather than compared wrongly.

The sample is deterministic: files spread evenly over the sorted list first (as the expected
acceptance samples), then the rest in order, until ``sequences`` sequences or ``tokens`` rows.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path

import numpy as np
import torch

from hs_tracer.profile.readers import Record

DEFAULT_SEQUENCES = 8
DEFAULT_TOKENS = 512
NO_IDS = "no token ids stored"
NO_POSITIONS = "no token positions stored"
PREFIX_NOT_HELD = "its prefix is not in the capture: a cache hit or an earlier chunk"


@dataclass
class TokenRows:
    """One sequence: ``input_ids`` [T] from position 0, and stored rows [R, K, H] at ``positions`` [R]."""

    key: str
    input_ids: np.ndarray
    rows: torch.Tensor
    positions: np.ndarray


@dataclass
class Sample:
    sequences: list[TokenRows] = field(default_factory=list)
    left_out: Counter[str] = field(default_factory=Counter)  # why rows were not compared -> how many
    # requests (captures) or records (training dumps) it left out

    @property
    def rows(self) -> int:
        return sum(int(s.rows.shape[0]) for s in self.sequences)


def _segments(rec: Record) -> list[slice]:
    """The record's rows split into requests: by ``extend_lens`` when the capture kept them, else
    where positions stop counting up by one."""
    n = int(rec.slots.shape[0])
    if rec.extend_lens is not None and int(np.sum(rec.extend_lens)) == n:
        ends = np.cumsum(rec.extend_lens)
        starts = np.concatenate([[0], ends[:-1]])
        return [slice(int(a), int(b)) for a, b in zip(starts, ends, strict=True) if b > a]
    pos = rec.positions
    assert pos is not None
    cuts = [0, *(int(i) for i in np.flatnonzero(np.diff(pos) != 1) + 1), n]
    return [slice(a, b) for a, b in pairwise(cuts) if b > a]


def sequences_of(rec: Record, skip_first: int) -> tuple[list[TokenRows], Counter[str]]:
    """The whole sequences a record holds (rows at positions below ``skip_first`` dropped), and how
    many requests were left out, by reason."""
    left: Counter[str] = Counter()
    if rec.input_ids is None:
        left[NO_IDS] += 1
        return [], left
    if rec.positions is None:
        left[NO_POSITIONS] += 1
        return [], left
    out = []
    for seg in _segments(rec):
        pos = rec.positions[seg]
        if pos[0] != 0 or not np.array_equal(pos, np.arange(len(pos))):
            left[PREFIX_NOT_HELD] += 1
            continue
        keep = pos >= skip_first
        if keep.any():
            out.append(TokenRows(f"{rec.key}@{seg.start}", np.asarray(rec.input_ids[seg], np.int64),
                                 rec.slots[seg][torch.from_numpy(keep)], pos[keep]))
    return out, left


def _order(files: Sequence[Path], sequences: int) -> list[Path]:
    step = max(len(files) // max(sequences, 1), 1)
    spread = list(files[::step][:sequences])
    taken = set(spread)
    return spread + [f for f in files if f not in taken]


def sample(files: Sequence[Path], records: Callable[[Path], Iterable[Record]], *,
           sequences: int = DEFAULT_SEQUENCES, tokens: int = DEFAULT_TOKENS, skip_first: int = 1) -> Sample:
    """Up to ``sequences`` whole sequences holding at most ``tokens`` rows in all; the last one is cut
    (with its tokens: rows never depend on later tokens)."""
    out = Sample()
    for file in _order(files, sequences):
        for rec in records(file):
            found, left = sequences_of(rec, skip_first)
            out.left_out.update(left)
            for seq in found:
                room = tokens - out.rows
                if room < len(seq.positions):
                    seq = TokenRows(seq.key, seq.input_ids[: int(seq.positions[room - 1]) + 1],
                                    seq.rows[:room], seq.positions[:room])
                out.sequences.append(seq)
                if len(out.sequences) >= sequences or out.rows >= tokens:
                    return out
    return out

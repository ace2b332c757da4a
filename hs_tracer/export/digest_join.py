"""Fingerprint digests joined to the verify steps they belong to, by step number."""

from __future__ import annotations

from collections import deque

import numpy as np


class DigestJoin:
    """The digests drained lately, as the blocks the step path drained (``StepPath.take_digests``), to find a
    step's digest by its number: a digest can land before its step's result is handed over (the
    overlap scheduler launches step N+1 before it resolves step N), and only a few steps (the
    sampled spans) ever need theirs, so nothing is done per digest. Bounded: the oldest blocks go
    once more than ``limit`` digests are kept."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._blocks: deque[tuple[np.ndarray, np.ndarray, np.ndarray]] = deque()
        self._kept = 0

    def add(self, steps: np.ndarray, tokens: np.ndarray, raws: np.ndarray) -> None:
        if not steps.size:
            return
        self._blocks.append((steps, tokens, raws))
        self._kept += steps.size
        while self._kept - self._blocks[0][0].size >= self.limit:
            self._kept -= self._blocks.popleft()[0].size

    def find(self, step: int) -> tuple[int, np.ndarray] | None:
        """``(tokens, raw [K, 5])`` of the step's digest, None if it is not kept."""
        for steps, tokens, raws in reversed(self._blocks):
            hit = np.flatnonzero(steps == step)
            if hit.size:
                return int(tokens[hit[-1]]), raws[hit[-1]]
        return None

    def steps_with(self, field: int) -> np.ndarray:
        """The steps whose kept digest has a non-zero ``field`` in some slot."""
        hits = [steps[(raws[:, :, field] != 0).any(axis=1)] for steps, _tokens, raws in self._blocks]
        return np.concatenate(hits) if hits else np.zeros(0, dtype=np.int64)

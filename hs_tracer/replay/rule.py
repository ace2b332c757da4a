"""When is a wiring's live agreement "at training level": replay's calibrated verdict rule.

A capture holds a few hundred to a few thousand scored tokens, so the agreement of a correct wiring
scatters around the draft's training agreement, and live text is never exactly the training text. A
bare fraction of the training agreement lets a correct run fall just under it and a wrong one just
over it. The rule instead measures the scatter the capture's size implies, on the training data
itself (the draft's own variability, like the diagnosis thresholds), and allows for live text:

    level(n) = training × (1 - ALLOWANCE) - Z × spread(n)

``spread(n)``: the standard deviation of agreement over ``WINDOWS`` seeded windows of whole training
sequences holding ``n`` tokens (``n``: the capture's scored tokens; measured at a quarter of the
training tokens when ``n`` is larger, and scaled by ``1/sqrt(n)``), at least the binomial
``sqrt(p(1-p)/n)``. ``ALLOWANCE`` and ``Z`` are calibrated on the testbed by
``benchmarks/replay_rule.py`` (results in ``benchmarks/results/replay_rule.json``; the measured
false-alarm and detection rates are in docs/replay.md).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

ALLOWANCE = 0.01
"""Relative agreement a correct wiring may lose on live text against the training text."""
Z = 3.5
"""Spreads below the allowed level at which a wiring stops being at training level."""
MIN_TOKENS = 256
"""Captures with fewer scored tokens scatter with a heavier tail than Z covers (docs/replay.md)."""
WINDOWS = 256
SEED = 0
POOL_SHARE = 4
"""Windows hold at most 1/POOL_SHARE of the training tokens: windows taking most of a small pool overlap
and scatter less than captures do (2,874 training tokens: 0.013 at 1,882 tokens against 0.022 on the
whole 19,190-token dump), so the scatter is measured there and scaled by 1/sqrt(tokens)."""


def window_rates(by_sequence: Sequence[tuple[int, int]], tokens: int, windows: int = WINDOWS,
                 seed: int = SEED) -> np.ndarray:
    """Agreement of ``windows`` windows of whole sequences (random order, seeded) with at least
    ``tokens`` scored tokens each (all sequences when they hold fewer)."""
    counts = np.asarray(by_sequence, dtype=np.int64).reshape(-1, 2)
    if counts.shape[0] == 0 or counts[:, 1].sum() == 0:
        return np.zeros(0)
    rng = np.random.default_rng(seed)
    out = np.empty(windows)
    for w in range(windows):
        order = rng.permutation(counts.shape[0])
        cum = np.cumsum(counts[order, 1])
        take = order[: int(np.searchsorted(cum, tokens)) + 1]
        c, t = counts[take].sum(axis=0)
        out[w] = c / t
    return out


def spread(by_sequence: Sequence[tuple[int, int]], tokens: int, windows: int = WINDOWS,
           seed: int = SEED) -> float:
    """Scatter of a correct wiring's agreement over ``tokens`` scored tokens (see the module doc)."""
    counts = np.asarray(by_sequence, dtype=np.int64).reshape(-1, 2)
    total = int(counts[:, 1].sum()) if counts.size else 0
    if total == 0 or tokens <= 0:
        return 1.0
    p = counts[:, 0].sum() / total
    binomial = math.sqrt(p * (1 - p) / tokens)
    measured = min(tokens, max(total // POOL_SHARE, 1))
    windowed = float(np.std(window_rates(counts, measured, windows, seed))) * math.sqrt(measured / tokens)
    return max(windowed, binomial)


@dataclass(frozen=True)
class Level:
    """Training level for a capture of ``tokens`` scored tokens."""

    training: float  # the draft's agreement on its training data
    tokens: int
    spread: float
    allowance: float = ALLOWANCE
    z: float = Z

    @property
    def value(self) -> float:
        return max(0.0, self.training * (1 - self.allowance) - self.z * self.spread)

    def reached(self, rate: float) -> bool:
        return rate >= self.value

    def margin(self, rate: float) -> float:
        """How far ``rate`` lies above (+) or below (-) the level, in spreads."""
        return (rate - self.value) / self.spread if self.spread > 0 else math.inf

    @property
    def too_few_tokens(self) -> bool:
        return self.tokens < MIN_TOKENS

    def to_json(self) -> dict[str, float | int | bool]:
        return {"value": round(self.value, 4), "tokens": self.tokens, "spread": round(self.spread, 4),
                "allowance": self.allowance, "z": self.z, "too_few_tokens": self.too_few_tokens}


def training_level(training_by_sequence: Sequence[tuple[int, int]], tokens: int,
                   allowance: float = ALLOWANCE, z: float = Z) -> Level:
    counts = np.asarray(training_by_sequence, dtype=np.int64).reshape(-1, 2)
    total = int(counts[:, 1].sum()) if counts.size else 0
    rate = counts[:, 0].sum() / total if total else 0.0
    return Level(float(rate), tokens, spread(counts, tokens), allowance, z)

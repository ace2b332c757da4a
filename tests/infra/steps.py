"""Deterministic, realistic step records for exporter tests and benchmarks.

Accept lengths follow a chain: draft position i is only accepted if position i-1 was, each with
probability ``p_accept``; so per-position rates fall with the position as in real speculative
decoding. ``p_accept`` near 0 looks like a miswired draft (accept length ~1.0).
"""

from __future__ import annotations

import numpy as np

from hs_tracer.fingerprint.stats import DIGEST_WIDTH, StepDigest
from hs_tracer.records import Ranks, StepRecord


def accept_lengths(rng: np.random.Generator, batch: int, num_draft_tokens: int, p_accept: float) -> list[int]:
    """Accept lengths (bonus token included, so 1..num_draft_tokens) for one verify step."""
    out = []
    for _ in range(batch):
        length = 1
        while length < num_draft_tokens and rng.random() < p_accept:
            length += 1
        out.append(length)
    return out


def digest(rng: np.random.Generator, tokens: int, slot_scales: list[float], hidden: int) -> StepDigest:
    """A step digest computed from random features whose RMS differs per slot."""
    raw = np.zeros((len(slot_scales), DIGEST_WIDTH))
    for k, scale in enumerate(slot_scales):
        x = rng.normal(0.0, scale, size=(tokens, hidden))
        raw[k] = (x.size, x.sum(), (x * x).sum(), np.abs(x).max(), 0)
    return StepDigest.from_raw(tokens, raw)


def make_steps(n_steps: int, *, seed: int, ranks: Ranks | None = None, num_draft_tokens: int = 4,
               p_accept: float = 0.7, max_batch: int = 16, slot_scales: tuple[float, ...] = (0.5, 2.0, 8.0),
               hidden: int = 32, start_ns: int = 1_790_000_000_000_000_000) -> list[StepRecord]:
    """``n_steps`` verify steps of one scheduler with batch sizes 1..max_batch."""
    rng = np.random.default_rng(seed)
    ranks = ranks or Ranks()
    steps = []
    for step in range(n_steps):
        batch = int(rng.integers(1, max_batch + 1))
        lengths = accept_lengths(rng, batch, num_draft_tokens, p_accept)
        steps.append(StepRecord(
            step=step, time_unix_ns=start_ns + step * 20_000_000, ranks=ranks,
            request_ids=[f"req-{seed}-{step}-{i}" for i in range(batch)], accept_lengths=lengths,
            num_draft_tokens=num_draft_tokens,
            digest=digest(rng, batch * num_draft_tokens, list(slot_scales), hidden),
            input_width=len(slot_scales) * hidden))
    return steps

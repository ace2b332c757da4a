"""Verify steps as a few flat arrays: what the scheduler process hands its exporters and diagnosis.

The scheduler thread hands each step over as references (``steps.PendingStep``); the recorder
thread turns a run of them, and the fingerprint digests drained from the probe meanwhile, into one
:class:`StepBatch` with a fixed number of numpy calls whatever the batch size. Digests are not
joined to their steps here (that is per-step Python): the batch carries them as drained, and the
analysis joins them by step number (``steps.DigestJoin``). A batch holds no engine objects unless
asked to (``requests``: SGLang's request objects, needed only for events on SGLang's own request
traces), so it can cross to the export process as plain bytes (``export/channel.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from hs_tracer.fingerprint.stats import StepDigest
from hs_tracer.records import Ranks, StepRecord

if TYPE_CHECKING:
    from hs_tracer.integrations.sglang.steps import PendingStep

ARRAYS = ("steps", "time_unix_ns", "num_draft_tokens", "host_s", "sizes", "lengths", "digest_steps",
          "digest_tokens", "digest_raws")
"""The array fields of :class:`StepBatch`, in the order they cross the pipe."""

# PendingStep's fields, by position: the batch reads them column-wise (one transpose in C)
_STEP, _TIME, _ACCEPT_LENS, _REQS, _SKIP, _NUM_DRAFT_TOKENS, _MAX_ACCEPT, _WIDTH, _HOST_S = range(9)


@dataclass
class StepBatch:
    """``S`` verify steps of one scheduler process, oldest first, and the digests drained with them.

    ``sizes[i]`` requests were committed in step ``i``; their accept lengths (bonus token included)
    are ``lengths[sizes[:i].sum():][:sizes[i]]``. ``digest_steps[j]`` names the step whose draft
    input ``digest_raws[j]`` (``[K, 5]`` raw sums over ``digest_tokens[j]`` rows) fingerprints.
    """

    steps: np.ndarray  # int64 [S]
    time_unix_ns: np.ndarray  # int64 [S]
    num_draft_tokens: np.ndarray  # int64 [S]
    host_s: np.ndarray  # float64 [S]: host time of the per-step hooks that led to each step
    sizes: np.ndarray  # int64 [S]
    lengths: np.ndarray  # integers [sum(sizes)]
    digest_steps: np.ndarray  # int64 [D]
    digest_tokens: np.ndarray  # int64 [D]
    digest_raws: np.ndarray  # float [D, K, 5]
    max_accept_length: int | None = None
    input_width: int | None = None
    requests: list[Sequence[Any]] | None = None  # committed requests per step (same process only)

    @classmethod
    def from_pending(cls, items: Sequence[PendingStep], digest_steps: np.ndarray, digest_tokens: np.ndarray,
                     digest_raws: np.ndarray, requests: bool = False) -> StepBatch:
        """One batch from pending steps (at least one) and the digests drained with them.
        ``requests``: keep each step's committed request objects (for SGLang request traces)."""
        columns = list(zip(*items, strict=False))  # every item has all of PendingStep's fields
        lengths, sizes = committed_lengths(columns[_ACCEPT_LENS], columns[_REQS], columns[_SKIP])
        width = next((w for w in reversed(columns[_WIDTH]) if w is not None), None)
        return cls(
            steps=np.array(columns[_STEP], dtype=np.int64),
            time_unix_ns=np.array(columns[_TIME], dtype=np.int64),
            num_draft_tokens=np.array(columns[_NUM_DRAFT_TOKENS], dtype=np.int64),
            host_s=np.array(columns[_HOST_S], dtype=np.float64),
            sizes=sizes, lengths=lengths,
            digest_steps=digest_steps, digest_tokens=digest_tokens, digest_raws=digest_raws,
            max_accept_length=columns[_MAX_ACCEPT][-1], input_width=width,
            requests=[item.kept() for item in items] if requests else None,
        )

    def __len__(self) -> int:
        return int(self.steps.size)

    def draft_tokens(self) -> int:
        """Drafts proposed over the batch: every committed request proposes ``num_draft_tokens - 1``."""
        return int(np.dot(self.sizes, np.maximum(self.num_draft_tokens - 1, 0)))

    def record(self, i: int, ranks: Ranks, hidden: int, digest: tuple[int, np.ndarray] | None) -> StepRecord:
        """Step ``i`` as a full :class:`StepRecord` (for exporters that need single steps), with its
        joined ``digest`` (``(tokens, raw)``; the count is made exact for ``hidden``). Request ids
        and trace contexts only when the batch kept the requests."""
        start = int(self.sizes[:i].sum())
        kept = self.requests[i] if self.requests is not None else []
        return StepRecord(
            step=int(self.steps[i]), time_unix_ns=int(self.time_unix_ns[i]), ranks=ranks,
            request_ids=[r.rid for r in kept],
            accept_lengths=self.lengths[start:start + int(self.sizes[i])].tolist(),
            num_draft_tokens=int(self.num_draft_tokens[i]), digest=step_digest(digest, hidden),
            input_width=self.input_width,
            trace_ctxs=[getattr(getattr(r, "time_stats", None), "trace_ctx", None) for r in kept],
            max_accept_length=self.max_accept_length, host_overhead_s=float(self.host_s[i]),
        )


def committed_lengths(accept_lens: Sequence[Any], reqs: Sequence[Sequence[Any]],
                      skips: Sequence[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Every committed request's accept length over a run of steps, joined in order (SGLang's integer
    dtype), and how many each step committed. Per step: SGLang's accept lengths (a CPU tensor, or a
    sequence), its request list and the indices SGLang skipped.

    SGLang's per-step tensors are joined by one ``torch.cat`` and the skipped requests removed by one
    ``np.delete``, so a run costs a few calls whatever its length (per step only list operations);
    plain sequences (tests, the V1 worker) are converted one by one."""
    import torch

    if set(map(type, accept_lens)) == {torch.Tensor}:
        joined = (torch.cat(accept_lens) if len(accept_lens) > 1 else accept_lens[0]).numpy().reshape(-1)
    else:
        joined = np.concatenate([np.asarray(t.numpy() if hasattr(t, "numpy") else t).reshape(-1)
                                 for t in accept_lens])
    counts = np.fromiter(map(len, reqs), np.int64, len(reqs))  # one accept length per request
    if int(counts.sum()) != joined.size:  # never so in SGLang; count the lengths themselves then
        counts = np.fromiter((t.numel() if hasattr(t, "numel") else len(t) for t in accept_lens), np.int64,
                             len(accept_lens))
    skipped = [(i, skip) for i, skip in enumerate(skips) if skip]
    if not skipped:
        return joined, counts
    starts = np.cumsum(counts) - counts
    drop = np.concatenate([np.asarray(skip, dtype=np.int64) + starts[i] for i, skip in skipped])
    for i, skip in skipped:
        counts[i] -= len(skip)
    return np.delete(joined, drop), counts


def step_digest(digest: tuple[int, np.ndarray] | None, hidden: int) -> StepDigest | None:
    """The :class:`StepDigest` of drained ``(tokens, raw)`` sums, if any."""
    return None if digest is None else StepDigest.from_kernel(*digest, hidden)

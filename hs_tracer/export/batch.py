"""Verify steps as a few flat arrays: what the scheduler process hands its exporters and diagnosis.

The scheduler thread hands each step over as references (``steps.PendingStep``); the recorder
thread turns a run of them into one :class:`StepBatch` with a fixed number of numpy calls whatever
the batch size. A batch holds no engine objects unless asked to (``requests``: SGLang's request
objects, needed only for events on SGLang's own request traces), so it can cross to the export
process as plain bytes (``export/channel.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import TYPE_CHECKING, Any

import numpy as np

from hs_tracer.fingerprint.stats import DIGEST_FIELDS, DIGEST_WIDTH, StepDigest, with_exact_count
from hs_tracer.integrations.sglang.steps import committed_lengths
from hs_tracer.records import Ranks, StepRecord

if TYPE_CHECKING:
    from hs_tracer.integrations.sglang.steps import PendingStep

_NONFINITE = DIGEST_FIELDS.index("nonfinite")
_STEP, _TIME, _HOST_S = attrgetter("step"), attrgetter("time_unix_ns"), attrgetter("host_s")
_NUM_DRAFT_TOKENS = attrgetter("num_draft_tokens")

ARRAYS = ("steps", "time_unix_ns", "num_draft_tokens", "host_s", "sizes", "lengths", "digest_tokens",
          "digest_raws")
"""The array fields of :class:`StepBatch`, in the order they cross the pipe."""


@dataclass
class StepBatch:
    """``S`` verify steps of one scheduler process, oldest first.

    ``sizes[i]`` requests were committed in step ``i``; their accept lengths (bonus token included)
    are ``lengths[offsets[i]:offsets[i] + sizes[i]]``. ``digest_tokens[i]`` is -1 where the step's
    fingerprint digest had not landed; ``digest_raws[i]`` is its ``[K, 5]`` raw sums otherwise.
    """

    steps: np.ndarray  # int64 [S]
    time_unix_ns: np.ndarray  # int64 [S]
    num_draft_tokens: np.ndarray  # int64 [S]
    host_s: np.ndarray  # float64 [S]: host time of the per-step hooks that led to each step
    sizes: np.ndarray  # int64 [S]
    lengths: np.ndarray  # int64 [sum(sizes)]
    digest_tokens: np.ndarray  # int64 [S]
    digest_raws: np.ndarray  # float64 [S, K, 5]
    max_accept_length: int | None = None
    input_width: int | None = None
    requests: list[Sequence[Any]] | None = None  # committed requests per step (same process only)

    @classmethod
    def from_pending(cls, items: Sequence[PendingStep], digests: Sequence[tuple[int, np.ndarray] | None],
                     num_slots: int, requests: bool = False) -> StepBatch:
        """One batch from the pending steps and their drained digests (``(tokens, raw)`` or None).
        ``requests``: keep each step's committed request objects (for SGLang request traces)."""
        count = len(items)
        lengths, sizes = committed_lengths(items, sizes=True)
        tokens = np.full(count, -1, dtype=np.int64)
        raws = np.zeros((count, num_slots, DIGEST_WIDTH))
        landed = [i for i, d in enumerate(digests) if d is not None]
        if landed:
            tokens[landed] = [digests[i][0] for i in landed]  # type: ignore[index]
            raws[landed] = np.stack([digests[i][1] for i in landed])  # type: ignore[index]
        width = next((item.input_width for item in reversed(items) if item.input_width is not None), None)
        return cls(
            steps=np.fromiter(map(_STEP, items), np.int64, count),
            time_unix_ns=np.fromiter(map(_TIME, items), np.int64, count),
            num_draft_tokens=np.fromiter(map(_NUM_DRAFT_TOKENS, items), np.int64, count),
            host_s=np.fromiter(map(_HOST_S, items), np.float64, count),
            sizes=sizes if sizes is not None else np.zeros(count, dtype=np.int64),
            lengths=lengths.astype(np.int64, copy=False),
            digest_tokens=tokens, digest_raws=raws,
            max_accept_length=items[-1].max_accept_length if items else None, input_width=width,
            requests=[item.kept() for item in items] if requests else None,
        )

    def __len__(self) -> int:
        return int(self.steps.size)

    def landed(self) -> np.ndarray:
        """Indices of the steps whose digest landed."""
        return np.flatnonzero(self.digest_tokens >= 0)

    def nonfinite_per_step(self) -> np.ndarray:
        """``[S, K]`` non-finite values in each step's draft input (0 where no digest landed)."""
        return self.digest_raws[:, :, _NONFINITE]

    def digest(self, i: int, hidden: int) -> StepDigest | None:
        """Step ``i``'s digest (count made exact for a hidden size of ``hidden``), None if none landed."""
        tokens = int(self.digest_tokens[i])
        if tokens < 0:
            return None
        return StepDigest.from_raw(tokens, with_exact_count(self.digest_raws[i], tokens, hidden))

    def draft_tokens(self) -> int:
        """Drafts proposed over the batch: every committed request proposes ``num_draft_tokens - 1``."""
        return int(np.dot(self.sizes, np.maximum(self.num_draft_tokens - 1, 0)))

    def record(self, i: int, ranks: Ranks, hidden: int) -> StepRecord:
        """Step ``i`` as a full :class:`StepRecord` (for exporters that need single steps); request ids
        and trace contexts only when the batch kept the requests."""
        start = int(self.sizes[:i].sum())
        kept = self.requests[i] if self.requests is not None else []
        return StepRecord(
            step=int(self.steps[i]), time_unix_ns=int(self.time_unix_ns[i]), ranks=ranks,
            request_ids=[r.rid for r in kept],
            accept_lengths=self.lengths[start:start + int(self.sizes[i])].tolist(),
            num_draft_tokens=int(self.num_draft_tokens[i]), digest=self.digest(i, hidden),
            input_width=self.input_width,
            trace_ctxs=[getattr(getattr(r, "time_stats", None), "trace_ctx", None) for r in kept],
            max_accept_length=self.max_accept_length, host_overhead_s=float(self.host_s[i]),
        )

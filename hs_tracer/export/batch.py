"""Verify steps as a few flat arrays: what the scheduler process hands its exporters and diagnosis.

The scheduler thread logs each step in preallocated columns (``step_log.StepLog``); the recorder
thread turns a run of them, and the fingerprint digests drained from the probe meanwhile, into one
:class:`StepBatch` with a fixed number of numpy calls whatever the run's length. Digests are not
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
    from hs_tracer.export.step_log import StepRun

ARRAYS = ("steps", "time_unix_ns", "num_draft_tokens", "host_s", "sizes", "lengths", "digest_steps",
          "digest_tokens", "digest_raws")
"""The array fields of :class:`StepBatch`, in the order they cross the pipe."""


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
    # CPU seconds hs_tracer's recorder thread spent in the scheduler process since the previous
    # batch (it shares the scheduler's GIL): its cost, attributed to this batch's steps
    thread_cpu_s: float = 0.0
    # what the recorder's work cost the scheduler thread's steps since the previous batch, measured
    # on the steps (export/step_delay.py)
    scheduler_delay_s: float = 0.0

    @classmethod
    def from_run(cls, run: StepRun, digest_steps: np.ndarray, digest_tokens: np.ndarray,
                 digest_raws: np.ndarray, max_accept_length: int | None = None,
                 input_width: int | None = None, requests: bool = False,
                 scratch: Scratch | None = None) -> StepBatch:
        """One batch from a run of logged steps and the digests drained with them. ``requests``:
        keep each step's committed request objects (for SGLang request traces). ``scratch``: join
        the accept lengths into its memory (the batch's ``lengths`` are then valid only until the
        next batch joined there)."""
        lengths, sizes = committed_lengths(run.accept_lens, run.batch_sizes, run.skips, scratch)
        kept = None
        if requests:
            skipped = dict(run.skips)
            kept = [_kept(reqs, skipped.get(i)) for i, reqs in enumerate(run.reqs)]
        return cls(steps=run.steps, time_unix_ns=run.time_unix_ns, num_draft_tokens=run.num_draft_tokens,
                   host_s=run.host_s, sizes=sizes, lengths=lengths, digest_steps=digest_steps,
                   digest_tokens=digest_tokens, digest_raws=digest_raws, max_accept_length=max_accept_length,
                   input_width=input_width, requests=kept)

    def __len__(self) -> int:
        return int(self.steps.size)

    def step_lengths(self) -> list[np.ndarray]:
        """Each step's committed accept lengths."""
        return np.split(self.lengths, np.cumsum(self.sizes)[:-1])

    def split(self, steps: int) -> list[StepBatch]:
        """This batch as batches of ``steps`` steps, oldest first; the digests go with the first."""
        ends = np.cumsum(self.sizes)
        out = []
        for start in range(0, len(self), steps):
            stop = min(start + steps, len(self))
            lo, hi = int(ends[start - 1]) if start else 0, int(ends[stop - 1])
            first = not out
            out.append(StepBatch(
                steps=self.steps[start:stop], time_unix_ns=self.time_unix_ns[start:stop],
                num_draft_tokens=self.num_draft_tokens[start:stop], host_s=self.host_s[start:stop],
                sizes=self.sizes[start:stop], lengths=self.lengths[lo:hi],
                digest_steps=self.digest_steps if first else self.digest_steps[:0],
                digest_tokens=self.digest_tokens if first else self.digest_tokens[:0],
                digest_raws=self.digest_raws if first else self.digest_raws[:0],
                max_accept_length=self.max_accept_length, input_width=self.input_width,
                requests=self.requests[start:stop] if self.requests is not None else None,
                thread_cpu_s=self.thread_cpu_s if first else 0.0,
                scheduler_delay_s=self.scheduler_delay_s if first else 0.0))
        return out

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


class Scratch:
    """Memory reused by every join of accept lengths (a 1024-request batch of half a second of
    steps is megabytes of int32: fresh pages each time cost page faults worth ~1 µs a step on a
    GPU host)."""

    def __init__(self) -> None:
        self.tensor: Any = None

    def view(self, n: int, like: Any) -> Any:
        """``n`` elements of ``like``'s dtype, grown (doubled) as needed."""
        t = self.tensor
        if t is None or t.dtype != like.dtype or t.numel() < n:
            import torch

            t = self.tensor = torch.empty(max(n, 2 * (t.numel() if t is not None else 0)), dtype=like.dtype)
        return t[:n]


def committed_lengths(accept_lens: Sequence[Any], batch_sizes: np.ndarray,
                      skips: Sequence[tuple[int, list[int]]],
                      scratch: Scratch | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Every committed request's accept length over a run of steps, joined in order (SGLang's integer
    dtype), and how many each step committed. Per step: SGLang's accept lengths (a CPU tensor, or a
    sequence) and its batch size; ``skips``: ``(step index, request indices SGLang skipped)`` for the
    steps that skipped any.

    SGLang's per-step tensors are joined by one ``torch.cat`` and the skipped requests removed by one
    ``np.delete``, so a run costs a few calls whatever its length; plain sequences (tests, the V1
    worker) are converted one by one."""
    import torch

    if set(map(type, accept_lens)) == {torch.Tensor}:
        if len(accept_lens) == 1:
            joined = accept_lens[0].numpy().reshape(-1)
        elif scratch is not None and accept_lens[0].dim() == 1:
            try:
                into = scratch.view(int(batch_sizes.sum()), accept_lens[0])
                joined = torch.cat(accept_lens, out=into).numpy()
            except RuntimeError:  # the tensors do not hold one length per request (never so in SGLang)
                joined = torch.cat(accept_lens).numpy().reshape(-1)
        else:
            joined = torch.cat(accept_lens).numpy().reshape(-1)
    else:
        joined = np.concatenate([np.asarray(t.numpy() if hasattr(t, "numpy") else t).reshape(-1)
                                 for t in accept_lens])
    counts = batch_sizes.astype(np.int64)  # one accept length per request
    if int(counts.sum()) != joined.size:  # never so in SGLang; count the lengths themselves then
        counts = np.fromiter((t.numel() if hasattr(t, "numel") else len(t) for t in accept_lens), np.int64,
                             len(accept_lens))
    if not skips:
        return joined, counts
    starts = np.cumsum(counts) - counts
    drop = np.concatenate([np.asarray(skip, dtype=np.int64) + starts[i] for i, skip in skips])
    for i, skip in skips:
        counts[i] -= len(skip)
    return np.delete(joined, drop), counts


def _kept(reqs: Sequence[Any], skip: list[int] | None) -> list[Any]:
    """The requests of a step that SGLang committed."""
    if not skip:
        return list(reqs)
    skipped = set(skip)
    return [r for i, r in enumerate(reqs) if i not in skipped]


def step_digest(digest: tuple[int, np.ndarray] | None, hidden: int) -> StepDigest | None:
    """The :class:`StepDigest` of drained ``(tokens, raw)`` sums, if any."""
    return None if digest is None else StepDigest.from_kernel(*digest, hidden)

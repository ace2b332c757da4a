"""The verify steps SGLang's scheduler thread hands over, as preallocated columns the recorder thread
reads a run at a time.

Why columns and not one object per step: whatever the scheduler thread builds per step, the
recorder has to take apart per step, in Python, on the GIL the scheduler thread needs next (a
transpose of 1000 tuples, a list of 1000 tensors to index). Here the scheduler thread stores five
numbers through memoryviews (~25 ns each, no allocation) and two references into list slots, and
the recorder takes a run of steps with a fixed number of slice copies, whatever its length
(:meth:`StepLog.take`).

One writer (the scheduler thread), one reader (the recorder thread), no lock: the writer fills slot
``written % capacity`` and only then advances :attr:`StepLog.written`; the reader copies slots
``[read, written)`` and only then advances :attr:`StepLog.read`. The writer never touches an unread
slot: with ``capacity`` steps unread it drops the new step and counts it (:attr:`dropped`), so a
reader that falls behind loses the newest steps, never a half-read run.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np


class StepRun(NamedTuple):
    """Steps ``[first, first + len(steps))`` of a log, oldest first, as copies (the log may reuse
    its slots once the run is taken)."""

    steps: np.ndarray  # int64 [S]: the step number the launch hook stamped
    time_unix_ns: np.ndarray  # int64 [S]
    num_draft_tokens: np.ndarray  # int64 [S]
    host_s: np.ndarray  # float64 [S]: host time of the per-step hooks that led to the step
    batch_sizes: np.ndarray  # int64 [S]: requests in the step's batch, skipped ones included
    accept_lens: list[Any]  # per step: SGLang's CPU tensor of accept lengths, or a sequence
    reqs: list[Sequence[Any]]  # per step: the batch's request list
    skips: list[tuple[int, list[int]]]  # (index in the run, request indices SGLang skipped), only where any


class StepLog:
    """``capacity`` verify steps (rounded up to a power of two), written by one thread, read by another."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"step log capacity must be positive, got {capacity}")
        size = 1 << (capacity - 1).bit_length()
        self.capacity = size
        self._mask = size - 1
        self._steps = np.zeros(size, np.int64)
        self._time_ns = np.zeros(size, np.int64)
        self._num_draft = np.zeros(size, np.int64)
        self._host_s = np.zeros(size, np.float64)
        self._sizes = np.zeros(size, np.int64)
        self._columns = (self._steps, self._time_ns, self._num_draft, self._host_s, self._sizes)
        # the writer's stores go through memoryviews: an item store there is a few times cheaper
        # than numpy's scalar assignment
        self._w_steps, self._w_time = memoryview(self._steps), memoryview(self._time_ns)
        self._w_draft, self._w_host = memoryview(self._num_draft), memoryview(self._host_s)
        self._w_sizes = memoryview(self._sizes)
        self._accept: list[Any] = [None] * size
        self._reqs: list[Any] = [None] * size
        self._cleared: list[Any] = [None] * size  # slices of it release a taken run's references
        self._skips: deque[tuple[int, list[int]]] = deque()  # (step slot number, skip), non-empty only
        self.written = 0  # steps written so far (the writer's count; slot = count % capacity)
        self.read = 0  # steps taken so far (the reader's count)
        self.dropped = 0

    def __len__(self) -> int:
        """Steps written and not yet taken."""
        return self.written - self.read

    def append(self, step: int, time_unix_ns: int, accept_lens: Any, reqs: Sequence[Any], skip: list[int],
               num_draft_tokens: int, host_s: float) -> bool:
        """Writer: one verify step, by reference (``accept_lens`` and ``reqs`` must not change
        afterwards: SGLang makes both fresh per step). False when the log is full (counted)."""
        n = self.written
        if n - self.read >= self.capacity:
            self.dropped += 1
            return False
        i = n & self._mask
        self._w_steps[i] = step
        self._w_time[i] = time_unix_ns
        self._w_draft[i] = num_draft_tokens
        self._w_host[i] = host_s
        self._w_sizes[i] = len(reqs)
        self._accept[i] = accept_lens
        self._reqs[i] = reqs
        if skip:
            self._skips.append((n, skip))
        self.written = n + 1  # last: the reader sees the slot only once it is complete
        return True

    def take(self) -> StepRun | None:
        """Reader: every step written since the last call, or None."""
        first, end = self.read, self.written
        if end == first:
            return None
        a, b = first & self._mask, end & self._mask
        if a < b:
            cols = [c[a:b].copy() for c in self._columns]
            accept, reqs = self._accept[a:b], self._reqs[a:b]
            self._accept[a:b] = self._reqs[a:b] = self._cleared[:b - a]
        else:  # the run wraps around the end of the slots
            cols = [np.concatenate((c[a:], c[:b])) for c in self._columns]
            accept, reqs = self._accept[a:] + self._accept[:b], self._reqs[a:] + self._reqs[:b]
            self._accept[a:] = self._reqs[a:] = self._cleared[:self.capacity - a]
            self._accept[:b] = self._reqs[:b] = self._cleared[:b]
        skips = []
        while self._skips and self._skips[0][0] < end:
            n, skip = self._skips.popleft()
            skips.append((n - first, skip))
        self.read = end  # last: the writer may reuse these slots from here on
        return StepRun(*cols, accept, reqs, skips)

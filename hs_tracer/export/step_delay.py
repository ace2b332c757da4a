"""What hs_tracer's recorder thread costs the scheduler thread, measured on the steps themselves.

The recorder runs in the scheduler process and holds its GIL while it works; its CPU time is an
upper bound of what it takes from serving (much of it runs while the scheduler thread waits for
the GPU with the GIL released). What serving actually loses shows in the steps: a decode step
whose interval (from one step's hook to the next) overlaps a recorder wake-up takes longer, by the
time the scheduler thread waited for the GIL, than one that does not. The recorder wakes on its own
timer, not in step with the steps, so overlapped and clear intervals sample the same step mix, and

    delay = overlapped steps x (mean overlapped interval - mean clear interval)

estimates the time the steps lost to it. Intervals longer than ``MAX_STEP_S`` (idle gaps between
requests) are left out. The estimate is noisy over few overlapped steps and taken as a running
maximum (a counter cannot go down), so it errs high, never low, as a cost figure should.
All of it runs in the recorder thread: the step path only appends a clock reading per step.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

MAX_STEP_S = 0.25


class StepDelay:
    """Accumulates step intervals, overlapped by the recorder's work or clear of it."""

    def __init__(self, keep_busy: int = 64) -> None:
        self._busy: deque[tuple[float, float]] = deque(maxlen=keep_busy)  # recent wake-ups' work
        self._last: float | None = None  # the latest step's clock reading
        self.overlapped_n = 0
        self.overlapped_s = 0.0
        self.clear_n = 0
        self.clear_s = 0.0
        self._reported = 0.0

    def busy(self, start: float, end: float) -> None:
        """One wake-up's work, ``time.perf_counter`` readings."""
        self._busy.append((start, end))

    def steps(self, clock: Iterable[float]) -> None:
        """The step path's clock readings since the last call, in order. Call it before the work of
        the wake-up that reads them (every interval then ends before that work starts, so every
        wake-up it could overlap is already known)."""
        last = self._last
        for t in clock:
            if last is not None and 0.0 < t - last <= MAX_STEP_S:
                if any(start < t and end > last for start, end in self._busy):
                    self.overlapped_n += 1
                    self.overlapped_s += t - last
                else:
                    self.clear_n += 1
                    self.clear_s += t - last
            last = t
        self._last = last

    def delay_s(self) -> float:
        """The steps' estimated loss so far (0 until both kinds of interval were seen)."""
        if not self.overlapped_n or not self.clear_n:
            return 0.0
        extra = self.overlapped_s / self.overlapped_n - self.clear_s / self.clear_n
        return max(0.0, extra) * self.overlapped_n

    def take(self) -> float:
        """The increase of the running maximum of :meth:`delay_s` since the last call."""
        now = self.delay_s()
        if now <= self._reported:
            return 0.0
        grew, self._reported = now - self._reported, now
        return grew


def drain(clock: deque[float]) -> list[float]:
    """Everything in ``clock`` (the step path appends at the right while this pops at the left;
    both are atomic on a deque)."""
    out = []
    while clock:
        out.append(clock.popleft())
    return out

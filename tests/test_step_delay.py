"""The recorder's measure of what its work costs the scheduler thread's steps."""

from __future__ import annotations

import random
from collections import deque

import pytest

from hs_tracer.export.step_delay import MAX_STEP_S, StepDelay, drain


def _run(extra_s: float, seed: int = 0) -> StepDelay:
    """Steps of 10 ms (+-1 ms jitter); the recorder works 3 ms every 0.5 s, off the steps' phase,
    and a step overlapping that work takes ``extra_s`` longer."""
    rng = random.Random(seed)
    delay, t, wake = StepDelay(), 0.0, 0.2371
    clock = []
    while t < 20.0:
        step = 0.010 + rng.uniform(-0.001, 0.001)
        if t < wake + 0.003 and t + step > wake:
            step += extra_s
        if t + step > wake + 0.003:  # the wake-up is over before the step after it: the recorder
            delay.steps(clock)  # reads the steps up to its start, then works
            clock = []
            delay.busy(wake, wake + 0.003)
            wake += 0.5
        t += step
        clock.append(t)
    delay.steps(clock)
    return delay


def test_measures_the_time_steps_lose_to_the_recorder() -> None:
    d = _run(extra_s=0.002)
    overlapped = d.overlapped_n
    assert overlapped >= 39  # every wake-up touches one or two steps
    assert d.delay_s() == pytest.approx(0.002 * overlapped, rel=0.3)


def test_no_loss_reads_near_zero_and_never_negative() -> None:
    d = _run(extra_s=0.0)
    assert 0.0 <= d.delay_s() < 0.0005 * d.overlapped_n
    assert d.take() >= 0.0


def test_idle_gaps_are_left_out() -> None:
    d = StepDelay()
    d.steps([0.0, 0.01, 0.02, 0.02 + 2 * MAX_STEP_S, 0.03 + 2 * MAX_STEP_S])
    assert d.clear_n == 3 and d.overlapped_n == 0


def test_take_reports_the_running_maximum_once() -> None:
    d = _run(extra_s=0.002)
    first = d.take()
    assert first == pytest.approx(d.delay_s())
    assert d.take() == 0.0


def test_drain_empties_the_clock_in_order() -> None:
    clock = deque([1.0, 2.0, 3.0])
    assert drain(clock) == [1.0, 2.0, 3.0] and not clock

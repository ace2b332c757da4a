"""The per-process tracer state every engine adapter extends, and the fail-safe guard its hooks run under.

An engine adapter subclasses :class:`TracerState` with what its hooks read and how it reports
(:meth:`TracerState.status`), and keeps its one state in a :class:`Slot`. What is the same for
every engine lives here: the fields the recorder reads, switching tracing off on a hook error, the
report file, and the profile check against the served model.

A hook that raises is counted, logged once and switches the tracer off; the engine's own call then
proceeds exactly as if hs_tracer were not there.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar

from hs_tracer.config import TracerConfig
from hs_tracer.core.recorder import Recorder
from hs_tracer.core.steps import StepPath
from hs_tracer.diagnosis.causes import group
from hs_tracer.export.capture import CaptureSink
from hs_tracer.export.report_file import ReportFile
from hs_tracer.findings import Code, Finding, Severity
from hs_tracer.profile.model import OTHER_MODEL_FIX, Profile, ProfileError, other_model
from hs_tracer.records import Ranks, WiringRecord

logger = logging.getLogger("hs_tracer")

F = TypeVar("F", bound=Callable[..., Any])


@dataclass
class TracerState(abc.ABC):
    """What every engine's hooks fill in and the recorder reads (``core.recorder.SchedulerSide``)."""

    config: TracerConfig
    enabled: bool = True
    hook_errors: int = 0
    disabled_reason: str | None = None
    # What the startup hooks read; the adapter builds the WiringRecord from them.
    target: dict[str, Any] = field(default_factory=dict)
    aux: dict[str, Any] = field(default_factory=dict)
    draft: dict[str, Any] = field(default_factory=dict)
    draft_config: dict[str, Any] = field(default_factory=dict)
    spec_args: dict[str, Any] = field(default_factory=dict)
    wiring: WiringRecord | None = None
    static_findings: list[Finding] = field(default_factory=list)
    profile_fits: bool = True  # False: HS_TRACER_PROFILE is of another model and is not used
    identity_off: str | None = None  # why the engine cannot have its layers measured here (the adapter's)
    ranks: Ranks | None = None
    emitting: bool = True  # False on ranks whose tensors another rank already traces
    # Step path: None until startup finished on this rank (non-last pipeline stages never get one).
    steps: StepPath | None = None
    role: str = "null"  # "null" (prefill and decode), "prefill" or "decode" under disaggregation
    recorder: Recorder | None = None
    capture: CaptureSink | None = None  # HS_TRACER_CAPTURE_DIR: sampled draft inputs (export/capture.py)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _report_file: ReportFile | None = None

    RING_SIZE: ClassVar[int] = 4096  # digest ring rows: steps the recorder may fall behind between batches

    @property
    def dropped(self) -> int:
        """Steps the recorder fell too far behind to take (oldest first)."""
        return self.steps.dropped if self.steps is not None else 0

    @abc.abstractmethod
    def tp_rank(self) -> int:
        """This process's tensor-parallel rank, for a fault injected on one rank."""

    @abc.abstractmethod
    def status(self) -> dict[str, Any]:
        """This process's report (docs/interfaces.md lists its keys)."""

    def wiring_json(self) -> dict[str, Any] | None:
        """The wiring as the status file writes it (with its deprecated alias keys), or None before
        startup set it."""
        return None if self.wiring is None else self.wiring.to_json()

    def with_diagnosis(self, out: dict[str, Any]) -> dict[str, Any]:
        """A status with the recorder's overhead and diagnosis added (only the startup findings before
        the recorder has one)."""
        overhead = self.recorder.overhead_json() if self.recorder is not None else None
        if overhead is not None:  # in-thread analysis; else the export process adds it to the report
            out["overhead"] = overhead
        diagnosis = self.recorder.report_json() if self.recorder is not None else None
        if diagnosis is not None:
            out["diagnosis"] = diagnosis
        elif self.static_findings:
            out["diagnosis"] = {"findings": [f.to_json() for f in self.static_findings]}
        return out

    def fail(self, where: str, exc: BaseException) -> None:
        """Record a hook error and switch tracing off for the rest of this process's life."""
        with self._lock:
            self.hook_errors += 1
            first = self.enabled
            self.enabled = False
            self.disabled_reason = f"{where}: {type(exc).__name__}: {exc}"
        if first:
            logger.error("hs_tracer: error in %s, tracing switched off; serving continues", where,
                         exc_info=exc)
        try:
            self.write_report()
        except Exception:  # the report is best effort; the tracer is already off
            logger.debug("hs_tracer: could not write the report after a failure", exc_info=True)

    def write_report(self) -> None:
        """Write this process's status to ``HS_TRACER_REPORT_DIR``, if set (export/report_file.py)."""
        if self.config.report_dir is None:
            return
        if self._report_file is None:
            self._report_file = ReportFile(self.config.report_dir, os.getpid())
        self._report_file.write(self.status())

    def log_startup_findings(self) -> None:
        """The startup findings in the scheduler log, one line per root cause (its findings' codes in
        brackets; the report and ``--verbose`` output list them one by one)."""
        for r in group(self.static_findings):
            codes = ", ".join(sorted({self.static_findings[i].code.value for i in r.findings}))
            fix = f"; fix: {r.fix}" if r.fix else ""
            logger.warning("hs_tracer: root cause [%s] %s%s [%s]", r.severity.value, r.summary, fix, codes)

    def trained_sources(self) -> tuple[list[str] | None, Finding | None]:
        """The profile's trained sources, or (for a profile of another model) the finding that says
        so, with the profile left unused (:func:`hs_tracer.profile.model.other_model`, the rule for
        every engine). Nothing without ``HS_TRACER_PROFILE``."""
        if self.config.profile is None:
            return None, None
        try:
            profile = Profile.load(self.config.profile)
        except (ProfileError, OSError, ValueError) as exc:  # serving and the other checks go on without it
            self.profile_fits = False
            return None, Finding(Code.PROFILE_UNREADABLE, Severity.WARNING,
                                 f"HS_TRACER_PROFILE cannot be read: {exc}: nothing was compared with "
                                 "training (slots, acceptance)",
                                 "point HS_TRACER_PROFILE at a profile written by `hs-tracer profile build` "
                                 "and readable by the server's user")
        problem = other_model(profile.meta, hidden_size=self.target.get("hidden_size"),
                              num_layers=self.target.get("num_layers"),
                              draft_vocab=self.draft_config.get("draft_vocab_size"))
        if problem:
            self.profile_fits = False
            # a warning: what is served may well be right; it is the reference that cannot judge it
            return None, Finding(Code.PROFILE_MISMATCH, Severity.WARNING,
                                 f"HS_TRACER_PROFILE={self.config.profile}: {problem}: nothing was compared "
                                 "with training (slots, acceptance)", OTHER_MODEL_FIX)
        return list(profile.sources), None


S = TypeVar("S", bound=TracerState)


class Slot(Generic[S]):
    """The one tracer state of a process, and the guard that runs the engine's hooks against it."""

    def __init__(self) -> None:
        self.state: S | None = None

    def install(self, st: S) -> S:
        self.state = st
        return st

    def clear(self) -> None:
        """Forget the state (an adapter's uninstall): its recorder stops, and a hook still reachable
        from an engine object's bound reference finds no state and does nothing."""
        st, self.state = self.state, None
        if st is not None and st.recorder is not None:
            st.recorder.stop()

    def guarded(self, where: str) -> Callable[[F], F]:
        """Run a hook ``fn(state, *args)`` only while tracing is on; turn any exception into
        :meth:`TracerState.fail`. The wrapped hook returns None on every path, so it never changes
        the engine's arguments or results (SGLang's HookRegistry reads None as "no change")."""
        slot = self

        def decorate(fn: F) -> F:
            @functools.wraps(fn)
            def guard(*args: Any, **kwargs: Any) -> None:
                st = slot.state
                if st is None or not st.enabled:
                    return None
                try:
                    if st.config.fault_inject is not None and st.config.fault_here(where, st.tp_rank):
                        raise RuntimeError(f"fault injected by HS_TRACER_FAULT_INJECT={where}")
                    fn(st, *args, **kwargs)
                except Exception as exc:  # the tracer must never break serving
                    st.fail(where, exc)
                return None

            guard.__hs_tracer_where__ = where  # type: ignore[attr-defined]  # the name faults are injected by
            return guard  # type: ignore[return-value]

        return decorate


def asdict_or_none(obj: Any) -> Any:
    """A record of the report (ranks) as JSON, or None before startup set it."""
    return dataclasses.asdict(obj) if obj is not None else None

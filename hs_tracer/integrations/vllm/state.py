"""Per-process tracer state inside vLLM, and the fail-safe guard every hook runs under.

One :class:`TracerState` per vLLM process that runs a model. The hooks hand it what they read from
vLLM; it keeps the wiring, owns the fingerprint probe and the step path (the engine-neutral
pipeline: probe -> step log -> recorder thread -> export process), and writes the live report.

A hook that raises is counted, logged once and switches the tracer off; vLLM's own call then
proceeds exactly as if hs_tracer were not there.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from hs_tracer.config import TracerConfig
from hs_tracer.records import Ranks, WiringRecord

if TYPE_CHECKING:
    from hs_tracer.core.steps import StepPath
    from hs_tracer.diagnosis.findings import Finding
    from hs_tracer.export.recorder import Recorder
    from hs_tracer.export.report_file import ReportFile

logger = logging.getLogger("hs_tracer")

F = TypeVar("F", bound=Callable[..., Any])


class RequestRef:
    """A request as a step record names it (``rid``): vLLM's request id."""

    __slots__ = ("rid",)

    def __init__(self, rid: str) -> None:
        self.rid = rid


@dataclass
class TracerState:
    config: TracerConfig
    enabled: bool = True
    hook_errors: int = 0
    disabled_reason: str | None = None
    target: dict[str, Any] = field(default_factory=dict)
    aux: dict[str, Any] = field(default_factory=dict)
    draft: dict[str, Any] = field(default_factory=dict)
    draft_config: dict[str, Any] = field(default_factory=dict)
    spec_args: dict[str, Any] = field(default_factory=dict)
    wiring: WiringRecord | None = None
    static_findings: list[Finding] = field(default_factory=list)
    profile_fits: bool = True  # False: HS_TRACER_PROFILE is of another model and is not used
    ranks: Ranks | None = None
    emitting: bool = True  # False on tensor-parallel ranks other than 0
    steps: StepPath | None = None
    role: str = "null"
    recorder: Recorder | None = None
    capture: Any = None  # draft-input capture is not offered in vLLM yet
    proposing: Any = None  # the SchedulerOutput of the step whose drafts are being proposed
    # (request id, accept length) of the step vLLM's scheduler is accounting right now
    pending: list[tuple[str, int]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _report_file: ReportFile | None = None

    RING_SIZE: ClassVar[int] = 4096

    @property
    def dropped(self) -> int:
        return self.steps.dropped if self.steps is not None else 0

    @property
    def max_accept_length(self) -> int | None:
        n = self.spec_args.get("num_speculative_tokens")
        return n + 1 if n else None

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
        except Exception:  # best effort; the tracer is already off
            logger.debug("hs_tracer: could not write the report after a failure", exc_info=True)

    def finish_startup(self, wiring: WiringRecord, findings: list[Finding]) -> None:
        """The wiring is known: build the probe and the step path, start the recorder."""
        from hs_tracer.core.steps import StepPath
        from hs_tracer.export.recorder import Recorder
        from hs_tracer.fingerprint.probe import FingerprintProbe

        self.wiring, self.static_findings = wiring, findings
        for f in findings:
            logger.warning("hs_tracer: %s", f.one_line())
        self.ranks, self.emitting = _ranks()
        if self.emitting:
            r = self.ranks  # the line that proves the startup hook ran, as under SGLang
            logger.info("hs_tracer: tracing on (tp %d, pp %d, dp %d): %s feeds the draft %s (vllm ids %s "
                        "from %s); %d startup finding(s)", r.tp, r.pp, r.dp, wiring.target_arch,
                        ", ".join(wiring.sources) or "no aux hidden states", wiring.layers_to_capture,
                        wiring.layer_ids_key or "-", len(findings))
            slots = len(wiring.sources) if wiring.use_aux_hidden_state else 1
            probe = None
            if slots and wiring.hidden_size > 0:
                probe = FingerprintProbe(slots, wiring.hidden_size, self.target.get("device", "cpu"),
                                         ring_size=self.RING_SIZE, warmup_dtype=self.target.get("dtype"))
            # one window stream: vLLM hands the draft prefill and decode rows in one batch
            self.steps = StepPath(probe, probe, self.config.window_tokens, self.ranks, self.config.queue_size)
            self.recorder = Recorder(self)  # type: ignore[arg-type]  # the state the recorder reads
            self.recorder.start()
        self.write_report()

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "pid": os.getpid(),
            "engine": "vllm",
            "enabled": self.enabled,
            "emitting": self.emitting,
            "hook_errors": self.hook_errors,
            "disabled_reason": self.disabled_reason,
            "dropped_records": self.dropped,
            "hooks_applied": _applied(),
            "target": self.target_json(),
            "draft": self.draft,
            "aux": self.aux,
            "wiring": _asdict(self.wiring),
            "ranks": _asdict(self.ranks),
            "role": self.role,
            "probes": None if self.steps is None else {
                "decode": self.steps.decode is not None, "decode_steps": self.steps.decode_steps},
            "export": None if self.recorder is None else self.recorder.where(),
            "recorder_thread_cpu_s": None if self.recorder is None else self.recorder.cpu_json(),
        }
        overhead = self.recorder.overhead_json() if self.recorder is not None else None
        if overhead is not None:  # in-thread analysis; else the export process adds it to the report
            out["overhead"] = overhead
        diagnosis = self.recorder.report_json() if self.recorder is not None else None
        if diagnosis is not None:
            out["diagnosis"] = diagnosis
        elif self.static_findings:
            out["diagnosis"] = {"findings": [f.to_json() for f in self.static_findings]}
        return out

    def target_json(self) -> dict[str, Any]:
        return {k: v for k, v in self.target.items() if k not in ("device", "dtype")}

    def write_report(self) -> None:
        """This process's status to ``HS_TRACER_REPORT_DIR``, if set (export/report_file.py)."""
        if self.config.report_dir is None:
            return
        if self._report_file is None:
            from hs_tracer.export.report_file import ReportFile

            self._report_file = ReportFile(self.config.report_dir, os.getpid())
        self._report_file.write(self.status())


def _ranks() -> tuple[Ranks, bool]:
    """This process's ranks, and whether it emits: tensor-parallel rank 0 of each data-parallel
    replica (TP ranks see the same tensors). Read lazily: vLLM sets its groups up before the model."""
    from vllm.distributed import parallel_state as ps

    def rank(read: Callable[[], Any]) -> int:
        try:
            return int(read() or 0)
        except (AssertionError, AttributeError, RuntimeError):  # not initialised in this process
            return 0

    tp = rank(lambda: ps.get_tp_group().rank_in_group)
    pp = rank(lambda: ps.get_pp_group().rank_in_group)
    dp = rank(lambda: ps.get_dp_group().rank_in_group)
    return Ranks(tp=tp, pp=pp, dp=dp), tp == 0


def _asdict(obj: Any) -> Any:
    import dataclasses

    return dataclasses.asdict(obj) if obj is not None else None


def _applied() -> list[str]:
    from hs_tracer.integrations.vllm.patching import applied

    return applied()


_STATE: TracerState | None = None


def install(cfg: TracerConfig) -> TracerState:
    global _STATE
    _STATE = TracerState(cfg)
    return _STATE


def current() -> TracerState | None:
    return _STATE


def guarded(where: str) -> Callable[[F], F]:
    """Run a hook only while tracing is on; turn any exception into :meth:`TracerState.fail`. The
    wrapped hook returns None on every path and never changes vLLM's arguments or results."""

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def guard(*args: Any, **kwargs: Any) -> None:
            st = _STATE
            if st is None or not st.enabled:
                return None
            try:
                if st.config.fault_inject is not None and st.config.fault_here(where, lambda: _ranks()[0].tp):
                    raise RuntimeError(f"fault injected by HS_TRACER_FAULT_INJECT={where}")
                fn(st, *args, **kwargs)
            except Exception as exc:  # the tracer must never break serving
                st.fail(where, exc)
            return None

        guard.__hs_tracer_where__ = where  # type: ignore[attr-defined]
        return guard  # type: ignore[return-value]

    return decorate

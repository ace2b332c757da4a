"""Per-process tracer state inside vLLM, over the engine-neutral one (:mod:`hs_tracer.core.state`).

One :class:`TracerState` per vLLM process that runs a model. The hooks hand it what they read from
vLLM; it keeps the wiring, owns the fingerprint probe and the step path (the engine-neutral
pipeline: probe -> step log -> recorder thread -> export process), and writes the live report. No
draft-input capture in vLLM yet: ``capture`` stays None. With ``HS_TRACER_IDENTITY_EVERY`` on, the
identity sampler (:mod:`.identity`) measures which layer each draft-input slot carries.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from hs_tracer.config import TracerConfig
from hs_tracer.core import patching
from hs_tracer.core import state as core
from hs_tracer.core.recorder import Recorder
from hs_tracer.core.steps import StepPath
from hs_tracer.findings import Finding
from hs_tracer.fingerprint.probe import FingerprintProbe
from hs_tracer.records import Ranks, WiringRecord

if TYPE_CHECKING:
    from hs_tracer.integrations.vllm.identity import IdentitySampler

logger = logging.getLogger("hs_tracer")

F = TypeVar("F", bound=Callable[..., Any])


class RequestRef:
    """A request as a step record names it (``rid``): vLLM's request id."""

    __slots__ = ("rid",)

    def __init__(self, rid: str) -> None:
        self.rid = rid


@dataclass
class TracerState(core.TracerState):
    """A vLLM process that runs the model: the step whose drafts are proposed, the accounting in flight."""

    proposing: Any = None  # the SchedulerOutput of the step whose drafts are being proposed
    first_rows: list[int] = field(default_factory=list)  # its batch's rows at position 0
    # (request id, accept length) of the step vLLM's scheduler is accounting right now
    pending: list[tuple[str, int]] = field(default_factory=list)
    identity: IdentitySampler | None = None  # HS_TRACER_IDENTITY_EVERY: layer identity (identity.py)
    # Multi-process executor (hooks.after_schedule): the core's step counter and the accept lengths
    # it accounted since the last step (bounded: steps a worker never received are dropped oldest
    # first); the emitting worker's steps by the core's number, and accept lengths whose step it no
    # longer holds.
    seq: int = 0
    accounted: deque[tuple[int, list[tuple[str, int]]]] = field(default_factory=lambda: deque(maxlen=1024))
    received: dict[int, Any] = field(default_factory=dict)
    unjoined: int = 0

    @property
    def max_accept_length(self) -> int | None:
        n = self.spec_args.get("num_speculative_tokens")
        return n + 1 if n else None

    def tp_rank(self) -> int:
        """Read now, not at startup: a fault may name a rank before vLLM has set its groups up."""
        return _ranks()[0].tp

    def finish_startup(self, wiring: WiringRecord, findings: list[Finding]) -> None:
        """The wiring is known: build the probe and the step path, start the recorder."""
        self.wiring, self.static_findings = wiring, findings
        self.log_startup_findings()
        self.ranks, self.emitting = _ranks()
        if self.emitting:
            r = self.ranks  # the line that proves the startup hook ran, as under SGLang
            logger.info("hs_tracer: tracing on (tp %d, pp %d, dp %d): %s feeds the draft %s (vllm ids %s "
                        "from %s); %d startup finding(s)", r.tp, r.pp, r.dp, wiring.target_arch,
                        ", ".join(wiring.sources) or "no aux hidden states", wiring.layers_to_capture,
                        wiring.layer_id_source or "-", len(findings))
            slots = len(wiring.sources) if wiring.use_aux_hidden_state else 1
            probe = None
            if slots and wiring.hidden_size > 0:
                probe = FingerprintProbe(slots, wiring.hidden_size, self.target.get("device", "cpu"),
                                         ring_size=self.RING_SIZE, warmup_dtype=self.target.get("dtype"))
            # one window stream: vLLM hands the draft prefill and decode rows in one batch
            self.steps = StepPath(probe, probe, self.config.window_tokens, self.ranks, self.config.queue_size)
            self.recorder = Recorder(self)
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
            "hooks_applied": patching.applied(),
            "target": self.target_json(),
            "draft": self.draft,
            "aux": self.aux,
            "wiring": self.wiring_json(),
            "ranks": core.asdict_or_none(self.ranks),
            "role": self.role,
            "probes": None if self.steps is None else {
                "decode": self.steps.decode is not None, "decode_steps": self.steps.decode_steps},
            "export": None if self.recorder is None else self.recorder.where(),
            "recorder_thread_cpu_s": None if self.recorder is None else self.recorder.cpu_json(),
            "identity": None if self.identity is None else self.identity.status(),
            "unjoined_steps": self.unjoined,
        }
        return self.with_diagnosis(out)

    def target_json(self) -> dict[str, Any]:
        return {k: v for k, v in self.target.items() if k not in ("device", "dtype")}


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


SLOT: core.Slot[TracerState] = core.Slot()


def install(cfg: TracerConfig) -> TracerState:
    return SLOT.install(TracerState(cfg))


def current() -> TracerState | None:
    return SLOT.state


def guarded(where: str) -> Callable[[F], F]:
    """Run a hook only while tracing is on (:meth:`hs_tracer.core.state.Slot.guarded`): it never
    changes vLLM's arguments or results."""
    return SLOT.guarded(where)

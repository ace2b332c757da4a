"""The fake engine's tracer state: one rank, one window stream, the core's step path and recorder."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from hs_tracer.core import patching
from hs_tracer.core import state as core
from hs_tracer.core.recorder import Recorder
from hs_tracer.core.steps import StepPath
from hs_tracer.findings import Finding
from hs_tracer.fingerprint.probe import FingerprintProbe
from hs_tracer.records import Ranks, WiringRecord
from tests.fake_engine import NAME


@dataclass
class TracerState(core.TracerState):
    def tp_rank(self) -> int:
        return 0

    def finish_startup(self, wiring: WiringRecord, findings: list[Finding]) -> None:
        self.wiring, self.static_findings = wiring, findings
        self.ranks, self.emitting = Ranks(), True
        probe = FingerprintProbe(len(wiring.sources), wiring.hidden_size, "cpu", ring_size=self.RING_SIZE)
        self.steps = StepPath(probe, probe, self.config.window_tokens, self.ranks, self.config.queue_size)
        self.recorder = Recorder(self)
        self.recorder.start()
        self.write_report()

    def status(self) -> dict[str, Any]:
        return self.with_diagnosis({
            "pid": os.getpid(), "engine": NAME, "enabled": self.enabled, "hook_errors": self.hook_errors,
            "disabled_reason": self.disabled_reason, "hooks_applied": patching.applied(),
            "wiring": self.wiring_json(), "ranks": core.asdict_or_none(self.ranks),
            "export": None if self.recorder is None else self.recorder.where()})


SLOT: core.Slot[TracerState] = core.Slot()

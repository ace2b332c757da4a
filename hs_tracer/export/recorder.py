"""The background recorder: everything that must not run on SGLang's scheduler thread.

It takes :class:`~hs_tracer.records.StepRecord` objects off the tracer's bounded queue, tallies
acceptance, feeds the Prometheus and OpenTelemetry exporters, reads the fingerprint probe's
per-channel windows, runs the online diagnosis against ``HS_TRACER_PROFILE``, and keeps the live
report (the report JSON of docs/interfaces.md) that ``HS_TRACER_REPORT_DIR`` and ``hs-tracer demo`` show.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hs_tracer.diagnosis.findings import Acceptance, Code, Report
from hs_tracer.fingerprint.stats import ChannelStats

if TYPE_CHECKING:
    from hs_tracer.integrations.sglang.state import TracerState
    from hs_tracer.profile.model import Profile
    from hs_tracer.records import StepRecord

logger = logging.getLogger("hs_tracer")

REPORT_EVERY_S = 0.5  # how often the live report file is refreshed while steps arrive


@dataclass
class AcceptanceTally:
    """Counts over (request, verify step) pairs. ``accept_length`` includes the bonus token, so
    draft position ``i`` was accepted when ``accept_length - 1 > i``."""

    steps: int = 0
    accepted_tokens: int = 0  # sum of accept lengths
    per_position: list[int] = field(default_factory=list)

    def add(self, accept_lengths: list[int], num_draft_tokens: int,
            max_accept_length: int | None = None) -> None:
        """``max_accept_length`` (speculative_num_steps + 1) bounds the positions that can be
        accepted: with topk > 1 the tree has more draft tokens than that."""
        positions = max(num_draft_tokens - 1, 0)
        if max_accept_length is not None:
            positions = min(positions, max(max_accept_length - 1, 0))
        if len(self.per_position) < positions:
            self.per_position.extend([0] * (positions - len(self.per_position)))
        for length in accept_lengths:
            self.steps += 1
            self.accepted_tokens += length
            for i in range(min(length - 1, len(self.per_position))):
                self.per_position[i] += 1

    def summary(self) -> Acceptance | None:
        if not self.steps:
            return None
        return Acceptance(self.steps, self.accepted_tokens / self.steps,
                          [n / self.steps for n in self.per_position])


class Recorder(threading.Thread):
    """One per emitting scheduler process; a daemon thread so it never holds up SGLang's exit."""

    def __init__(self, st: TracerState) -> None:
        super().__init__(name="hs_tracer-recorder", daemon=True)
        self.st = st
        self.acceptance = AcceptanceTally()
        self.live: ChannelStats | None = None  # all windows so far
        self.window_reports: int = 0
        self.nonfinite: int = 0  # non-finite values in the draft input, all steps so far
        self._exported_findings: set[tuple[Any, ...]] = set()
        self.profile: Profile | None = None
        self.judged: Report | None = None  # the latest window's diagnosis against the profile
        self.report = Report(findings=list(st.static_findings))
        self._report_lock = threading.Lock()
        self._prom: Any = None
        self._otel: Any = None
        self._stopping = threading.Event()

    # ---- thread ------------------------------------------------------------------------------------
    def run(self) -> None:
        try:
            self._setup()
            last_report, dirty = 0.0, False
            while not self._stopping.is_set():
                try:
                    rec = self.st.queue.get(timeout=0.2)
                except queue.Empty:
                    rec = None
                if rec is not None:
                    self._on_step(rec)
                    dirty = True
                if self.st.capture is not None:
                    self.st.capture.poll()  # sampled draft inputs whose host copy completed -> disk
                dirty |= self._on_window()
                now = time.monotonic()
                # Refresh at most every REPORT_EVERY_S while steps arrive, and once more when they
                # stop, so the report always ends on the last step.
                if dirty and (rec is None or now - last_report > REPORT_EVERY_S):
                    self._export_health()
                    self.st.write_report()
                    last_report, dirty = now, False
        except Exception as exc:  # the recorder failing must not leave a half-working tracer
            self.st.fail("recorder", exc)
        finally:
            if self._prom is not None:
                self._prom.close()
            if self._otel is not None:
                self._otel.shutdown(timeout_s=2)

    def stop(self) -> None:
        self._stopping.set()

    def _setup(self) -> None:
        from hs_tracer.export.otel import OtelExporter, spans_configured
        from hs_tracer.export.prometheus import PrometheusExporter, metrics_port_for

        st, wiring = self.st, self.st.wiring
        assert wiring is not None and st.ranks is not None
        if st.config.fault_inject == "recorder":
            raise RuntimeError("fault injected by HS_TRACER_FAULT_INJECT=recorder")
        if st.config.profile is not None:
            from hs_tracer.profile.model import Profile

            self.profile = Profile.load(st.config.profile)
        self._prom = PrometheusExporter(wiring.model, st.ranks,
                                        port=metrics_port_for(st.ranks, st.config.metrics_port),
                                        addr=st.config.metrics_addr)
        self._prom.record_wiring(wiring)
        for f in st.static_findings:
            self._prom.record_finding(f)
        if spans_configured():
            self._otel = OtelExporter(wiring.model, st.ranks, sample=st.config.span_sample)
            self._otel.record_wiring(wiring)

    # ---- per record --------------------------------------------------------------------------------
    def _on_step(self, rec: StepRecord) -> None:
        self.acceptance.add(rec.accept_lengths, rec.num_draft_tokens, rec.max_accept_length)
        if self.st.capture is not None:
            self.st.capture.note_accept_lengths(rec.accept_lengths)
        if rec.digest is not None:
            self.nonfinite += sum(slot.nonfinite for slot in rec.digest.slots)
        self._prom.record_step(rec)
        self._prom.observe_host_overhead(rec.host_overhead_s)
        if self._otel is not None:
            self._otel.record_step(rec, rec.trace_ctxs)
        self._judge()

    def _on_window(self) -> bool:
        """Fold a finished fingerprint window in and re-diagnose. True if the report changed.

        Which rows: decode verify rows and prefill rows without position 0
        (integrations/sglang/steps.py says why)."""
        steps = self.st.steps
        source = None if steps is None else (steps.decode or steps.prefill)
        if source is None:
            return False
        window = source.probe.read_window()
        if window is None:
            return False
        self.live = window if self.live is None else self.live.merge(window)
        self.window_reports += 1
        self._diagnose(window)
        return True

    def _diagnose(self, window: ChannelStats) -> None:
        """Judge everything seen so far against the profile (the wiring does not change while a
        process runs, so more tokens only sharpen the verdict); the drift score is the latest
        window's."""
        from hs_tracer.diagnosis.identity import diagnose_detailed

        if self.profile is None or self.live is None:
            return
        width = self.st.steps.input_width if self.st.steps is not None else None
        detailed = diagnose_detailed(self.live, self.profile, nonfinite=self.nonfinite, width=width)
        judged = detailed.report
        # Drift score per slot, the diagnosis's own (docs/diagnosis.md), of this window alone;
        # the drift alert uses it.
        latest = detailed if window is self.live else diagnose_detailed(
            window, self.profile, nonfinite=0, width=width)
        drift = [m.drift_score for m in latest.matches]
        self._prom.record_slots(judged.slots, drift)
        if self._otel is not None:
            self._otel.record_slots(judged.slots)
        self.judged = judged
        self._judge()

    def _judge(self) -> None:
        """The verdict over static findings, the latest window and acceptance so far
        (:func:`hs_tracer.diagnosis.verdict.live_report`); new findings go to Prometheus once."""
        from hs_tracer.diagnosis.verdict import live_report

        # the static checks compared the engine's own layers_to_capture with the profile at startup
        report = live_report(self.st.static_findings, self.judged, self.acceptance.summary(), self.profile,
                             self.st.draft_config, engine_layers_checked=self.profile is not None)
        static = {(f.code, f.slot) for f in self.st.static_findings}
        for f in report.findings:
            key = (f.code, f.slot, None if f.code is Code.ACCEPTANCE_DROP else f.observed)
            if (f.code, f.slot) not in static and key not in self._exported_findings:
                self._exported_findings.add(key)
                self._prom.record_finding(f)
        with self._report_lock:
            self.report = report

    def _export_health(self) -> None:
        st = self.st
        self._prom.record_health(dropped=st.dropped, hook_errors=st.hook_errors, enabled=st.enabled,
                                 spans_dropped=self._otel.dropped if self._otel is not None else None)

    # ---- report ------------------------------------------------------------------------------------
    def report_json(self) -> dict[str, Any]:
        with self._report_lock:
            out = self.report.to_json()
        out["windows"] = self.window_reports
        out["profile"] = str(self.st.config.profile) if self.st.config.profile else None
        return out


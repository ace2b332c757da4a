"""What becomes of the verify steps: acceptance, Prometheus, OpenTelemetry spans, the online diagnosis
and the live report of one scheduler process.

:class:`Analysis` is fed :class:`~hs_tracer.export.batch.StepBatch` es and diagnosis windows and never
touches SGLang. It runs in hs_tracer's export process (``export/process.py``), so none of its Python
takes the scheduler's GIL; only while SGLang's own request tracing is on does it run in the
scheduler process's recorder thread (request events go through SGLang's trace contexts, which live
there). Its input, :class:`ExportSetup`, is plain data for that reason.

Cadence (:meth:`Analysis.work`): batches are worked off as they come; the online diagnosis against
``HS_TRACER_PROFILE`` runs at most every ``DIAGNOSE_EVERY_S`` (windows closed in between are merged,
none is lost; an idle wake-up diagnoses at once); the report is refreshed at most every
``REPORT_EVERY_S`` while steps arrive, and once more when they stop, so it always ends on the last step.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from hs_tracer.diagnosis.identity import diagnose_detailed
from hs_tracer.diagnosis.report import Report
from hs_tracer.diagnosis.same_token import EXACT_TOLERANCE, MeasuredSlot, explain, identify
from hs_tracer.diagnosis.verdict import judge_slots, live_report
from hs_tracer.export.batch import step_digest
from hs_tracer.export.digest_join import DigestJoin
from hs_tracer.export.otel import OtelExporter, spans_configured
from hs_tracer.export.prometheus import PrometheusExporter, metrics_port_for
from hs_tracer.findings import Acceptance, Code, Finding
from hs_tracer.fingerprint.stats import DIGEST_FIELDS, ChannelStats
from hs_tracer.profile.model import Profile
from hs_tracer.records import Ranks, WiringRecord

if TYPE_CHECKING:
    from hs_tracer.export.batch import StepBatch

logger = logging.getLogger("hs_tracer")

REPORT_EVERY_S = 0.5  # how often the live report is refreshed while steps arrive
DIAGNOSE_EVERY_S = 1.0  # the online diagnosis runs at most this often while steps arrive
DIGESTS_KEPT = 8192  # digests waiting for their step's result (steps in flight are a few)
IDENTITY_ROWS = 64  # same-token identity: the latest rows kept (several sampled forwards pooled)
_NONFINITE = DIGEST_FIELDS.index("nonfinite")


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
        self._grow(num_draft_tokens, max_accept_length)
        for length in accept_lengths:
            self.steps += 1
            self.accepted_tokens += length
            for i in range(min(length - 1, len(self.per_position))):
                self.per_position[i] += 1

    def add_counts(self, counts: np.ndarray, num_draft_tokens: int,
                   max_accept_length: int | None = None) -> None:
        """:meth:`add` for many request-steps at once: ``counts[v]`` request-steps had accept length
        ``v`` (:func:`length_counts`), so a batch costs a few operations whatever its size."""
        self._grow(num_draft_tokens, max_accept_length)
        by_length = counts.tolist()  # a few entries (accept lengths are small): plain Python is cheapest
        self.steps += sum(by_length)
        self.accepted_tokens += sum(length * n for length, n in enumerate(by_length))
        at_least = 0  # request-steps whose accept length is at least `length`; position i needs i + 2
        for length in range(len(by_length) - 1, 1, -1):
            at_least += by_length[length]
            if length - 2 < len(self.per_position):
                self.per_position[length - 2] += at_least

    def _grow(self, num_draft_tokens: int, max_accept_length: int | None) -> None:
        positions = max(num_draft_tokens - 1, 0)
        if max_accept_length is not None:
            positions = min(positions, max(max_accept_length - 1, 0))
        if len(self.per_position) < positions:
            self.per_position.extend([0] * (positions - len(self.per_position)))

    def summary(self) -> Acceptance | None:
        if not self.steps:
            return None
        return Acceptance(self.steps, self.accepted_tokens / self.steps,
                          [n / self.steps for n in self.per_position])


BINCOUNT_BELOW = 8192
"""Batches of fewer request-steps are counted with one ``np.bincount``; larger ones with one
comparison per accept-length value, which is cheaper there and runs without the GIL."""
MAX_COMPARED_LENGTH = 64  # accept lengths are at most speculative_num_steps + 1


def length_counts(lengths: np.ndarray) -> np.ndarray:
    """``counts[v]``: how many of ``lengths`` equal ``v`` (values below 1 count as 0)."""
    if not lengths.size:
        return np.zeros(1, dtype=np.int64)
    if lengths.size < BINCOUNT_BELOW:
        return np.bincount(np.maximum(lengths, 0))
    top = int(lengths.max())
    if top > MAX_COMPARED_LENGTH:
        return np.bincount(np.maximum(lengths, 0))
    at_least = [lengths.size] + [int(np.count_nonzero(lengths >= v)) for v in range(1, top + 1)] + [0]
    return -np.diff(np.asarray(at_least, dtype=np.int64))


@dataclass(frozen=True)
class ExportSetup:
    """What the exporters and the diagnosis know about one scheduler process, fixed at its startup.
    Plain data: it crosses to the export process as JSON (:meth:`to_json`)."""

    wiring: WiringRecord
    ranks: Ranks
    static_findings: list[Finding]
    draft_config: dict[str, Any]
    profile: Path | None
    span_sample: float
    metrics_port: int | None
    metrics_addr: str
    kernel_gpu_s: float | None = None  # the fingerprint kernel's GPU time per step, timed at warm-up
    identity_off: str | None = None  # why same-token identity is not measured here (None: it is)

    def to_json(self) -> dict[str, Any]:
        return {"wiring": self.wiring.to_json(), "ranks": asdict(self.ranks),
                "static_findings": [f.to_json() for f in self.static_findings],
                "draft_config": self.draft_config, "profile": str(self.profile) if self.profile else None,
                "span_sample": self.span_sample, "metrics_port": self.metrics_port,
                "metrics_addr": self.metrics_addr, "kernel_gpu_s": self.kernel_gpu_s,
                "identity_off": self.identity_off}

    def checks_off(self, profile: Profile | None) -> dict[str, str]:
        """The checks that cannot run in this process, each with the reason (``profile``: the loaded
        reference profile, None without a usable one). A server with any is partly unwatched: the
        metric ``hs_tracer_check_active`` and its alert say so."""
        unusable = next((f.code.value for f in self.static_findings
                         if f.code in (Code.PROFILE_MISMATCH, Code.PROFILE_UNREADABLE)), None)
        off: dict[str, str] = {}
        if profile is None:
            off["slots"] = off["acceptance"] = unusable or "no_profile"
        elif profile.expected_acceptance is None:
            off["acceptance"] = "profile_without_expected_acceptance"
        if self.identity_off is not None:
            off["identity"] = self.identity_off
        return off

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ExportSetup:
        return cls(wiring=WiringRecord.from_json(d["wiring"]), ranks=Ranks(**d["ranks"]),
                   static_findings=Report.from_json({"findings": d["static_findings"]}).findings,
                   draft_config=d["draft_config"], profile=Path(d["profile"]) if d["profile"] else None,
                   span_sample=d["span_sample"], metrics_port=d["metrics_port"],
                   metrics_addr=d["metrics_addr"], kernel_gpu_s=d.get("kernel_gpu_s"),
                   identity_off=d.get("identity_off"))


@dataclass
class OwnCost:
    """What hs_tracer added to the scheduler process, summed over the verify steps exported so far:
    the per-step hooks' host time (the scheduler thread), the recorder thread's CPU time (same
    process, same GIL), and with ``kernel_gpu_s`` the fingerprint kernel's GPU time per step."""

    steps: int = 0
    hook_s: float = 0.0
    thread_cpu_s: float = 0.0
    scheduler_delay_s: float = 0.0

    def add(self, batch: StepBatch) -> None:
        self.steps += len(batch)
        self.hook_s += float(batch.host_s.sum())
        self.thread_cpu_s += batch.thread_cpu_s
        self.scheduler_delay_s += batch.scheduler_delay_s

    def to_json(self, kernel_gpu_s: float | None) -> dict[str, Any]:
        """Per-step figures in µs (None before the first step); ``total_us_per_step`` adds the three
        parts, the GPU part only where it was measured (CUDA)."""
        n = self.steps

        def per_step(seconds: float | None) -> float | None:
            return None if not n or seconds is None else round(seconds / n * 1e6, 3)

        host = self.hook_s + self.thread_cpu_s
        kernel = None if kernel_gpu_s is None else round(kernel_gpu_s * 1e6, 3)
        total = per_step(host)
        return {"verify_steps": n, "hook_us_per_step": per_step(self.hook_s),
                "thread_cpu_us_per_step": per_step(self.thread_cpu_s),
                "host_us_per_step": total, "kernel_gpu_us_per_step": kernel,
                "total_us_per_step": None if total is None else round(total + (kernel or 0.0), 3),
                # what serving loses: hooks + the steps' measured wait for the recorder + GPU time
                "scheduler_delay_us_per_step": per_step(self.scheduler_delay_s),
                "serving_us_per_step": None if not n else round(
                    (self.hook_s + self.scheduler_delay_s) / n * 1e6 + (kernel or 0.0), 3),
                "thread_cpu_seconds": round(self.thread_cpu_s, 6)}


@dataclass(frozen=True)
class Health:
    """The tracer's own health in the scheduler process (cumulative counts)."""

    dropped: int = 0  # verify steps the recorder fell too far behind to take
    hook_errors: int = 0
    enabled: bool = True
    input_width: int | None = None  # the draft input's width, last seen


class Analysis:
    """Exporters and online diagnosis for one scheduler process (module docstring).

    ``request_events``: where to hand events for SGLang's request traces (the scheduler thread's
    outbox); None in the export process, where batches carry no requests.
    """

    def __init__(self, setup: ExportSetup,
                 request_events: Callable[[list[tuple[Any, dict[str, Any]]]], Any] | None = None) -> None:
        self.setup = setup
        self.acceptance = AcceptanceTally()
        self.live: ChannelStats | None = None  # all windows so far
        self.window_reports = 0
        self.nonfinite = 0  # non-finite values in the draft input, all steps so far
        self.profile: Profile | None = None
        self.judged: Report | None = None  # the latest diagnosis against the profile
        self.measured: list[MeasuredSlot] | None = None  # the latest same-token identity of the slots
        self.report = Report(findings=list(setup.static_findings))
        self.health = Health()
        self._request_events = request_events
        self._exported_findings: set[tuple[Any, ...]] = set()
        self._report_lock = threading.Lock()
        self._prom: Any = None
        self._otel: Any = None
        self._digests = DigestJoin(DIGESTS_KEPT)
        self._fresh: ChannelStats | None = None  # windows folded in since the last diagnosis
        self._diagnosed_at = -DIAGNOSE_EVERY_S
        self.identity_samples = 0
        self._identity_pool: tuple[list[str], np.ndarray, np.ndarray] | None = None
        self._reported_at = 0.0
        self._dirty = False
        self.cost = OwnCost()
        self.checks_off: dict[str, str] = {}  # check -> why it is off here (ExportSetup.checks_off)

    def start(self) -> None:
        """Load the profile and start the exporters (Prometheus serves from here on)."""
        s = self.setup
        if s.profile is not None:
            self.profile = Profile.load(s.profile)
        port = metrics_port_for(s.ranks, s.metrics_port)
        self._prom = PrometheusExporter(s.wiring.model, s.ranks, port=port, addr=s.metrics_addr,
                                        engine=s.wiring.engine)
        self._prom.record_wiring(s.wiring)
        expected = self.profile.expected_acceptance if self.profile is not None else None
        if expected is not None:
            steps = s.wiring.spec_args.get("speculative_num_steps")
            self._prom.record_expected_accept_length(
                expected.accept_length(int(steps) if steps else expected.num_steps))
        for f in s.static_findings:
            self._prom.record_finding(f)
        if s.kernel_gpu_s is not None:
            self._prom.record_kernel_gpu(s.kernel_gpu_s)
        self._prom.record_root_causes(self.report.root_causes())  # a startup miswiring pages before traffic
        self.checks_off = s.checks_off(self.profile)
        self._prom.record_checks(self.checks_off)
        if self.checks_off:
            logger.warning("hs_tracer: not checked in this process: %s", "; ".join(
                f"{check} ({reason})" for check, reason in self.checks_off.items()))
        if spans_configured():
            self._otel = OtelExporter(s.wiring.model, s.ranks, sample=s.span_sample)
            self._otel.record_wiring(s.wiring)

    def close(self) -> None:
        """Flush and stop the exporters (spans still queued after 2 s are lost)."""
        if self._prom is not None:
            self._prom.close()
        if self._otel is not None:
            self._otel.shutdown(timeout_s=2)

    # ---- one wake-up -------------------------------------------------------------------------------
    def work(self, batches: Sequence[StepBatch], window: ChannelStats | None, health: Health,
             between: Callable[[], Any] | None = None) -> bool:
        """Work off ``batches`` and the ``window`` read since the last call (``between`` runs between
        two batches). True when the report was refreshed (time to write it out)."""
        for i, batch in enumerate(batches):
            if i and between is not None:
                between()
            self.on_batch(batch, last=i == len(batches) - 1)
        got = bool(batches)
        self.health = health
        self._dirty |= got
        self._dirty |= self.on_window(window, force=not got)
        now = time.monotonic()
        if self._dirty and (not got or now - self._reported_at > REPORT_EVERY_S):
            self.refresh()
            self._reported_at, self._dirty = now, False
            return True
        return False

    def mark_dirty(self) -> None:
        """Something outside the steps changed (health): refresh the report at the next wake-up."""
        self._dirty = True

    def on_batch(self, batch: StepBatch, last: bool = True) -> None:
        """One pass over the batch, a fixed number of numpy calls; step records (with their digests,
        found by step number) only for the steps that get a span, and, with SGLang's request tracing,
        every step (its events need one). Non-finite counts and the slot RMS gauge come from the
        digests drained with the batch (the gauge from the latest, in a wake-up's last batch)."""
        hidden = self.setup.wiring.hidden_size
        raws = batch.digest_raws
        self._digests.add(batch.digest_steps, batch.digest_tokens, raws)
        nonfinite_counts = raws[:, :, _NONFINITE].sum(axis=0).astype(np.int64).tolist() if raws.size else []
        bad: list[int] = []
        if any(nonfinite_counts):  # spans for every step with non-finite features
            bad = np.flatnonzero(np.isin(batch.steps, self._digests.steps_with(_NONFINITE))).tolist()
        digest = None
        if last and raws.size:
            digest = step_digest((int(batch.digest_tokens[-1]), raws[-1]), hidden)
        counts = length_counts(batch.lengths)
        otel = self._otel
        if otel is not None:
            sampled = otel.sampled_steps(len(batch), bad)
            tracing = batch.requests is not None and self._request_events is not None
            for i in range(len(batch)) if tracing else sampled:
                rec = batch.record(i, self.setup.ranks, hidden, self._digests.find(int(batch.steps[i])))
                otel.record_step(rec, rec.trace_ctxs, sampled=i in sampled, deliver=self._request_events)
        self._prom.record_scheduler_delay(batch.scheduler_delay_s)
        self._prom.record_batch(len(batch), counts, batch.draft_tokens(), int(batch.time_unix_ns[-1]),
                                batch.input_width, digest, nonfinite_counts, batch.host_s.tolist(),
                                thread_cpu_s=batch.thread_cpu_s)
        self.cost.add(batch)
        self.nonfinite += sum(nonfinite_counts)
        # last: a reader that sees the tally grow finds the batch in the metrics too
        self.acceptance.add_counts(counts, int(batch.num_draft_tokens[-1]), batch.max_accept_length)

    def on_window(self, window: ChannelStats | None, force: bool = True) -> bool:
        """Fold a finished fingerprint window in; re-diagnose when ``DIAGNOSE_EVERY_S`` has passed
        since the last diagnosis, or at once when ``force``. True if the diagnosis changed.

        Which rows: decode verify rows and prefill rows without position 0
        (core/steps.py says why)."""
        if window is not None:  # one merge per landed window; the running total grows per diagnosis
            self._fresh = window if self._fresh is None else self._fresh.merge(window)
            self.window_reports += 1
        if self._fresh is None:
            return False
        now = time.monotonic()
        if not force and now - self._diagnosed_at < DIAGNOSE_EVERY_S:
            return False
        fresh, self._fresh, self._diagnosed_at = self._fresh, None, now
        self.live = fresh if self.live is None else self.live.merge(fresh)
        self._diagnose(fresh)
        return True

    def on_identity(self, names: Sequence[str], candidates: np.ndarray, slots: np.ndarray) -> None:
        """One sampled forward's rows (``candidates`` [S, R, D] named by ``names``, ``slots``
        [R, K, D]): pooled with the latest samples of the same candidates, then each slot is named by
        what its rows equal (:func:`hs_tracer.diagnosis.same_token.identify`, exact tolerance: inside
        the engine slot and candidate rows are the same tensors' values)."""
        names = list(names)
        if not names or slots.size == 0:
            return
        pool = self._identity_pool
        if pool is not None and pool[0] == names and pool[2].shape[1:] == slots.shape[1:]:
            candidates = np.concatenate([pool[1], candidates], axis=1)[:, -IDENTITY_ROWS:]
            slots = np.concatenate([pool[2], slots], axis=0)[-IDENTITY_ROWS:]
        self._identity_pool = (names, candidates, slots)
        self.identity_samples += 1
        rows = torch.from_numpy(np.array(slots, dtype=np.float32))
        cands = {n: torch.from_numpy(np.array(candidates[i], dtype=np.float32))
                 for i, n in enumerate(names)}
        # a slot fed none of the layers: of the channel transforms only a constant scale survives the
        # projection (a norm, a sublayer output or a shard of the channels is not among the candidates)
        self.measured = [explain(m, rows[:, m.index], cands, shards=False)
                         for m in identify(rows, cands, EXACT_TOLERANCE)]
        self._dirty = True

    def _diagnose(self, window: ChannelStats) -> None:
        """Judge everything seen so far against the profile (the wiring does not change while a
        process runs, so more tokens only sharpen the verdict); the drift score is that of the
        windows closed since the previous diagnosis."""
        if self.profile is None or self.live is None:
            return
        width = self.health.input_width
        detailed = diagnose_detailed(self.live, self.profile, nonfinite=self.nonfinite, width=width)
        judged = detailed.report
        # Drift score per slot, the diagnosis's own (docs/diagnosis.md), of the fresh windows
        # alone; the drift alert uses it.
        latest = detailed if window is self.live else diagnose_detailed(
            window, self.profile, nonfinite=0, width=width)
        drift = [m.drift_score for m in latest.matches]
        slots, _ = judge_slots(self.setup.static_findings, judged, self.measured,  # as the report names them
                               dict(enumerate(self.profile.sources)), engine_layers_checked=True)
        margins = {v.index: v.margin for v in judged.slots if v.margin is not None}
        self._prom.record_slots(slots, drift, margins)
        if self._otel is not None:
            self._otel.record_slots(slots)
        self.judged = judged

    def refresh(self) -> None:
        """The verdict over static findings, the latest diagnosis and acceptance so far
        (:func:`hs_tracer.diagnosis.verdict.live_report`); new findings go to Prometheus once; the
        health metrics follow."""
        s = self.setup
        # the static checks compared the engine's own layers_to_capture with the profile at startup
        report = live_report(s.static_findings, self.judged, self.acceptance.summary(), self.profile,
                             s.draft_config, engine_layers_checked=self.profile is not None,
                             measured=self.measured, engine=s.wiring.engine,
                             engine_version=s.wiring.engine_version)
        static = {(f.code, f.slot) for f in s.static_findings}
        for f in report.findings:
            key = (f.code, f.slot, None if f.code is Code.ACCEPTANCE_DROP else f.observed)
            if (f.code, f.slot) not in static and key not in self._exported_findings:
                self._exported_findings.add(key)
                self._prom.record_finding(f)
        self._prom.record_root_causes(report.root_causes())
        with self._report_lock:
            self.report = report
        h = self.health
        self._prom.record_health(dropped=h.dropped, hook_errors=h.hook_errors, enabled=h.enabled,
                                 spans_dropped=self._otel.dropped if self._otel is not None else None)

    def add_thread_cpu(self, seconds: float, delay_s: float = 0.0) -> None:
        """CPU seconds of the scheduler process's recorder thread, attributed to the steps of the
        batches just worked off (``thread`` mode, where this analysis runs in that thread), and
        what that work measurably delayed the steps (export/step_delay.py)."""
        self.cost.thread_cpu_s += seconds
        self.cost.scheduler_delay_s += delay_s
        self._prom.record_thread_cpu(seconds)
        self._prom.record_scheduler_delay(delay_s)

    def overhead_json(self) -> dict[str, Any]:
        """The ``overhead`` block of the live report: hs_tracer's own cost per verify step."""
        return self.cost.to_json(self.setup.kernel_gpu_s)

    def report_json(self) -> dict[str, Any]:
        """The ``diagnosis`` block of the live report (docs/interfaces.md)."""
        with self._report_lock:
            out = self.report.to_json()
        out["windows"] = self.window_reports
        out["profile"] = str(self.setup.profile) if self.setup.profile else None
        out["checks_off"] = dict(self.checks_off)
        out["measured_identity"] = None if self.measured is None else {
            "samples": self.identity_samples, "slots": [m.to_json() for m in self.measured]}
        return out


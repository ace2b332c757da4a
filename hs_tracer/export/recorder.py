"""The background recorder: everything that must not run on SGLang's scheduler thread.

Every ``BATCH_INTERVAL_S`` it takes the verify steps the scheduler thread handed over
(:class:`~hs_tracer.integrations.sglang.steps.PendingStep`) and works them off as one batch: digests
joined by step number, acceptance tallied with numpy, Prometheus updated once per batch (the
host-overhead histogram gets every step's value), OpenTelemetry spans for the sampled steps only
(records are built for those, and for every step while SGLang's request tracing is on, whose events
go back to the scheduler thread to be attached). It reads the fingerprint probe's per-channel
windows, runs the online diagnosis against ``HS_TRACER_PROFILE`` at most every ``DIAGNOSE_EVERY_S``
(windows closed in between are merged, none is lost; an idle wake-up diagnoses at once), and keeps
the live report (the report JSON of docs/interfaces.md) that ``HS_TRACER_REPORT_DIR`` and
``hs-tracer demo`` show.

Why batches: the recorder shares the scheduler's GIL, so every microsecond of Python it runs is a
microsecond the scheduler thread may wait. Waking once per step (a queue hand-off) and doing
per-step Python cost the scheduler 110-2000 µs per step on the H200 host; one wake-up per batch
with numpy over the batch, worked off in short chunks that hand the GIL back, costs it a fraction
of that (benchmarks/hook_overhead.py measures it; docs/fingerprint.md has the numbers).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from operator import attrgetter
from typing import TYPE_CHECKING, Any

import numpy as np

from hs_tracer.diagnosis.findings import Acceptance, Code, Report
from hs_tracer.fingerprint.stats import DIGEST_FIELDS, ChannelStats
from hs_tracer.integrations.sglang.steps import committed_lengths

if TYPE_CHECKING:
    from hs_tracer.integrations.sglang.state import TracerState
    from hs_tracer.integrations.sglang.steps import PendingStep
    from hs_tracer.profile.model import Profile

logger = logging.getLogger("hs_tracer")

REPORT_EVERY_S = 0.5  # how often the live report file is refreshed while steps arrive
BATCH_INTERVAL_S = 0.05  # the recorder wakes at this period and works off everything pending
DIAGNOSE_EVERY_S = 1.0  # the online diagnosis runs at most this often while steps arrive
# A long batch is worked off in chunks with a short sleep between them. A thread holding the GIL
# keeps it for up to sys.getswitchinterval() (5 ms by default) once another thread asks for it, so
# a long batch in one go would hold up the scheduler thread, waking from its wait on the GPU, for
# the batch's full length; a real sleep (not sleep(0), which the same thread can win back) hands
# the GIL over at once, and the recorder gets it back when the scheduler next waits for the GPU, so
# each chunk tends to run in such a wait. A chunk costs a fixed few tens of µs plus ~1 µs per step
# (the per-request work, numpy and torch, runs without the GIL): 64 steps keep a chunk near 100 µs.
CHUNK_STEPS = 64
YIELD_S = 50e-6
_NONFINITE = DIGEST_FIELDS.index("nonfinite")
_NUM_DRAFT_TOKENS, _HOST_S = attrgetter("num_draft_tokens"), attrgetter("host_s")


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

    def add_counts(self, counts: np.ndarray, num_draft_tokens: int,
                   max_accept_length: int | None = None) -> None:
        """:meth:`add` for many request-steps at once: ``counts[v]`` request-steps had accept length
        ``v`` (:func:`length_counts`), so a batch costs a few operations whatever its size."""
        positions = max(num_draft_tokens - 1, 0)
        if max_accept_length is not None:
            positions = min(positions, max(max_accept_length - 1, 0))
        if len(self.per_position) < positions:
            self.per_position.extend([0] * (positions - len(self.per_position)))
        by_length = counts.tolist()  # a few entries (accept lengths are small): plain Python is cheapest
        self.steps += sum(by_length)
        self.accepted_tokens += sum(length * n for length, n in enumerate(by_length))
        at_least = 0  # request-steps whose accept length is at least `length`; position i needs i + 2
        for length in range(len(by_length) - 1, 1, -1):
            at_least += by_length[length]
            if length - 2 < len(self.per_position):
                self.per_position[length - 2] += at_least

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
        self._fresh: ChannelStats | None = None  # windows folded in since the last diagnosis
        self._diagnosed_at = -DIAGNOSE_EVERY_S

    # ---- thread ------------------------------------------------------------------------------------
    def run(self) -> None:
        try:
            self._setup()
            last_report, dirty = 0.0, False
            while not self._stopping.wait(BATCH_INTERVAL_S):
                got = self._on_steps()
                dirty |= got
                if self.st.capture is not None:
                    self.st.capture.poll()  # sampled draft inputs whose host copy completed -> disk
                dirty |= self._on_window(force=not got)
                now = time.monotonic()
                # Refresh at most every REPORT_EVERY_S while steps arrive, and once more when they
                # stop, so the report always ends on the last step.
                if dirty and (not got or now - last_report > REPORT_EVERY_S):
                    self._judge()
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

    # ---- per batch ---------------------------------------------------------------------------------
    def _on_steps(self) -> bool:
        """Work off every step handed over since the last wake-up. True if there was one."""
        steps = self.st.steps
        if steps is None:
            return False
        items = steps.take_pending()
        if not items:
            return False
        for start in range(0, len(items), CHUNK_STEPS):
            if start:
                time.sleep(YIELD_S)  # let the scheduler thread have the GIL between chunks
            self._on_batch(items[start:start + CHUNK_STEPS], last_chunk=start + CHUNK_STEPS >= len(items))
        return True

    def _on_batch(self, items: list[PendingStep], last_chunk: bool = True) -> None:
        """One pass over the batch: a fixed number of numpy calls, per step only list operations;
        records only for the steps an exporter needs one by one. The last step's digest (the slot
        RMS gauge) is built for the batch's last chunk only."""
        steps, otel, capture = self.st.steps, self._otel, self.st.capture
        assert steps is not None
        digests = steps.claim_raws(items)
        landed = [i for i, d in enumerate(digests) if d is not None]
        bad: list[int] = []
        nonfinite_counts: list[int] = []
        digest = None
        if landed:
            raws = np.concatenate([digests[i][1] for i in landed])  # type: ignore[index]
            per_step = raws[:, _NONFINITE].reshape(len(landed), -1)  # [landed steps, K]
            nonfinite_counts = per_step.sum(axis=0).tolist()
            if any(nonfinite_counts):
                bad = [landed[j] for j in np.flatnonzero(per_step.any(axis=1)).tolist()]
            if last_chunk and steps.decode is not None:
                digest = steps.decode.probe.digest_of(*digests[landed[-1]])  # type: ignore[misc]
        last = items[-1]
        uniform = len(set(map(_NUM_DRAFT_TOKENS, items))) == 1
        lengths, sizes = committed_lengths(items, sizes=not uniform)
        counts = length_counts(lengths)
        if capture is not None:
            for item in items:
                capture.note_accept_lengths(item.lengths())
        if otel is not None:
            # Spans for the sampled steps; request events need a record of every step while SGLang
            # traces requests.
            sampled = otel.sampled_steps(len(items), bad)
            tracing = otel.request_tracing()
            for i in range(len(items)) if tracing else sampled:
                rec = steps.to_record(items[i], digests[i], requests=tracing)
                otel.record_step(rec, rec.trace_ctxs, sampled=i in sampled, deliver=steps.outbox.extend)
        self.acceptance.add_counts(counts, last.num_draft_tokens, last.max_accept_length)
        self.nonfinite += sum(nonfinite_counts)
        width = next((item.input_width for item in reversed(items) if item.input_width is not None), None)
        if sizes is None:
            draft_tokens = lengths.size * max(last.num_draft_tokens - 1, 0)
        else:
            draft_tokens = sum(n * (item.num_draft_tokens - 1)
                               for n, item in zip(sizes.tolist(), items, strict=True)
                               if item.num_draft_tokens > 1)
        self._prom.record_batch(len(items), counts, draft_tokens, last.time_unix_ns, width, digest,
                                nonfinite_counts, list(map(_HOST_S, items)))

    def _on_window(self, force: bool = True) -> bool:
        """Fold finished fingerprint windows in; re-diagnose when ``DIAGNOSE_EVERY_S`` has passed
        since the last diagnosis, or at once when ``force``. True if the report changed.

        Which rows: decode verify rows and prefill rows without position 0
        (integrations/sglang/steps.py says why)."""
        steps = self.st.steps
        source = None if steps is None else (steps.decode or steps.prefill)
        if source is None:
            return False
        window = source.probe.read_window()
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

    def _diagnose(self, window: ChannelStats) -> None:
        """Judge everything seen so far against the profile (the wiring does not change while a
        process runs, so more tokens only sharpen the verdict); the drift score is that of the
        windows closed since the previous diagnosis."""
        from hs_tracer.diagnosis.identity import diagnose_detailed

        if self.profile is None or self.live is None:
            return
        width = self.st.steps.input_width if self.st.steps is not None else None
        detailed = diagnose_detailed(self.live, self.profile, nonfinite=self.nonfinite, width=width)
        judged = detailed.report
        # Drift score per slot, the diagnosis's own (docs/diagnosis.md), of the fresh windows
        # alone; the drift alert uses it.
        latest = detailed if window is self.live else diagnose_detailed(
            window, self.profile, nonfinite=0, width=width)
        drift = [m.drift_score for m in latest.matches]
        self._prom.record_slots(judged.slots, drift)
        if self._otel is not None:
            self._otel.record_slots(judged.slots)
        self.judged = judged

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


"""The recorder thread: the part of hs_tracer's background work that has to stay in SGLang's scheduler
process, kept as small as it can be.

It wakes periodically, takes the verify steps the scheduler thread logged
(:class:`~hs_tracer.export.step_log.StepLog`) and the fingerprint digests drained meanwhile as step
batches (:class:`~hs_tracer.export.batch.StepBatch`: a fixed number of slice copies and numpy calls
whatever their number; the analysis joins digests to steps), reads the diagnosis
window the probe has landed, polls the capture sink, and hands all of it on. Where it goes
(:func:`export_mode`):

* ``process`` (the default): to hs_tracer's export process (``export/process.py``) through a pipe.
  While steps flow, the thread wakes once per hand-off, at most every ``FORWARD_EVERY_S`` and sooner
  when the step rate would fill half the step log or digest ring before then; each wake-up sends
  everything pending as one batch and the diagnosis windows that landed, straight from the probe's
  snapshot slots (freed after the write; the export process adds them up), in one write. While idle,
  and while draft-input capture is on (``HS_TRACER_CAPTURE_DIR``: copied inputs wait in a queue of a
  few for this thread to write them), it wakes every ``BATCH_INTERVAL_S``. Why so few wake-ups:
  each one, and each call in it that releases the GIL (the accept-length join, the pipe write),
  makes this thread take the GIL back from a scheduler thread that is running Python, which costs
  this thread tens to hundreds of µs of CPU on a VM host and the scheduler thread a forced switch;
  a wake-up every 50 ms cost more than all the batching it did (benchmarks/hook_overhead.py breaks
  the recorder's CPU down). The analysis runs in the export process, on its own interpreter.
* ``thread`` (``HS_TRACER_EXPORT=thread``, and always while SGLang's request tracing is on: events on
  its request traces go through trace contexts that live in the scheduler process): to an
  :class:`~hs_tracer.export.analysis.Analysis` in this thread every ``BATCH_INTERVAL_S``, in batches
  of ``CHUNK_STEPS``: acceptance, Prometheus, OpenTelemetry spans, the online diagnosis and the live
  report.

Why so little here: this thread shares the scheduler's GIL, so every microsecond of Python it runs
is a microsecond the scheduler thread may wait. Waking once per step and doing per-step Python cost
the scheduler 110-2000 µs per step on the H200 host; batches worked off with numpy cost it ~10-25 µs
per step with the exporters in this process, and the batching alone a small fraction of that
(benchmarks/hook_overhead.py measures it; docs/fingerprint.md has the numbers).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping, Sequence, Sized
from typing import TYPE_CHECKING, Any, Protocol

from hs_tracer.export.analysis import Analysis, ExportSetup, Health
from hs_tracer.export.batch import Scratch, StepBatch
from hs_tracer.export.otel import OtelExporter
from hs_tracer.export.process import ExportProcess
from hs_tracer.export.step_delay import StepDelay, drain

if TYPE_CHECKING:
    from hs_tracer.config import TracerConfig
    from hs_tracer.findings import Finding
    from hs_tracer.fingerprint.probe import FingerprintProbe
    from hs_tracer.fingerprint.stats import ChannelStats
    from hs_tracer.records import Ranks, WiringRecord

logger = logging.getLogger("hs_tracer")


# ---- what the recorder needs from the scheduler side (an engine adapter's tracer state) ----------
class ProbeSource(Protocol):
    probe: FingerprintProbe


class StepSource(Protocol):
    """The scheduler thread's step path: the verify steps it logged and the digests it drained."""

    log: Sized
    outbox: Any  # request events the OTel exporter adds to SGLang's request traces (``extend``)
    forward_after: int  # steps logged before a hand-off is due (half the log or digest ring)
    step_clock: deque[float]  # a clock reading per decode step (export/step_delay.py)
    input_width: int | None
    decode: ProbeSource | None
    prefill: ProbeSource | None

    def take_batch(self, *, requests: bool, scratch: Scratch | None) -> StepBatch | None: ...


class IdentitySample(Protocol):
    """One sampled forward's rows (hs_tracer/core/identity.py): candidates [S, R, D] named by
    ``sources``, the draft-input slots [R, K, D]."""

    sources: list[str]
    candidates: Any
    slots: Any


class IdentitySource(Protocol):
    def landed(self) -> list[IdentitySample]: ...


class CaptureSource(Protocol):
    def poll(self) -> None: ...

    def note_accept_lengths(self, lengths: Any) -> None: ...


class SchedulerSide(Protocol):
    """What the recorder reads and calls of the process it runs in: settings, the startup wiring,
    the step path and capture sink, the tracer's health, and where to report."""

    config: TracerConfig
    wiring: WiringRecord | None
    ranks: Ranks | None
    static_findings: Sequence[Finding]
    draft_config: Mapping[str, Any]
    steps: StepSource | None
    capture: CaptureSource | None
    dropped: int
    hook_errors: int
    enabled: bool
    profile_fits: bool
    identity_off: str | None

    def fail(self, where: str, exc: BaseException) -> None: ...

    def write_report(self) -> None: ...

    def status(self) -> dict[str, Any]: ...

BATCH_INTERVAL_S = 0.05
"""``thread`` mode: the recorder wakes at this period and works off everything pending; ``process``
mode: its period while no steps arrive."""
FORWARD_EVERY_S = 0.5
"""``process`` mode: while steps flow, the recorder wakes and hands them to the export process this
often (sooner when the step rate would fill half the step log or digest ring first,
:attr:`StepSource.forward_after`). The export process refreshes
the report and diagnoses no more often than this anyway."""
# A long backlog is worked off in chunks with a short sleep between them. A thread holding the GIL
# keeps it for up to sys.getswitchinterval() (5 ms by default) once another thread asks for it, so
# a long backlog in one go would hold up the scheduler thread, waking from its wait on the GPU, for
# its full length; a real sleep (not sleep(0), which the same thread can win back) hands the GIL
# over at once, and the recorder gets it back when the scheduler next waits for the GPU, so each
# chunk tends to run in such a wait.
CHUNK_STEPS = 64
YIELD_S = 50e-6
STATUS_EVERY_S = 2.0  # the export process gets this process's status at most this often while steps arrive


def export_mode(st: SchedulerSide) -> str:
    """``process`` or ``thread`` (module docstring): the configured mode, except that SGLang's
    request tracing keeps the exporters in this process."""
    if st.config.export == "process" and OtelExporter.request_tracing():
        logger.info("hs_tracer: SGLang traces requests in this process; hs_tracer's exporters run in "
                    "the scheduler process so they can add events to those traces")
        return "thread"
    return st.config.export


def export_setup(st: SchedulerSide, probe: FingerprintProbe | None = None) -> ExportSetup:
    """The exporters' fixed facts; ``probe``: the decode probe, whose kernel GPU time per step was
    measured when it was warmed."""
    assert st.wiring is not None and st.ranks is not None
    c = st.config
    return ExportSetup(wiring=st.wiring, ranks=st.ranks, static_findings=list(st.static_findings),
                       draft_config=dict(st.draft_config),
                       profile=c.profile if st.profile_fits else None, span_sample=c.span_sample,
                       metrics_port=c.metrics_port, metrics_addr=c.metrics_addr,
                       kernel_gpu_s=getattr(probe, "kernel_gpu_s", None),
                       identity_off="HS_TRACER_IDENTITY_EVERY=0" if c.identity_every == 0
                       else st.identity_off)


class Recorder(threading.Thread):
    """One per emitting scheduler process; a daemon thread so it never holds up SGLang's exit."""

    def __init__(self, st: SchedulerSide) -> None:
        super().__init__(name="hs_tracer-recorder", daemon=True)
        self.st = st
        self.mode = export_mode(st)
        self.analysis: Analysis | None = None  # ``thread`` mode
        self.export: ExportProcess | None = None  # ``process`` mode
        self._stopping = threading.Event()
        self._sent_health: Health | None = None
        self._status_at = 0.0
        self._scratch = Scratch()  # ``process``: where accept lengths are joined
        self._since = 0.0  # ``process``: the steps waiting were logged since then (hand-off or idle wake-up)
        # This thread's CPU time (time.thread_time, read around each wake-up and once more where a
        # batch's share is attributed): not yet attributed to steps, of wake-ups that handed steps
        # over; totals of those and of idle wake-ups (no step waiting).
        self._cpu_busy = 0.0
        self._wake_cpu = time.thread_time()  # at the start of this wake-up, or where it attributed
        self.cpu_busy_s = 0.0
        self.cpu_idle_s = 0.0
        self._took = False  # this wake-up took a batch of steps
        self.delay = StepDelay()  # what this thread's work costs the steps, measured on them

    # ---- thread ------------------------------------------------------------------------------------
    def run(self) -> None:
        try:
            self._setup()
            # Everything this thread does in a wake-up (batching, status, pipe writes; in ``thread``
            # mode the exporters and the diagnosis) is CPU time in the scheduler process under its
            # GIL. A few clock reads per wake-up, never per step: a wake-up that hands steps over
            # attributes its CPU so far to them (:meth:`_attribute`); what it spends after that goes
            # with the next batch. Wake-ups with no step waiting (no decode step running to slow
            # down) are counted apart, and startup not at all.
            interval = BATCH_INTERVAL_S
            while not self._stopping.wait(interval):
                self._wake_cpu = time.thread_time()
                start = time.perf_counter()
                if self.st.steps is not None:
                    self.delay.steps(drain(self.st.steps.step_clock))
                interval = self._wake()
                if self._took:
                    self.delay.busy(start, time.perf_counter())
                rest = time.thread_time() - self._wake_cpu
                if self._took:
                    self._cpu_busy += rest
                    self.cpu_busy_s += rest
                else:
                    self.cpu_idle_s += rest
                self._took = False
        except Exception as exc:  # the recorder failing must not leave a half-working tracer
            self.st.fail("recorder", exc)
        finally:
            if self.analysis is not None:
                self.analysis.close()
            if self.export is not None:
                self.export.close()

    def stop(self) -> None:
        self._stopping.set()

    def _setup(self) -> None:
        st = self.st
        faulted = st.config.fault_inject is not None and \
            st.config.fault_here("recorder", lambda: st.ranks.tp if st.ranks else 0)
        if faulted:
            raise RuntimeError("fault injected by HS_TRACER_FAULT_INJECT=recorder")
        setup = export_setup(st, self._probe())
        if self.mode == "process":
            try:
                self.export = ExportProcess.start(setup, st.config.report_dir)
                return
            except OSError as exc:  # no interpreter to start, no processes left, ...: export from here
                logger.warning("hs_tracer: cannot start the export process (%s); the exporters run in the "
                               "scheduler process instead, as with HS_TRACER_EXPORT=thread", exc)
                self.mode = "thread"
        steps = st.steps
        self.analysis = Analysis(setup, request_events=steps.outbox.extend if steps is not None else None)
        self.analysis.start()

    def _wake(self) -> float:
        """One wake-up: everything handed over since the last one, to the export process or the
        in-thread analysis. Returns the seconds until the next."""
        if self.export is not None:
            return self._forward()
        assert self.analysis is not None
        batches = list(self._batches())
        self._poll_capture()
        for sample in self._identity():
            self.analysis.on_identity(sample.sources, sample.candidates, sample.slots)
        if self.analysis.work(batches, self._read_window(), self._health(), between=_yield):
            self.st.write_report()
        if batches:
            self.analysis.add_thread_cpu(self._attribute(), self.delay.take())
        return BATCH_INTERVAL_S

    def _attribute(self) -> float:
        """This thread's CPU time to attribute to the steps being handed over: what earlier
        hand-offs spent after attributing theirs, and this wake-up's so far."""
        now = time.thread_time()
        cpu = self._cpu_busy + (now - self._wake_cpu)
        self.cpu_busy_s += now - self._wake_cpu
        self._cpu_busy, self._wake_cpu, self._took = 0.0, now, True
        return cpu

    def _forward(self) -> float:
        """Everything logged since the last hand-off as one batch, the windows that landed (as the
        probe's snapshot slots hold them: the export process adds them up) and (when it changed, or
        every ``STATUS_EVERY_S`` while steps arrive) this process's status, down the pipe in one
        write. Returns the seconds until the next wake-up (module docstring)."""
        export = self.export
        assert export is not None
        probe = self._probe()
        windows = probe.landed_windows() if probe is not None else []
        try:
            self._poll_capture()
            steps = self.st.steps
            waiting = len(steps.log) if steps is not None else 0
            now = time.monotonic()
            since, self._since = now - self._since, now
            export.check()  # also while idle: a death after the last hand-off must still switch tracing off
            health = self._health()
            samples = self._identity()
            for sample in samples:  # a few kB each, one in HS_TRACER_IDENTITY_EVERY prefills
                export.queue_identity(sample.sources, sample.candidates, sample.slots)
            if not (waiting or windows or samples or health != self._sent_health):
                return BATCH_INTERVAL_S
            batches = list(self._batches(chunk=None))  # one batch: most of a batch's cost is fixed
            status = None
            if health != self._sent_health or (batches and now - self._status_at > STATUS_EVERY_S):
                status = self.st.status()
            if batches:  # the steps carry this thread's CPU so far, the status just built included
                batches[0].thread_cpu_s = self._attribute()
                batches[0].scheduler_delay_s = self.delay.take()
            for batch in batches:
                export.queue_batch(batch)
            for _slot, window in windows:  # written from the slots' own memory
                export.queue_window(window)
            if status is not None:
                export.queue_status(status, health)
                self._sent_health, self._status_at = health, now
            export.flush()
        finally:
            if windows:
                probe.release_windows([slot for slot, _window in windows])
        if not waiting or steps is None or self.st.capture is not None:
            return BATCH_INTERVAL_S  # capture on: its few copied inputs wait for this thread to write them
        # the steps of the next interval, at this rate, fill at most half of what may wait
        rate = waiting / max(since, BATCH_INTERVAL_S)
        if rate * FORWARD_EVERY_S <= 0.5 * steps.forward_after:
            return FORWARD_EVERY_S
        return max(BATCH_INTERVAL_S, 0.5 * steps.forward_after / rate)

    def _health(self) -> Health:
        st = self.st
        return Health(dropped=st.dropped, hook_errors=st.hook_errors, enabled=st.enabled,
                      input_width=st.steps.input_width if st.steps is not None else None)

    def _identity(self) -> list[IdentitySample]:
        """Identity samples whose host copy landed (none without a sampler)."""
        sampler: IdentitySource | None = getattr(self.st, "identity", None)
        return sampler.landed() if sampler is not None else []

    def _poll_capture(self) -> None:
        if self.st.capture is not None:
            self.st.capture.poll()  # sampled draft inputs whose host copy completed -> disk

    def _batches(self, chunk: int | None = CHUNK_STEPS) -> Iterator[StepBatch]:
        """The steps logged so far, ``chunk`` to a batch (None: all in one), with the digests
        drained meanwhile (they travel with the first batch)."""
        steps, capture = self.st.steps, self.st.capture
        if steps is None:
            return
        # the export process's batches are written before the next is joined: one scratch serves all
        batch = steps.take_batch(requests=self.analysis is not None and _request_tracing(),
                                 scratch=self._scratch if self.export is not None else None)
        if batch is None:
            return
        if capture is not None:
            for lengths in batch.step_lengths():
                capture.note_accept_lengths(lengths)
        if chunk is None or len(batch) <= chunk:
            yield batch
            return
        yield from batch.split(chunk)

    def _probe(self) -> FingerprintProbe | None:
        """The probe whose windows feed the diagnosis (decode, else prefill), or None."""
        steps = self.st.steps
        source = None if steps is None else (steps.decode or steps.prefill)
        return source.probe if source is not None else None

    def _read_window(self) -> ChannelStats | None:
        probe = self._probe()
        return probe.read_window() if probe is not None else None

    # ---- report ------------------------------------------------------------------------------------
    def where(self) -> dict[str, Any]:
        """Where the exporters run: ``{"mode": "process", "pid": ...}`` or ``{"mode": "thread"}``."""
        if self.export is not None:
            return {"mode": "process", "pid": self.export.proc.pid}
        return {"mode": self.mode}

    def cpu_json(self) -> dict[str, float]:
        """This thread's CPU seconds so far, in wake-ups that handed steps over (the per-step figure's
        source) and in idle ones (no step waiting, so no decode step to slow down)."""
        return {"handing_over": round(self.cpu_busy_s, 6), "idle": round(self.cpu_idle_s, 6)}

    def overhead_json(self) -> dict[str, Any] | None:
        """hs_tracer's own cost per verify step (:meth:`Analysis.overhead_json`), when the analysis
        runs in this process (else the export process adds it to the report)."""
        return self.analysis.overhead_json() if self.analysis is not None else None

    def report_json(self) -> dict[str, Any] | None:
        """The diagnosis block of this process's report, when the analysis runs in this process
        (else the export process writes the report)."""
        return self.analysis.report_json() if self.analysis is not None else None


def _yield() -> None:
    time.sleep(YIELD_S)  # let the scheduler thread have the GIL between chunks


def _request_tracing() -> bool:
    return OtelExporter.request_tracing()

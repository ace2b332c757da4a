"""Prometheus metrics of one SGLang scheduler process (prefix ``hs_tracer_``).

Every metric is defined once, in :class:`_Metrics`, with its help text as its documentation;
docs/metrics.md is the reference for users (units, labels, PromQL).

Design choices, and why:

* Acceptance is exported as **counters** (verify steps, drafts, draft tokens, accepted tokens,
  accepted tokens per draft position) plus an accept-length histogram, so that rates aggregate
  correctly across ranks, instances and time windows with ``rate()`` / ``sum``. SGLang's own
  ``sglang:spec_accept_length`` is a gauge of per-interval averages and cannot be re-aggregated.
* ``prometheus_client`` is imported only when an exporter is created, inside the scheduler process
  and from the recorder thread, never at plugin load: an early import in SGLang's main process fixes
  the value class before ``PROMETHEUS_MULTIPROC_DIR`` is set and breaks SGLang's tokenizer metrics.
* With ``PROMETHEUS_MULTIPROC_DIR`` set (SGLang ``--enable-metrics``) the values go to the shared
  mmap files and appear on SGLang's own ``/metrics``; gauges therefore carry an explicit
  ``multiprocess_mode`` and no series is ever removed (multiprocess mode cannot remove children).
  Otherwise hs_tracer serves its own ``/metrics`` on :func:`metrics_port_for`.
* Labels are bounded: model and ranks everywhere, plus slot index, canonical source names, draft
  position, finding code/severity. Never request ids.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from bisect import bisect_left
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from hs_tracer import engines
from hs_tracer.config import TracerConfig
from hs_tracer.findings import Finding, SlotVerdict
from hs_tracer.fingerprint.stats import StepDigest
from hs_tracer.records import Ranks, StepRecord, WiringRecord

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from hs_tracer.diagnosis.causes import RootCause

logger = logging.getLogger("hs_tracer")

# Metric names, each defined here once: the dashboards, alert rules and PromQL import them.
# prometheus_client adds `_total` to counters and `_bucket`/`_sum`/`_count` to histograms.
VERIFY_STEPS = "hs_tracer_verify_steps"
DRAFTS = "hs_tracer_drafts"
DRAFT_TOKENS = "hs_tracer_draft_tokens"
ACCEPTED_TOKENS = "hs_tracer_accepted_tokens"
ACCEPTED_PER_POSITION = "hs_tracer_accepted_tokens_per_position"
ACCEPT_LENGTH = "hs_tracer_accept_length"
SLOT_MATCH_SCORE = "hs_tracer_slot_match_score"
SLOT_MISMATCH = "hs_tracer_slot_mismatch"
SLOT_MATCH_MARGIN = "hs_tracer_slot_match_margin"
SLOT_MEASURED_ERROR = "hs_tracer_slot_measured_error"
SLOT_MEASURED_RUNNER_UP_ERROR = "hs_tracer_slot_measured_runner_up_error"
SLOT_DRIFT_SCORE = "hs_tracer_slot_drift_score"
SLOT_RMS = "hs_tracer_slot_rms"
SLOT_NONFINITE = "hs_tracer_slot_nonfinite_values"
DRAFT_INPUT_WIDTH = "hs_tracer_draft_input_width"
LAST_STEP_TIMESTAMP = "hs_tracer_last_step_timestamp_seconds"
WIRING_INFO = "hs_tracer_wiring_info"
FINDINGS = "hs_tracer_findings"
ROOT_CAUSE_INFO = "hs_tracer_root_cause_info"
CHECK_ACTIVE = "hs_tracer_check_active"
RECORDS_DROPPED = "hs_tracer_records_dropped"
HOOK_ERRORS = "hs_tracer_hook_errors"
SPANS_DROPPED = "hs_tracer_spans_dropped"
ENABLED = "hs_tracer_enabled"
HOST_OVERHEAD = "hs_tracer_host_overhead_seconds"
THREAD_CPU = "hs_tracer_thread_cpu_seconds"
SCHEDULER_DELAY = "hs_tracer_scheduler_delay_seconds"
KERNEL_GPU = "hs_tracer_fingerprint_kernel_gpu_seconds"
EXPECTED_ACCEPT_LENGTH = "hs_tracer_expected_accept_length"
START_TIME = "hs_tracer_start_time_seconds"

CHECKS = ("slots", "acceptance", "identity")
"""The checks :data:`CHECK_ACTIVE` reports on, each on or off with a reason."""

MAX_ROOT_CAUSE_SERIES = 16
"""Distinct root-cause label sets one process publishes at most (multiprocess mode cannot remove a
series, so each stays)."""

DEFAULT_BASE_PORT = 9464
"""Base of hs_tracer's own metrics port (the OpenTelemetry Prometheus-exporter convention)."""

BASE_LABELS = ("model", "engine", "tp_rank", "pp_rank", "dp_rank", "attn_dp_rank")
"""Labels on every hs_tracer metric: the served model, the serving engine (its registry name,
:mod:`hs_tracer.engines`) and the scheduler's ranks (``dp_rank`` the data-parallel replica,
``attn_dp_rank`` the attention-DP rank inside it)."""

ACCEPT_LENGTH_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16)
"""Accept lengths are integers >= 1 (the bonus token included); ``le="1"`` counts full rejections."""

OVERHEAD_BUCKETS = (5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 1e-2)
"""Host overhead per step in seconds; the per-step hook budget is 25 µs."""

DEFAULT_FLUSH_INTERVAL_S = 0.5
"""Steps are summed and pushed to the metrics at most this often (scrapes are seconds apart)."""

_GAUGE_MODE = "mostrecent"
"""Multiprocess mode of every gauge: the value last set, whichever process set it. Each series
carries its scheduler's ranks, so no two processes write the same series."""


def metrics_port_for(ranks: Ranks, base: int | None = None) -> int:
    """hs_tracer's own metrics port for one scheduler process: ``base + tp + 8*pp + 64*dp``, ``dp``
    the DP replica. With DP attention the emitting ranks of one replica already differ in ``tp``
    (``tp_rank = attn_dp_rank * attn_tp_size + attn_tp_rank``).

    Unique per process on one host as long as tp < 8 per pp stage and tp*pp stages < 64 per DP
    replica, which covers 8-GPU hosts. ``base`` is ``HS_TRACER_METRICS_PORT`` (default 9464).
    """
    return (DEFAULT_BASE_PORT if base is None else base) + ranks.tp + 8 * ranks.pp + 64 * ranks.dp


def multiprocess_dir() -> str | None:
    """The prometheus_client multiprocess directory this process really writes to, if any.

    The env var alone is not enough: prometheus_client picks its value class at import, so a process
    that imported it before the variable was set writes to memory. Then we serve our own endpoint.
    """
    # prometheus_client still honours the legacy lower-case name.
    path = os.environ.get("PROMETHEUS_MULTIPROC_DIR") or os.environ.get("prometheus_multiproc_dir")  # noqa: SIM112
    if not path:
        return None
    from prometheus_client import values

    if values.ValueClass is values.MutexValue:
        logger.warning(
            "hs_tracer: PROMETHEUS_MULTIPROC_DIR is set but prometheus_client was imported before it "
            "was; hs_tracer metrics go to its own port instead of SGLang's /metrics. Fix: set the "
            "variable before the process starts (SGLang --enable-metrics does this for schedulers).")
        return None
    return path


class _Metrics:
    """Every hs_tracer metric, defined once. The help strings are the metric documentation."""

    def __init__(self, registry: CollectorRegistry) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        base = BASE_LABELS
        kw: dict[str, Any] = {"registry": registry}
        gauge_kw: dict[str, Any] = {"registry": registry, "multiprocess_mode": _GAUGE_MODE}

        # --- acceptance (counters: aggregate with rate() and sum across ranks) -------------------
        self.verify_steps = Counter(
            VERIFY_STEPS, "Batched verify passes seen (one per scheduler step with "
            "speculation, whatever the batch size).", base, **kw)
        self.drafts = Counter(
            DRAFTS, "Request-level verifications: one per request per verify step "
            "(vLLM's num_drafts). Mean accept length = 1 + accepted_tokens / drafts.", base, **kw)
        self.draft_tokens = Counter(
            DRAFT_TOKENS, "Draft tokens proposed: per request per verify step, SGLang's "
            "speculative_num_draft_tokens - 1 (as SGLang's own spec_accept_rate counts them).",
            base, **kw)
        self.accepted_tokens = Counter(
            ACCEPTED_TOKENS, "Draft tokens accepted (the bonus token excluded): "
            "accept_length - 1 per request per verify step.", base, **kw)
        self.accepted_per_position = Counter(
            ACCEPTED_PER_POSITION, "Accepted draft tokens at draft position "
            "`position` (0-based): position i counts a request-step when accept_length - 1 > i. "
            "Divided by drafts it is the unconditional per-position acceptance rate.",
            (*base, "position"), **kw)
        self.accept_length = Histogram(
            ACCEPT_LENGTH, "Accept length per request per verify step, in tokens, the "
            "bonus token included (1 = every draft token rejected).", base,
            buckets=ACCEPT_LENGTH_BUCKETS, **kw)

        # --- per-slot features of the draft input ------------------------------------------------
        self.slot_match_score = Gauge(
            SLOT_MATCH_SCORE, "Similarity (0..1) of the slot's live features to the "
            "reference profile of `observed_source`, the best-matching canonical source; "
            "`expected_source` is what the draft was trained on. A superseded observed_source series "
            "is set to NaN (series cannot be removed in multiprocess mode).",
            (*base, "slot", "expected_source", "observed_source"), **gauge_kw)
        self.slot_mismatch = Gauge(
            SLOT_MISMATCH, "1 if the slot's observed source differs from the source the "
            "draft was trained on (a wiring mismatch), else 0.", (*base, "slot"), **gauge_kw)
        self.slot_match_margin = Gauge(
            SLOT_MATCH_MARGIN, "Score gap between the best and the second-best matching "
            "source of the slot (how sure the identification is).", (*base, "slot"), **gauge_kw)
        self.slot_measured_error = Gauge(
            SLOT_MEASURED_ERROR, "Relative error of the slot's rows against the rows of the source it "
            "was measured to carry, on the same tokens (same-token identity; 0 = equal). Absent until a "
            "sampled forward was measured.", (*base, "slot"), **gauge_kw)
        self.slot_measured_runner_up_error = Gauge(
            SLOT_MEASURED_RUNNER_UP_ERROR, "Relative error of the slot's rows against the nearest other "
            "candidate source on the same tokens: how far the measured identification is from the next "
            "answer (what a whole layer adds). Absent until a sampled forward was measured.",
            (*base, "slot"), **gauge_kw)
        self.slot_drift = Gauge(
            SLOT_DRIFT_SCORE, "Drift of the slot's live per-channel feature statistics "
            "from the reference profile of its expected source over the last diagnosis window "
            "(0 = identical; see docs/metrics.md for the scale).", (*base, "slot"), **gauge_kw)
        self.slot_rms = Gauge(
            SLOT_RMS, "RMS of the slot's finite draft-input values in the last verify "
            "step seen (unitless, hidden-state scale).", (*base, "slot"), **gauge_kw)
        self.slot_nonfinite = Counter(
            SLOT_NONFINITE, "Non-finite (NaN/Inf) values seen in the slot's draft "
            "input.", (*base, "slot"), **kw)
        self.input_width = Gauge(
            DRAFT_INPUT_WIDTH, "Width (columns) of the draft's input features in the "
            "last verify step: K*H with aux hidden states, H without.", base, **gauge_kw)
        self.last_step_time = Gauge(
            LAST_STEP_TIMESTAMP, "Unix time of the last verify step exported; "
            "a stale value means the producer stopped, not that all is well.", base, **gauge_kw)

        # --- wiring (static, read at startup) ----------------------------------------------------
        self.wiring_info = Gauge(
            WIRING_INFO, "Wiring of target hidden states into the draft as read at "
            "startup; value 1 for the current wiring, 0 for a superseded one. Lists are "
            "comma-separated in slot order.",
            (*base, "target_arch", "num_layers", "hidden_size", "layers_to_capture",
             "configured_layer_ids", "sources", "expected_width", "draft_fc_in_features",
             "draft_graph_width", "use_aux_hidden_state", "sglang_version", "engine_version"), **gauge_kw)

        # --- findings ------------------------------------------------------------------------------
        self.findings = Counter(
            FINDINGS, "Findings raised, by stable finding code and severity.",
            (*base, "code", "severity"), **kw)

        self.root_cause = Gauge(
            ROOT_CAUSE_INFO, "One series per root cause of the current report, value 1 (0 once it is no "
            "longer one): `cause` its kind, `severity`, `wiring` (true when it changes what the draft "
            "is fed), `summary` what is wrong and `fix` what to do. The alerts page on it.",
            (*base, "cause", "severity", "wiring", "summary", "fix"), **gauge_kw)
        self.check_active = Gauge(
            CHECK_ACTIVE, "1 while the check `check` (slots: live slot sources against training; "
            "acceptance: live against expected acceptance; identity: same-token measurement) runs in this "
            "process, 0 while it is off, with `reason` saying why (empty while it runs).",
            (*base, "check", "reason"), **gauge_kw)

        # --- tracer health -------------------------------------------------------------------------
        self.records_dropped = Counter(
            RECORDS_DROPPED, "Step records dropped because the recorder queue was full "
            "(the scheduler never waits on hs_tracer).", base, **kw)
        self.hook_errors = Counter(
            HOOK_ERRORS, "Exceptions caught inside hs_tracer hooks (each switches "
            "tracing off; serving continues).", base, **kw)
        self.spans_dropped = Counter(
            SPANS_DROPPED, "hs_tracer step spans dropped: export queue full or the "
            "collector unreachable/slow.", base, **kw)
        self.enabled = Gauge(
            ENABLED, "1 while tracing is on in this scheduler, 0 after it switched itself "
            "off.", base, **gauge_kw)
        self.start_time = Gauge(
            START_TIME, "Unix time hs_tracer started exporting in this scheduler process: a new value "
            "is a restart or a redeploy (the dashboard's annotations).", base, **gauge_kw)
        self.expected_accept_length = Gauge(
            EXPECTED_ACCEPT_LENGTH, "Mean accept length (bonus token included) the draft reaches on its "
            "own training data at the served number of draft steps, measured when the reference profile "
            "was built: the level a correctly wired draft should reach. Absent without a profile that "
            "carries it.", base, **gauge_kw)
        self.host_overhead = Histogram(
            HOST_OVERHEAD, "Host (CPU) time the per-step hooks added to the "
            "scheduler thread, per verify step, in seconds.", base, buckets=OVERHEAD_BUCKETS, **kw)
        self.thread_cpu = Counter(
            THREAD_CPU, "CPU time of hs_tracer's background thread in the scheduler process (it "
            "shares the scheduler's GIL), in seconds; per verify step: its rate over the steps' rate.",
            base, **kw)
        self.scheduler_delay = Counter(
            SCHEDULER_DELAY, "Time the scheduler thread's decode steps lost to hs_tracer's background "
            "thread (waiting for the GIL it held), in seconds, measured on the steps: steps overlapping "
            "its work against steps clear of it. Per verify step: its rate over the steps' rate.",
            base, **kw)
        self.kernel_gpu = Gauge(
            KERNEL_GPU, "GPU time of the fingerprint kernel per verify step, in seconds, timed once when "
            "the probe was warmed (64 rows, the launch as recorded in the target's graphs, replayed "
            "from a CUDA graph). Absent on the CPU.", base, **gauge_kw)


class PrometheusExporter:
    """Writes hs_tracer's metrics for one scheduler process. Call it from the recorder thread only.

    ``port``: where to serve ``/metrics`` when SGLang's multiprocess registry is not in use
    (``None``: :func:`metrics_port_for` the ranks; ``0``: a free port, see :attr:`port`).
    ``addr``: the address that server binds to (``HS_TRACER_METRICS_ADDR``).
    ``serve=False`` never starts a server (metrics still readable from :attr:`registry`).
    ``flush_interval_s``: how often summed steps reach the metrics (0: every step).
    One instance per process: in multiprocess mode two would overwrite each other's files.
    """

    def __init__(self, model: str, ranks: Ranks, *, port: int | None = None,
                 addr: str = TracerConfig.metrics_addr, serve: bool = True,
                 flush_interval_s: float = DEFAULT_FLUSH_INTERVAL_S, engine: str = engines.DEFAULT) -> None:
        from prometheus_client import CollectorRegistry

        self.model = model
        self.ranks = ranks
        self.multiprocess = multiprocess_dir() is not None
        self.registry = CollectorRegistry()
        self._m = _Metrics(self.registry)
        self._base = {"model": model, "engine": engine, **ranks.labels()}
        self._lock = threading.Lock()
        self.flush_interval_s = flush_interval_s
        self._pending = _PendingSteps()
        self._last_flush = time.monotonic()
        self._server: Any = None
        self.port: int | None = None

        m, b = self._m, self._base
        # Children created up front so every series starts at 0 and rate() sees its first increase.
        self._verify_steps = m.verify_steps.labels(**b)
        self._drafts = m.drafts.labels(**b)
        self._draft_tokens = m.draft_tokens.labels(**b)
        self._accepted = m.accepted_tokens.labels(**b)
        self._accept_length = _WeightedHistogram(m.accept_length.labels(**b))
        self._positions: list[Any] = []
        self._input_width = m.input_width.labels(**b)
        self._last_step_time = m.last_step_time.labels(**b)
        self._slot_rms: list[Any] = []
        self._slot_nonfinite: list[Any] = []
        self._records_dropped = m.records_dropped.labels(**b)
        self._hook_errors = m.hook_errors.labels(**b)
        self._spans_dropped = m.spans_dropped.labels(**b)
        self._enabled = m.enabled.labels(**b)
        self._host_overhead = _WeightedHistogram(m.host_overhead.labels(**b))
        self._thread_cpu = m.thread_cpu.labels(**b)
        self._scheduler_delay = m.scheduler_delay.labels(**b)
        self._enabled.set(1)
        m.start_time.labels(**b).set(time.time())
        self._totals = {"dropped": 0, "hook_errors": 0, "spans_dropped": 0}
        self._wiring_labels: dict[str, str] | None = None
        self._slot_series: dict[int, tuple[str, str]] = {}
        self._root_causes: dict[tuple[str, ...], None] = {}  # every label set published, in order

        if serve and not self.multiprocess:
            self._start_server(metrics_port_for(ranks) if port is None else port, addr)
        # Pushes summed steps out when the recorder goes quiet, so the last steps always show.
        self._closed = threading.Event()
        if 0 < flush_interval_s < threading.TIMEOUT_MAX:
            threading.Thread(target=self._flush_when_idle, name="hs_tracer-metrics-flush",
                             daemon=True).start()

    # --- serving ------------------------------------------------------------------------------------

    def _start_server(self, port: int, addr: str) -> None:
        from prometheus_client import start_http_server

        try:
            server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        except OSError as exc:
            logger.warning(
                "hs_tracer: cannot serve metrics on %s:%d (%s); metrics are still recorded but not "
                "served. Fix: set HS_TRACER_METRICS_PORT to a free base port, or run SGLang with "
                "--enable-metrics to publish them on SGLang's /metrics.", addr, port, exc)
            return
        self._server = server
        self.port = server.server_address[1]
        logger.info("hs_tracer: metrics on http://%s:%d/metrics", addr, self.port)

    def close(self) -> None:
        """Flush, then stop the idle flusher and hs_tracer's own HTTP server, if one runs."""
        self._closed.set()
        self.flush()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    # --- records ------------------------------------------------------------------------------------

    def _position(self, i: int) -> Any:
        while len(self._positions) <= i:
            self._positions.append(
                self._m.accepted_per_position.labels(**self._base, position=str(len(self._positions))))
        return self._positions[i]

    def _slot_children(self, k: int) -> None:
        while len(self._slot_rms) <= k:
            slot = str(len(self._slot_rms))
            self._slot_rms.append(self._m.slot_rms.labels(**self._base, slot=slot))
            self._slot_nonfinite.append(self._m.slot_nonfinite.labels(**self._base, slot=slot))

    def record_step(self, rec: StepRecord) -> None:
        """Count one verify step: accept lengths (bonus token included) and the step digest.

        Steps are summed in plain Python and pushed to the metrics at most every
        ``flush_interval_s`` (a scrape is seconds apart; a metric update costs ~1-2 µs, a sum
        ~0.1 µs); when no step comes, a small daemon thread pushes what is pending after the same
        interval. :meth:`flush` pushes at once.
        """
        p = self._pending
        with self._lock:
            p.steps += 1
            p.lengths.update(rec.accept_lengths)
            if rec.num_draft_tokens > 1:
                p.draft_tokens += len(rec.accept_lengths) * (rec.num_draft_tokens - 1)
            p.last_time_s = rec.time_unix_ns / 1e9
            if rec.input_width is not None:
                p.input_width = rec.input_width
            if rec.digest is not None:
                p.last_digest = rec.digest
                for k, slot in enumerate(rec.digest.slots):
                    if slot.nonfinite:
                        p.nonfinite[k] += slot.nonfinite
            now = time.monotonic()
            if now - self._last_flush >= self.flush_interval_s:
                self._flush_locked(now)

    def record_batch(self, steps: int, counts: np.ndarray, draft_tokens: int, last_time_unix_ns: int,
                     input_width: int | None, last_digest: StepDigest | None,
                     nonfinite: Sequence[int], host_s: Sequence[float] = (),
                     thread_cpu_s: float = 0.0) -> None:
        """:meth:`record_step` for many steps at once (the recorder's batches): ``counts[v]`` the
        request-steps with accept length ``v``, ``draft_tokens`` their sum of drafts proposed,
        ``nonfinite[k]`` slot k's non-finite values, ``host_s`` each step's host time in the hooks
        (every step is observed), ``thread_cpu_s`` the recorder thread's CPU time attributed to
        these steps. A few operations per batch whatever its size; the histograms
        are bucketed at the flush."""
        if not steps:
            return
        p = self._pending
        with self._lock:
            p.steps += steps
            for length in np.flatnonzero(counts).tolist():
                p.lengths[length] += int(counts[length])
            p.draft_tokens += draft_tokens
            p.last_time_s = last_time_unix_ns / 1e9
            if input_width is not None:
                p.input_width = input_width
            if last_digest is not None:
                p.last_digest = last_digest
            for k, count in enumerate(nonfinite):
                if count:
                    p.nonfinite[k] += int(count)
            p.host_s.extend(host_s)
            p.thread_cpu_s += thread_cpu_s
            now = time.monotonic()
            if now - self._last_flush >= self.flush_interval_s:
                self._flush_locked(now)

    def record_thread_cpu(self, seconds: float) -> None:
        """The recorder thread's CPU time attributed to steps already recorded (pushed at the next
        flush, with them)."""
        with self._lock:
            self._pending.thread_cpu_s += seconds

    def record_scheduler_delay(self, seconds: float) -> None:
        """What the recorder's work measurably cost the steps (counted at once)."""
        if seconds > 0:
            self._scheduler_delay.inc(seconds)

    def flush(self) -> None:
        """Push the steps summed since the last flush to the metrics."""
        with self._lock:
            self._flush_locked(time.monotonic())

    def _flush_when_idle(self) -> None:
        while not self._closed.wait(self.flush_interval_s):
            with self._lock:
                now, p = time.monotonic(), self._pending
                pending = p.steps or p.host_s or p.thread_cpu_s
                if pending and now - self._last_flush >= self.flush_interval_s:
                    self._flush_locked(now)

    def _flush_locked(self, now: float) -> None:
        p, self._pending = self._pending, _PendingSteps()
        self._last_flush = now
        if p.host_s:
            self._host_overhead.add_many(np.asarray(p.host_s, dtype=np.float64))
        if p.thread_cpu_s > 0:
            self._thread_cpu.inc(p.thread_cpu_s)
        if not p.steps:
            return
        self._verify_steps.inc(p.steps)
        self._last_step_time.set(p.last_time_s)
        if p.input_width is not None:
            self._input_width.set(p.input_width)
        if p.lengths:
            self._drafts.inc(p.lengths.total())
            if p.draft_tokens:
                self._draft_tokens.inc(p.draft_tokens)
            per_position = [0] * max(max(p.lengths) - 1, 0)
            accepted = 0
            # Equal accept lengths are added at once: at most num_draft_tokens distinct values.
            for length, count in p.lengths.items():
                self._accept_length.add(length, count)
                accepted += max(length - 1, 0) * count
                for i in range(length - 1):
                    per_position[i] += count
            if accepted:
                self._accepted.inc(accepted)
            for i, count in enumerate(per_position):
                self._position(i).inc(count)
        if p.last_digest is not None:
            self._slot_children(len(p.last_digest.slots) - 1)
            for k, slot in enumerate(p.last_digest.slots):
                self._slot_rms[k].set(slot.rms)
        for k, count in p.nonfinite.items():
            self._slot_children(k)
            self._slot_nonfinite[k].inc(count)

    def record_expected_accept_length(self, value: float) -> None:
        """The profile's expected mean accept length for the served draft steps (set once, at startup)."""
        self._m.expected_accept_length.labels(**self._base).set(value)

    def record_kernel_gpu(self, seconds: float) -> None:
        """The fingerprint kernel's GPU time per verify step (set once, when the exporters start)."""
        self._m.kernel_gpu.labels(**self._base).set(seconds)

    def record_wiring(self, w: WiringRecord) -> None:
        """Publish the wiring as an info-style gauge; pre-create the per-position counters."""
        labels = {
            "target_arch": w.target_arch,
            "num_layers": str(w.num_layers),
            "hidden_size": str(w.hidden_size),
            "layers_to_capture": _join(w.layers_to_capture),
            "configured_layer_ids": _join(w.configured_layer_ids),
            "sources": _join(w.sources),
            "expected_width": str(w.expected_width),
            "draft_fc_in_features": _str(w.draft_fc_in_features),
            "draft_graph_width": _str(w.draft_graph_width),
            "use_aux_hidden_state": _str(w.use_aux_hidden_state),
            "sglang_version": w.sglang_version,
            "engine_version": w.engine_version,
        }
        with self._lock:
            if self._wiring_labels is not None and self._wiring_labels != labels:
                self._m.wiring_info.labels(**self._base, **self._wiring_labels).set(0)
            self._m.wiring_info.labels(**self._base, **labels).set(1)
            self._wiring_labels = labels
            num_draft_tokens = w.spec_args.get("speculative_num_draft_tokens")
            if isinstance(num_draft_tokens, int) and num_draft_tokens > 1:
                self._position(num_draft_tokens - 2)
            self._slot_children(len(w.sources) - 1)

    def record_slots(self, verdicts: Sequence[SlotVerdict], drift: Sequence[float] = (),
                     margins: Mapping[int, float] | None = None) -> None:
        """Publish the latest slot identification and drift; ``drift[i]`` belongs to slot i. ``margins``:
        the statistics' margin per slot, also where a measurement named the slot (default: the
        verdicts' own)."""
        m, b = self._m, self._base
        with self._lock:
            for v in verdicts:
                slot = str(v.index)
                series = (v.expected_source, v.observed_source)
                old = self._slot_series.get(v.index)
                if old is not None and old != series:
                    m.slot_match_score.labels(**b, slot=slot, expected_source=old[0],
                                              observed_source=old[1]).set(math.nan)
                m.slot_match_score.labels(**b, slot=slot, expected_source=v.expected_source,
                                          observed_source=v.observed_source).set(v.score)
                self._slot_series[v.index] = series
                m.slot_mismatch.labels(**b, slot=slot).set(float(v.expected_source != v.observed_source))
                margin = v.margin if margins is None else margins.get(v.index)
                if margin is not None:
                    m.slot_match_margin.labels(**b, slot=slot).set(margin)
                if v.measured_error is not None:
                    m.slot_measured_error.labels(**b, slot=slot).set(v.measured_error)
                if v.measured_runner_up_error is not None:
                    m.slot_measured_runner_up_error.labels(**b, slot=slot).set(v.measured_runner_up_error)
            for k, value in enumerate(drift):
                m.slot_drift.labels(**b, slot=str(k)).set(value)

    def record_root_causes(self, causes: Sequence[RootCause]) -> None:
        """Publish the report's root causes; those no longer in it drop to 0. Label sets are bounded:
        a cause's text is its headline (no running figures), and after ``MAX_ROOT_CAUSE_SERIES``
        distinct ones a new text reads as a pointer to the report."""
        with self._lock:
            now: dict[tuple[str, ...], None] = {}
            for r in causes:
                key = (r.cause, r.severity.value, str(r.wiring).lower(), r.headline, r.fix)
                if key not in self._root_causes and len(self._root_causes) >= MAX_ROOT_CAUSE_SERIES:
                    key = (*key[:3], "changed too often to label: see the scheduler's report", "")
                now[key] = None
            for key in self._root_causes:
                if key not in now:
                    self._root_cause_child(key).set(0)
            for key in now:
                self._root_cause_child(key).set(1)
                self._root_causes[key] = None

    def _root_cause_child(self, key: tuple[str, ...]) -> Any:
        cause, severity, wiring, summary, fix = key
        return self._m.root_cause.labels(**self._base, cause=cause, severity=severity, wiring=wiring,
                                         summary=summary, fix=fix)

    def record_checks(self, off: Mapping[str, str]) -> None:
        """Which checks run (value 1) and which are off (0, ``off[check]`` the reason)."""
        with self._lock:
            for check in CHECKS:
                self._m.check_active.labels(**self._base, check=check, reason=off.get(check, "")).set(
                    0 if check in off else 1)

    def record_finding(self, f: Finding) -> None:
        """Count one finding by its stable code and severity."""
        with self._lock:
            self._m.findings.labels(**self._base, code=f.code.value, severity=f.severity.value).inc()

    def record_health(self, dropped: int, hook_errors: int, enabled: bool,
                      host_overhead_s: float | None = None, spans_dropped: int | None = None) -> None:
        """Publish tracer health. ``dropped``, ``hook_errors`` and ``spans_dropped`` are cumulative
        totals since start (the counters advance by the increase); ``host_overhead_s`` is one step's
        host time, observed into the histogram when given."""
        with self._lock:
            self._advance("dropped", dropped, self._records_dropped)
            self._advance("hook_errors", hook_errors, self._hook_errors)
            if spans_dropped is not None:
                self._advance("spans_dropped", spans_dropped, self._spans_dropped)
            self._enabled.set(1 if enabled else 0)
            if host_overhead_s is not None:
                self._host_overhead.add(host_overhead_s, 1)

    def _advance(self, key: str, total: int, counter: Any) -> None:
        delta = total - self._totals[key]
        if delta > 0:
            counter.inc(delta)
            self._totals[key] = total


@dataclass
class _PendingSteps:
    """Steps summed since the last flush."""

    steps: int = 0
    lengths: Counter[int] = field(default_factory=Counter)
    draft_tokens: int = 0
    last_time_s: float = 0.0
    input_width: int | None = None
    last_digest: StepDigest | None = None
    nonfinite: Counter[int] = field(default_factory=Counter)
    thread_cpu_s: float = 0.0
    host_s: list[float] = field(default_factory=list)  # per-step host time, bucketed at the flush


class _WeightedHistogram:
    """Adds ``count`` equal observations to a histogram child in one step.

    prometheus_client has no weighted ``observe``; one call per request would make a step's cost
    grow with the batch (~2 µs each). The child keeps per-bucket (non-cumulative) values and a sum,
    in memory or in the multiprocess files alike; when a release lays them out differently, this
    falls back to ``observe`` per observation. tests/test_export_prometheus.py checks both paths give
    the same exposition.
    """

    def __init__(self, child: Any) -> None:
        self._child = child
        bounds = getattr(child, "_upper_bounds", None)
        buckets = getattr(child, "_buckets", None)
        self.fast = (isinstance(bounds, list) and isinstance(buckets, list) and len(bounds) == len(buckets)
                     and hasattr(getattr(child, "_sum", None), "inc"))

    def add(self, value: float, count: int) -> None:
        child = self._child
        if not self.fast:
            for _ in range(count):
                child.observe(value)
            return
        child._buckets[bisect_left(child._upper_bounds, value)].inc(count)
        child._sum.inc(value * count)

    def add_many(self, values: np.ndarray) -> None:
        """One observation per value, bucketed with numpy (one update per non-empty bucket)."""
        child = self._child
        if not self.fast:
            for value in values.tolist():
                child.observe(value)
            return
        if not values.size:
            return
        idx = np.searchsorted(np.asarray(child._upper_bounds), values, side="left")
        counts = np.bincount(idx, minlength=len(child._buckets))
        for i in np.flatnonzero(counts).tolist():
            child._buckets[i].inc(int(counts[i]))
        child._sum.inc(float(values.sum()))


def _join(values: Sequence[object] | None) -> str:
    return "" if values is None else ",".join(str(v) for v in values)


def _str(value: object) -> str:
    return "" if value is None else str(value).lower() if isinstance(value, bool) else str(value)

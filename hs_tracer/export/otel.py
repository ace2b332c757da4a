"""OpenTelemetry export: sampled hs_tracer step spans, and per-step events on SGLang request traces.

Why this shape:

* Spans are made by the recorder thread from already-recorded step records (start and end times are
  the step's own timestamp), never on the scheduler thread; a BatchSpanProcessor ships them over
  OTLP/HTTP from its own thread. Only 1 step in ``round(1/sample)`` gets a span (plus every step
  with non-finite features), so the cost stays far below 1% of a step
  (benchmarks/results/export_overhead.md). Spans carry metadata and scalars only: slot sources,
  widths, digests, the accept-length distribution; never tensors, prompt text or request ids.
* When SGLang's tracing is on (``--enable-trace``), SGLang has installed the global tracer provider:
  hs_tracer then uses it, so its spans share SGLang's service, endpoint and exporter. Otherwise
  hs_tracer builds a private provider (never the global one: SGLang installs that, and only one
  may be set per process). The private provider honours the standard ``OTEL_*`` variables
  (``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_ENDPOINT``, ``..._HEADERS``,
  ``..._TIMEOUT``, ``..._COMPRESSION``, ``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``,
  ``OTEL_TRACES_SAMPLER``, ``OTEL_BSP_*``).
* Collector down or slow: the processor's queue is bounded and hs_tracer never hands it more spans
  than it can hold; the rest are dropped and counted (:attr:`OtelExporter.dropped`), so the
  recorder never blocks and serving is never affected.
* With SGLang's request tracing on, one event per request and step goes to the request's trace
  through SGLang's own ``trace_ctx.trace_event``, and the step span links to each request's root
  span. The recorder builds the events (:func:`step_events`); the scheduler thread, which owns
  SGLang's trace contexts, attaches them (:func:`attach_events`) at its next verify step.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from hs_tracer import __version__
from hs_tracer.findings import SlotVerdict
from hs_tracer.records import Ranks, StepRecord, WiringRecord

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
    from opentelemetry.trace import SpanContext, Tracer

logger = logging.getLogger("hs_tracer")

SPAN_NAME = "hs_tracer.verify_step"
"""Name of hs_tracer's sampled step span."""

EVENT_NAME = "hs_tracer.verify"
"""Name of the per-step event added to SGLang request traces."""

SCOPE_NAME = "hs_tracer"
"""Instrumentation scope of hs_tracer's spans (lets a collector route or filter them)."""

DEFAULT_SPAN_SAMPLE = 0.01
"""Fraction of verify steps exported as spans (``HS_TRACER_SPAN_SAMPLE``); see the benchmark."""

EVENT_LEVEL = 3
"""SGLang trace level of hs_tracer's request events: the level of SGLang's own per-step detail
(its ``schedule`` event and ``decode_loop`` slices, which are what files the events away)."""

MAX_LINKS = 32
"""Request traces linked from one step span (OTel's default link limit is 128)."""


def request_span_context(trace_ctx: Any) -> SpanContext | None:
    """The span context of a request's root span from SGLang's ``req.time_stats.trace_ctx``.

    Works for SGLang's synchronous and async trace contexts (both keep ``root_span_context``, an
    OTel Context restored from the propagated carrier in scheduler processes); ``None`` when the
    request is not traced.
    """
    if trace_ctx is None or not getattr(trace_ctx, "tracing_enable", False):
        return None
    root = getattr(trace_ctx, "root_span_context", None)
    if root is None:
        return None
    from opentelemetry import trace

    span_context = trace.get_current_span(root).get_span_context()
    return span_context if span_context.is_valid else None


def step_events(rec: StepRecord, trace_ctxs: Sequence[Any], *,
                step_span: SpanContext | None = None) -> list[tuple[Any, dict[str, Any]]]:
    """``(trace_ctx, attributes)`` of the ``hs_tracer.verify`` event for each traced request.

    ``trace_ctxs[i]`` is ``req.time_stats.trace_ctx`` of the request whose accept length is
    ``rec.accept_lengths[i]``. Building them touches no SGLang state, so the recorder thread does it;
    handing them to SGLang (:func:`attach_events`) belongs on the scheduler thread.
    """
    common: dict[str, Any] = {
        "hs_tracer.step": rec.step,
        "hs_tracer.step_time_unix_ns": rec.time_unix_ns,
        "hs_tracer.num_draft_tokens": rec.num_draft_tokens,
        "hs_tracer.tp_rank": rec.ranks.tp,
    }
    if rec.digest is not None:
        common["hs_tracer.slot.rms"] = [s.rms for s in rec.digest.slots]
        common["hs_tracer.slot.nonfinite"] = [s.nonfinite for s in rec.digest.slots]
    if rec.input_width is not None:
        common["hs_tracer.input_width"] = rec.input_width
    if step_span is not None:
        common["hs_tracer.step_trace_id"] = format(step_span.trace_id, "032x")
        common["hs_tracer.step_span_id"] = format(step_span.span_id, "016x")
    out = []
    for i, ctx in enumerate(trace_ctxs):
        if ctx is None or not getattr(ctx, "tracing_enable", False):
            continue
        attrs = dict(common)
        if i < len(rec.accept_lengths):
            attrs["hs_tracer.accept_length"] = rec.accept_lengths[i]
        out.append((ctx, attrs))
    return out


def attach_events(events: Sequence[tuple[Any, dict[str, Any]]], *, level: int = EVENT_LEVEL) -> int:
    """Add each event to its SGLang request trace through SGLang's own ``trace_ctx.trace_event``.

    Call it from the scheduler thread: ``trace_event`` appends to a buffer that SGLang's scheduler
    reads and exports with its own slices; no other thread may write it. The event is stamped with
    the time of this call, not of the step (the ``hs_tracer.step_time_unix_ns`` attribute): SGLang
    buffers an event until a slice covering its timestamp ends, so a step-time stamp would sit in
    the buffer for the rest of the request. Stamped now, it lands in the request's next slice.
    Returns the number of events attached.
    """
    for ctx, attrs in events:
        ctx.trace_event(EVENT_NAME, level, attrs=attrs)
    return len(events)


class _CountingExporter:
    """Wraps the OTLP exporter to count what it exported or failed to export, so hs_tracer knows
    how many spans are still queued or in flight (the SDK drops queue overflow silently)."""

    def __init__(self, inner: SpanExporter, on_done: Any) -> None:
        self._inner = inner
        self._on_done = on_done

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        from opentelemetry.sdk.trace.export import SpanExportResult

        try:
            result = self._inner.export(spans)
        except Exception:  # the SDK would only log it; hs_tracer counts it as dropped
            logger.debug("hs_tracer: span export raised", exc_info=True)
            result = SpanExportResult.FAILURE
        self._on_done(len(spans), result is SpanExportResult.SUCCESS)
        return result

    def shutdown(self) -> None:
        self._inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._inner.force_flush(timeout_millis)


def spans_configured() -> bool:
    """Whether step spans have somewhere to go: SGLang's own tracing is on (it installed a provider),
    or an OTLP endpoint is configured. Without either, hs_tracer exports no spans rather than retry
    against a collector that was never set up."""
    from opentelemetry import trace

    if not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        return True
    endpoints = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
    return any(os.environ.get(v) for v in endpoints)


class OtelExporter:
    """hs_tracer's sampled step spans for one scheduler process. Call it from the recorder thread.

    ``sample``: fraction of verify steps exported (0 = none, 1 = all).
    ``endpoint``: OTLP/HTTP traces URL for the private provider (default: the ``OTEL_*`` variables,
    else ``http://localhost:4318/v1/traces``). ``provider``: use this tracer provider instead of
    resolving one (tests).
    """

    def __init__(self, model: str, ranks: Ranks, *, sample: float = DEFAULT_SPAN_SAMPLE,
                 endpoint: str | None = None, provider: Any = None) -> None:
        if not 0.0 <= sample <= 1.0:
            raise ValueError(f"span sample {sample!r} must be a fraction between 0 and 1 "
                             "(HS_TRACER_SPAN_SAMPLE)")
        self.model = model
        self.ranks = ranks
        self.every = round(1 / sample) if sample > 0 else 0
        self._endpoint = endpoint
        self._provider = provider
        self._own_provider: TracerProvider | None = None
        self._tracer: Tracer | None = None
        self._steps = 0
        self._lock = threading.Lock()
        self._queue_limit = 0  # 0: not hs_tracer's processor, nothing to gate or count
        self._in_flight = 0
        self.exported = 0
        self.dropped = 0
        self.uses_sglang_provider = False
        self.spans_off_reason: str | None = None
        self._static: dict[str, Any] = {
            "hs_tracer.model": model,
            "hs_tracer.tp_rank": ranks.tp,
            "hs_tracer.pp_rank": ranks.pp,
            "hs_tracer.dp_rank": ranks.dp,
            "hs_tracer.attn_dp_rank": ranks.attn_dp,
        }
        self._wiring: dict[str, Any] = {}
        self._slots: dict[str, Any] = {}

    # --- provider -----------------------------------------------------------------------------------

    def _resolve_tracer(self) -> Tracer:
        """Resolved at the first sampled step, not at creation: SGLang initialises its tracing in the
        scheduler after the plugin has loaded."""
        from opentelemetry import trace

        provider = self._provider
        if provider is None:
            global_provider = trace.get_tracer_provider()
            if not isinstance(global_provider, trace.ProxyTracerProvider):
                provider = global_provider
                self.uses_sglang_provider = True
            else:
                provider = self._own_provider = self._build_provider()
        return provider.get_tracer(SCOPE_NAME, __version__)

    def _build_provider(self) -> TracerProvider:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
                                  os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"))
        if protocol != "http/protobuf":
            logger.warning("hs_tracer: exports its own spans over OTLP http/protobuf only "
                           "(OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=%s ignored); point "
                           "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT at the collector's HTTP port (4318).",
                           protocol)
        # Attributes passed here override the environment, so set the name only when it is unset.
        attrs = {} if os.environ.get("OTEL_SERVICE_NAME") else {SERVICE_NAME: "hs_tracer"}
        # shutdown_on_exit=False: an unreachable collector must not hold up the scheduler's exit;
        # the recorder calls shutdown() with a short timeout instead.
        queue_limit = int(os.environ.get("OTEL_BSP_MAX_QUEUE_SIZE", "2048"))
        provider = TracerProvider(resource=Resource.create(attrs), shutdown_on_exit=False)
        self._queue_limit = queue_limit
        exporter = _CountingExporter(OTLPSpanExporter(endpoint=self._endpoint), self._export_done)
        provider.add_span_processor(BatchSpanProcessor(exporter, max_queue_size=self._queue_limit))
        return provider

    def _export_done(self, n: int, ok: bool) -> None:
        with self._lock:
            self._in_flight -= n
            if ok:
                self.exported += n
            else:
                self.dropped += n

    # --- records ------------------------------------------------------------------------------------

    def record_wiring(self, w: WiringRecord) -> None:
        """Remember the wiring; sampled spans carry it."""
        wiring: dict[str, Any] = {
            "hs_tracer.engine": w.engine,
            "hs_tracer.engine_version": w.engine_version,
            "hs_tracer.target_arch": w.target_arch,
            "hs_tracer.hidden_size": w.hidden_size,
            "hs_tracer.expected_width": w.expected_width,
            "hs_tracer.layers_to_capture": list(w.layers_to_capture),
            "hs_tracer.slot.source": list(w.sources),
        }
        if w.draft_fc_in_features is not None:
            wiring["hs_tracer.draft_fc_in_features"] = w.draft_fc_in_features
        self._wiring = wiring

    def record_slots(self, verdicts: Sequence[SlotVerdict]) -> None:
        """Remember the latest slot identification; sampled spans carry it."""
        ordered = sorted(verdicts, key=lambda v: v.index)
        self._slots = {
            "hs_tracer.slot.expected_source": [v.expected_source for v in ordered],
            "hs_tracer.slot.observed_source": [v.observed_source for v in ordered],
            "hs_tracer.slot.match_score": [float(v.score) for v in ordered],
        } if ordered else {}

    @staticmethod
    def request_tracing() -> bool:
        """Whether SGLang traces requests in this process (``--enable-trace`` installed the global
        provider): only then can a step carry request events."""
        from opentelemetry import trace

        return not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)

    def wants_span(self, nonfinite: bool = False) -> bool:
        """Count one verify step; whether it gets a span (:meth:`sampled_steps`)."""
        return bool(self.sampled_steps(1, [0] if nonfinite else []))

    def sampled_steps(self, count: int, nonfinite: Sequence[int] = ()) -> list[int]:
        """Count ``count`` verify steps at once; the indices among them that get a span, ascending:
        1 step in ``round(1/sample)`` counted since start, and every step with non-finite features
        (``nonfinite``: their indices). Arithmetic on the batch, nothing per step."""
        start = self._steps
        self._steps += count
        if self.spans_off_reason is not None:
            return []
        picked = set(nonfinite)
        if self.every:
            picked.update(range((-start) % self.every, count, self.every))
        return sorted(picked)

    def record_step(self, rec: StepRecord, trace_ctxs: Sequence[Any] | None = None, *,
                    sampled: bool | None = None,
                    deliver: Callable[[list[tuple[Any, dict[str, Any]]]], Any] | None = None,
                    ) -> SpanContext | None:
        """Export a span for this step if it is sampled (``sampled``: the caller already asked
        :meth:`wants_span`); build request events when given SGLang's trace contexts (aligned with
        ``rec.accept_lengths``). ``deliver`` takes those events to the thread that owns the
        contexts; without it they are attached here (call from the scheduler thread then). Never
        blocks. Returns the span's context when a span was exported, else ``None``.
        """
        if sampled is None:
            nonfinite = rec.digest is not None and any(s.nonfinite for s in rec.digest.slots)
            sampled = self.wants_span(nonfinite)
        span_context = self._emit(rec, trace_ctxs) if sampled else None
        if trace_ctxs:
            events = step_events(rec, trace_ctxs, step_span=span_context)
            if events:
                if deliver is None:
                    attach_events(events)
                else:
                    deliver(events)
        return span_context

    def _emit(self, rec: StepRecord, trace_ctxs: Sequence[Any] | None) -> SpanContext | None:
        from opentelemetry import context as otel_context
        from opentelemetry.trace import Link

        if self._tracer is None:
            try:
                self._tracer = self._resolve_tracer()
            except Exception as exc:  # spans are optional: metrics and diagnosis go on without them
                self.spans_off_reason = f"{type(exc).__name__}: {exc}"
                logger.warning("hs_tracer: step spans switched off, OpenTelemetry export could not be "
                               "set up (%s). Fix: check the OTEL_* variables.", self.spans_off_reason)
                return None
        if self._queue_limit:
            with self._lock:
                if self._in_flight >= self._queue_limit:
                    self.dropped += 1
                    return None
                self._in_flight += 1
        links = []
        for ctx in trace_ctxs or ():
            linked = request_span_context(ctx)
            if linked is not None:
                links.append(Link(linked))
                if len(links) == MAX_LINKS:
                    break
        span = self._tracer.start_span(SPAN_NAME, context=otel_context.Context(),
                                       attributes=self._attributes(rec), links=links,
                                       start_time=rec.time_unix_ns)
        span.end(end_time=rec.time_unix_ns)
        span_context = span.get_span_context()
        if self._queue_limit and not span_context.trace_flags.sampled:
            with self._lock:  # an OTEL_TRACES_SAMPLER said no: it never reaches the processor
                self._in_flight -= 1
        return span_context if span_context.trace_flags.sampled else None

    def _attributes(self, rec: StepRecord) -> dict[str, Any]:
        lengths = rec.accept_lengths
        attrs: dict[str, Any] = {
            **self._static,
            "hs_tracer.step": rec.step,
            "hs_tracer.batch_size": len(lengths),
            "hs_tracer.num_draft_tokens": rec.num_draft_tokens,
            **self._wiring,
            **self._slots,
        }
        if lengths:
            # A histogram, not the per-request list: its size is bounded by the draft length, not the
            # batch (the SDK validates every list element; 256 requests would cost milliseconds).
            arr = np.asarray(lengths, dtype=np.int64)
            histogram = np.bincount(np.maximum(arr, 1) - 1, minlength=rec.num_draft_tokens)
            attrs["hs_tracer.accept_length.histogram"] = histogram.tolist()
            attrs["hs_tracer.accept_length.mean"] = float(arr.mean())
            attrs["hs_tracer.accepted_tokens"] = int(np.maximum(arr - 1, 0).sum())
        if rec.input_width is not None:
            attrs["hs_tracer.input_width"] = rec.input_width
        if rec.digest is not None:
            slots = rec.digest.slots
            attrs["hs_tracer.digest.tokens"] = rec.digest.tokens
            attrs["hs_tracer.slot.count"] = [s.count for s in slots]
            attrs["hs_tracer.slot.mean"] = [float(s.mean) for s in slots]
            attrs["hs_tracer.slot.rms"] = [float(s.rms) for s in slots]
            attrs["hs_tracer.slot.absmax"] = [float(s.absmax) for s in slots]
            attrs["hs_tracer.slot.nonfinite"] = [s.nonfinite for s in slots]
        return attrs

    # --- lifecycle ----------------------------------------------------------------------------------

    def force_flush(self, timeout_s: float = 5.0) -> bool:
        """Export what is queued now (tests, shutdown). A no-op for SGLang's provider."""
        if self._own_provider is None:
            return True
        return self._own_provider.force_flush(int(timeout_s * 1000))

    def shutdown(self, timeout_s: float = 2.0) -> None:
        """Stop hs_tracer's private span pipeline; spans still queued after ``timeout_s`` are lost."""
        if self._own_provider is not None:
            worker = threading.Thread(target=self._own_provider.shutdown, daemon=True,
                                      name="hs_tracer-otel-shutdown")
            worker.start()
            worker.join(timeout_s)

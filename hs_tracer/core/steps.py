"""The per-step path on an engine's scheduler thread: fingerprint, match, enqueue. No host sync.

Engine-neutral: SGLang and vLLM both feed it (what follows says how SGLang does; vLLM hands the
draft prefill and decode rows in one batch, so it uses one window stream and never skips a request).

**Step identity travels with the batch.** Under SGLang's overlap scheduler, batch N+1 is launched
(its target verify and draft extend run, so its fingerprint is taken) before batch N's results are
processed. A counter read at result time would name the wrong step, and the digests drained then
would mix N and N+1. So the decode hook stamps its step number on the batch's own
``GenerationBatchResult`` (the object SGLang later hands to ``_resolve_spec_v2_tokens``), and the
result hook looks that number up: every record joins its own digest, accept lengths and requests.

**Prefill and decode digests are kept apart**: a prefill's digest never merges into a decode
step's record (prefill observations carry negative step numbers and are never claimed).

**Which rows feed the diagnosis windows.** Decode rows: the verify window the draft extend reads
(``bs x draft tokens`` rows, every row at position >= 1). Prefill rows: the requests' extend rows
(the first ``sum(extend_lens)`` rows) minus the rows at position 0 (a request without a cached
prefix starts there; its statistics differ and the profiles leave position 0 out). The tensor can
be longer than that: with DP attention SGLang pads every rank's prefill to a shared token count
(``MAX_LEN``) and, when every request has a cached prefix, hands the draft the padding rows too (it
trims to ``seq_lens_sum``, prefix included). On a combined instance both go into one window
stream (a short workload would otherwise not reach the diagnosis's minimum row count); a
disaggregated prefill instance has prefill windows only, a decode instance decode windows only. A
window closes every ``HS_TRACER_WINDOW_TOKENS`` rows.

**Which requests a step commits** is the engine's rule, the adapter's ``settled`` test (SGLang skips
requests it already finished or retracted; vLLM and SGLang's V1 worker commit every request they
verified: no test). It must read request state as it is at this step, on the scheduler thread, and
runs only where it can be false, so the step costs the same at any batch size: with the overlap
scheduler, when the next decode launch was seen first, only the requests that left between the two
request lists (the *departed*: the lists compare in C, a block at a time) are tested; without overlap
none; otherwise every request.

**What the scheduler thread does per step, and nothing more**: the BEFORE hook launches the probe (a
graph replay), stamps the step number and notes the batch's request list; the AFTER hook notes which
requests to skip (above) and logs the step in preallocated columns (step, time, draft tokens, host time
and batch size as numbers; SGLang's CPU tensor of accept lengths and the request list by reference:
``export/step_log.py``), then hands SGLang any request-trace events the recorder prepared (SGLang's
trace contexts are the scheduler's: only its thread writes them). The recorder thread takes the
logged steps as one run, and the digests from the ring as arrays, with a fixed number of calls
whatever their number; the rest happens in batches: digests joined by step number, accept lengths
tallied with numpy, records built only for the steps an exporter needs one by one (sampled spans,
traced requests).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence
from time import perf_counter, time_ns
from typing import TYPE_CHECKING, Any

import numpy as np

from hs_tracer.export.batch import Scratch, StepBatch
from hs_tracer.export.digest_join import DigestJoin
from hs_tracer.export.otel import attach_events
from hs_tracer.export.step_log import StepLog
from hs_tracer.fingerprint.stats import DIGEST_WIDTH
from hs_tracer.records import Ranks, StepRecord

if TYPE_CHECKING:
    from hs_tracer.fingerprint.probe import FingerprintProbe

logger = logging.getLogger("hs_tracer")

STEP_ATTR = "_hs_tracer_step"
"""Attribute the decode hook sets on SGLang's ``GenerationBatchResult`` (a plain dataclass) to carry
the step number to the result hook; it dies with the result object."""


MIN_WINDOW_S = 0.1
"""A diagnosis window closes when it holds ``window_rows`` rows and at least this long after the
previous close. Closing one costs the scheduler thread a graph replay and an event record (the
probe's snapshot: ~45-60 µs inside SGLang, where every call runs on cold caches), so fast large steps
close one every 0.1 s, not every step; nothing is lost (rows go on adding up), and the export process
diagnoses the windows of up to a second merged anyway."""


BLOCK = 32
"""Requests compared per C-level slice comparison when looking for the departed requests."""


def departed(reqs: Sequence[Any], nxt: Sequence[Any]) -> list[int]:
    """Indices of ``reqs`` whose request may be missing from ``nxt``: every one that is missing, plus
    (only if ``nxt`` is not ``reqs`` shortened in order and extended at the end) some that are not.
    Common runs are compared a block at a time in C; only the slots after a mismatch are walked."""
    n, m = len(reqs), len(nxt)
    if m >= n and nxt[:n] == reqs:
        return []
    out: list[int] = []
    i = j = 0
    while i < n:
        k = min(BLOCK, n - i, m - j)
        if k and reqs[i:i + k] == nxt[j:j + k]:
            i += k
            j += k
            continue
        end = i + max(k, 1)
        while i < end:  # the block that differs, one slot at a time
            if j < m and reqs[i] is nxt[j]:
                j += 1
            else:
                out.append(i)  # a departed request never matches a slot of ``nxt``
            i += 1
    return out


def prefill_segments(prefix_lens: Sequence[int], extend_lens: Sequence[int]) -> list[tuple[int, int]]:
    """Row ranges ``[start, end)`` of a prefill batch without the rows at position 0, merged."""
    out: list[tuple[int, int]] = []
    row = 0
    for prefix, n in zip(prefix_lens, extend_lens, strict=True):
        start = row + (1 if prefix == 0 else 0)
        row += n
        if start >= row:
            continue
        if out and out[-1][1] == start:
            out[-1] = (out[-1][0], row)
        else:
            out.append((start, row))
    return out


class _Windowed:
    """A probe and its row count towards the next window boundary."""

    __slots__ = ("closed_at", "closes", "probe", "rows", "width", "window_rows")

    def __init__(self, probe: FingerprintProbe, window_rows: int) -> None:
        self.probe = probe
        self.width = probe.num_slots * probe.hidden  # the input width the probe fingerprints
        self.rows = 0
        self.window_rows = window_rows
        self.closed_at = 0.0
        self.closes = 0

    def close(self, now: float) -> None:
        self.probe.end_window()
        self.rows = 0
        self.closed_at = now
        self.closes += 1


class StepPath:
    """Owns the decode and prefill probes (built and warmed at startup); the scheduler thread logs
    each verify step in a :class:`~hs_tracer.export.step_log.StepLog`, the recorder thread turns
    runs of them into batches.

    Bounded: ``capacity`` steps wait for the recorder; beyond that new steps are dropped (``dropped``).
    """

    def __init__(self, decode: FingerprintProbe | None, prefill: FingerprintProbe | None,
                 window_rows: int, ranks: Ranks, capacity: int) -> None:
        self.decode = _Windowed(decode, window_rows) if decode is not None else None
        if prefill is not None and prefill is decode:
            self.prefill = self.decode  # one window stream (a combined instance)
        else:
            self.prefill = _Windowed(prefill, window_rows) if prefill is not None else None
        self.ranks = ranks
        self.log = StepLog(capacity)
        # Request-trace events the recorder prepared: (trace_ctx, attrs). The scheduler thread
        # hands them to SGLang at its next result step (bounded; the oldest go first).
        self.outbox: deque[tuple[Any, dict[str, Any]]] = deque(maxlen=4 * capacity)
        self.decode_steps = 0
        self.prefill_steps = 0
        self.input_width: int | None = None
        self.max_accept_length: int | None = None  # as the latest step was recorded with
        self.width_warned = False
        ring = getattr(decode, "ring_size", None)
        self._join = DigestJoin(4 * max(int(ring or 64), capacity))  # for take()
        # Steps waiting that make the recorder hand them over at once: half of what this queue and
        # the probe's digest ring hold, so neither drops while a hand-off is due.
        self.forward_after = max(1, min(self.log.capacity, int(ring or capacity)) // 2)
        self._host_s = 0.0  # host time in the per-step hooks since the last record
        # each decode step's clock reading, for the recorder's measure of what it costs the steps
        # (export/step_delay.py); the recorder pops them, bounded if it falls behind
        self.step_clock: deque[float] = deque(maxlen=4 * capacity)
        # (step, request list) of the two latest decode launches that named their requests
        self._launches: tuple[tuple[int, Any] | None, tuple[int, Any] | None] = (None, None)
        self._processor: Any = None  # SGLang's result processor seen last, and whether it overlaps
        self._overlap = True

    # ---- draft extend (before) ---------------------------------------------------------------------
    def observe_decode(self, features: Any, result: Any, reqs: Sequence[Any] | None = None,
                       segments: Sequence[tuple[int, int]] | None = None) -> None:
        """``reqs``: the request list of the batch being launched (None where the hook has none).
        ``segments``: the row ranges of ``features`` that feed the windows (None: every row), e.g.
        vLLM's batch without its rows at position 0."""
        started = perf_counter()
        self.step_clock.append(started)
        step = self.decode_steps = self.decode_steps + 1
        setattr(result, STEP_ATTR, step)
        if reqs is not None:
            self._launches = (self._launches[1], (step, reqs))
        if features is not None:
            if segments is None:
                self._observe(self.decode, features, step, started)
            else:
                for start, end in segments:
                    self._observe(self.decode, features[start:end], step, started)
        self._host_s += perf_counter() - started

    def launch_counts(self) -> dict[str, dict[str, Any]]:
        """How each CUDA probe launched its kernel so far (graph replays, direct launches, graphs
        kept; steps fingerprinted inside the target's own graphs, how many such graphs, and why they
        were switched off, if they were) and how many windows it closed: what the step path's host
        time depends on. A combined instance has one probe, listed as "decode"."""
        probes = [("decode", self.decode)]
        if self.prefill is not self.decode:
            probes.append(("prefill", self.prefill))
        out = {}
        for name, windowed in probes:
            launcher = getattr(windowed.probe, "launcher", None) if windowed is not None else None
            if launcher is not None:
                probe = windowed.probe
                out[name] = {"graph_replays": launcher.replays, "direct": launcher.direct,
                             "graphs": launcher.graphs, "windows_closed": windowed.closes,
                             "in_graph_steps": probe.in_graph_steps,
                             "in_graph_graphs": len(probe.in_graph_inputs),
                             "in_graph_fault": probe.in_graph_fault}
        return out

    def observe_prefill(self, features: Any, prefix_lens: Sequence[int], extend_lens: Sequence[int]) -> None:
        started = perf_counter()
        self.prefill_steps += 1
        if features is not None and self.prefill is not None:
            # only the requests' extend rows: under DP attention SGLang hands over a padded tensor
            for start, end in prefill_segments(prefix_lens, extend_lens):
                self._observe(self.prefill, features[start:end], -self.prefill_steps, started)
        self._host_s += perf_counter() - started

    def _observe(self, windowed: _Windowed | None, features: Any, step: int, now: float) -> None:
        """Fingerprint ``features``; the probe returns the row count, so ``features.shape`` (a torch
        call) is read only where there is no probe."""
        if windowed is None:
            self.input_width = int(features.shape[-1])
            return
        rows = windowed.probe.observe_rows(features, step)
        if rows >= 0:
            self.input_width = windowed.width
            windowed.rows += rows
            if windowed.rows >= windowed.window_rows and now - windowed.closed_at >= MIN_WINDOW_S:
                windowed.close(now)
            return
        probe = windowed.probe
        width = self.input_width = probe.last_width
        if not self.width_warned:  # once per process: the width finding carries it from here
            self.width_warned = True
            logger.warning("hs_tracer: draft input is %d wide, the fingerprint probe expects %d x %d; "
                           "fingerprints are off, the width finding stands", width, probe.num_slots,
                           probe.hidden)

    # ---- results (after _resolve_spec_v2_tokens) ---------------------------------------------------
    def record(self, result: Any, reqs: Sequence[Any], accept_lens: Any, num_draft_tokens: int,
               max_accept_length: int | None, settled: Callable[[Any], bool] | None = None,
               processor: Any = None) -> bool:
        """Hand over the step ``result`` belongs to (scheduler thread). ``accept_lens``: SGLang's CPU
        tensor or a sequence, kept by reference. ``settled``: which requests SGLang committed:
        the V2 rule by default (tested only where it can be false, module docstring), None for
        every request (the V1 worker commits every request it verified), or another test run on
        every request. ``processor``: SGLang's result processor (its ``enable_overlap`` says
        whether the overlap scheduler runs; None: assume it does). False when no request was
        committed (no verify step)."""
        started = time_ns()  # the step's timestamp, and the start of this hook's host time
        if self.outbox:
            self._deliver_events()
        step = getattr(result, STEP_ATTR, None)
        if settled is not None:
            if processor is not self._processor:
                self._processor = processor
                self._overlap = processor is None or bool(getattr(processor, "enable_overlap", True)
                                                          or getattr(processor, "enable_overlap_mlx", False))
            before, latest = self._launches
            if not (self._overlap and reqs):
                skip = []
            elif (before is not None and before[0] == step and latest[0] == step + 1
                  and latest[1] is before[1]):
                skip = []  # under overlap, mostly: the running batch's list, unchanged
            else:
                skip = self._skipped(step, reqs, latest, settled)
        else:
            reqs = tuple(reqs)  # a list other workers may reuse
            skip = []
        if len(skip) == len(reqs):  # only requests finished or retracted before this step
            self._host_s += (time_ns() - started) * 1e-9
            return False
        self.max_accept_length = max_accept_length
        host_s = self._host_s + (time_ns() - started) * 1e-9
        self._host_s = 0.0
        self.log.append(step if step is not None else 0, started, accept_lens, reqs, skip, num_draft_tokens,
                        host_s)
        return True

    def _skipped(self, step: int | None, reqs: Sequence[Any], latest: tuple[int, Any] | None,
                 settled: Callable[[Any], bool]) -> list[int]:
        """Indices of the requests the engine skips in ``step`` under overlap (module docstring), unless
        the next launch reused this step's request list (``record`` checks that first). ``latest``: the
        latest decode launch."""
        if step is None or latest is None or latest[0] != step + 1:  # no later launch seen first
            candidates: Any = range(len(reqs))
        else:
            candidates = departed(reqs, latest[1])
        return [i for i in candidates if not settled(reqs[i])]

    def _deliver_events(self) -> None:
        """Request-trace events prepared by the recorder, handed to SGLang's trace contexts here, on
        the thread that owns them."""
        outbox, events = self.outbox, []
        while outbox:
            events.append(outbox.popleft())
        attach_events(events)

    # ---- recorder thread ---------------------------------------------------------------------------
    @property
    def dropped(self) -> int:
        """Steps not logged because the recorder was a whole log behind."""
        return self.log.dropped

    def take_batch(self, requests: bool = False, scratch: Scratch | None = None) -> StepBatch | None:
        """Every step logged since the last call, with the digests drained meanwhile, as one batch
        (None if there was none). ``requests``: keep the committed request objects; ``scratch``:
        see :meth:`StepBatch.from_run`."""
        run = self.log.take()
        if run is None:
            return None
        digests = self.take_digests()  # drained after the steps were taken: none of theirs is missed
        return StepBatch.from_run(run, *digests, max_accept_length=self.max_accept_length,
                                  input_width=self.input_width, requests=requests, scratch=scratch)

    def take_digests(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The decode steps' digests landed so far, as arrays: step ids, tokens, raw sums ``[n, K, 5]``
        (join them to their steps with a :class:`DigestJoin`). Prefill digests are drained and
        dropped: they are no step's record; the windows carry prefill rows."""
        if self.prefill is not None and self.prefill is not self.decode:
            self.prefill.probe.drain_raw()
        if self.decode is None:
            return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros((0, 0, DIGEST_WIDTH))
        steps, tokens, raws = self.decode.probe.drain_block()
        decode = steps > 0  # prefill observations (negative numbers) on a combined instance's probe
        return steps[decode], tokens[decode], raws[decode]

    def take(self) -> list[StepRecord]:
        """Every logged step as a full record with its own digest (tests and single-step users)."""
        batch = self.take_batch(requests=True)
        if batch is None:
            return []
        self._join.add(batch.digest_steps, batch.digest_tokens, batch.digest_raws)
        hidden = self.decode.probe.hidden if self.decode is not None else 0
        return [batch.record(i, self.ranks, hidden, self._join.find(step))
                for i, step in enumerate(batch.steps.tolist())]

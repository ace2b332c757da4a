"""The per-step path on SGLang's scheduler thread: fingerprint, match, enqueue. No host sync.

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

Requests SGLang already finished or retracted in a step are skipped exactly as its own
``_resolve_spec_v2_tokens`` skips them (``req.is_retracted or req.finished()``): under overlap they
ride along for one more step, and their accept lengths are padding.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from hs_tracer.records import Ranks, StepRecord

if TYPE_CHECKING:
    from hs_tracer.fingerprint.probe import FingerprintProbe
    from hs_tracer.fingerprint.stats import StepDigest

logger = logging.getLogger("hs_tracer")

STEP_ATTR = "_hs_tracer_step"
"""Attribute the decode hook sets on SGLang's ``GenerationBatchResult`` (a plain dataclass) to carry
the step number to the result hook; it dies with the result object."""


def request_settled(req: Any) -> bool:
    """Whether SGLang's ``_resolve_spec_v2_tokens`` commits this request's accept length this step."""
    return not (req.is_retracted or req.finished())


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

    __slots__ = ("probe", "rows", "window_rows")

    def __init__(self, probe: FingerprintProbe, window_rows: int) -> None:
        self.probe = probe
        self.rows = 0
        self.window_rows = window_rows

    def observe(self, features: Any, step: int) -> bool:
        if not self.probe.observe(features, step):
            return False
        self.rows += int(features.shape[0])
        if self.rows >= self.window_rows:
            self.probe.end_window()
            self.rows = 0
        return True


class StepPath:
    """Owns the decode and prefill probes (built and warmed at startup) and turns each verify step
    into a :class:`StepRecord` on the recorder's bounded queue."""

    def __init__(self, decode: FingerprintProbe | None, prefill: FingerprintProbe | None,
                 window_rows: int, ranks: Ranks, enqueue: Any) -> None:
        self.decode = _Windowed(decode, window_rows) if decode is not None else None
        if prefill is not None and prefill is decode:
            self.prefill = self.decode  # one window stream (a combined instance)
        else:
            self.prefill = _Windowed(prefill, window_rows) if prefill is not None else None
        self.ranks = ranks
        self._enqueue = enqueue  # StepRecord -> None (drops the oldest when full)
        self.decode_steps = 0
        self.prefill_steps = 0
        self.input_width: int | None = None
        self.width_warned = False
        self._digests: dict[int, StepDigest] = {}
        self._max_pending = 4 * int(getattr(decode, "ring_size", 64))
        self._host_s = 0.0  # host time in the per-step hooks since the last record

    # ---- draft extend (before) ---------------------------------------------------------------------
    def observe_decode(self, features: Any, result: Any) -> None:
        started = time.perf_counter()
        self.decode_steps += 1
        step = self.decode_steps
        setattr(result, STEP_ATTR, step)
        if features is not None:
            self._observe(self.decode, features, step)
        self._host_s += time.perf_counter() - started

    def observe_prefill(self, features: Any, prefix_lens: Sequence[int], extend_lens: Sequence[int]) -> None:
        started = time.perf_counter()
        self.prefill_steps += 1
        if features is not None and self.prefill is not None:
            # only the requests' extend rows: under DP attention SGLang hands over a padded tensor
            for start, end in prefill_segments(prefix_lens, extend_lens):
                self._observe(self.prefill, features[start:end], -self.prefill_steps)
        self._host_s += time.perf_counter() - started

    def _observe(self, windowed: _Windowed | None, features: Any, step: int) -> None:
        width = int(features.shape[-1])
        self.input_width = width
        if windowed is None or windowed.observe(features, step):
            return
        if not self.width_warned:  # once per process: the width finding carries it from here
            self.width_warned = True
            probe = windowed.probe
            logger.warning("hs_tracer: draft input is %d wide, the fingerprint probe expects %d x %d; "
                           "fingerprints are off, the width finding stands", width, probe.num_slots,
                           probe.hidden)

    # ---- results (after _resolve_spec_v2_tokens) ---------------------------------------------------
    def record(self, result: Any, reqs: Sequence[Any], accept_lengths: Sequence[int],
               num_draft_tokens: int, max_accept_length: int | None) -> StepRecord | None:
        """The record of the step ``result`` belongs to, with the requests SGLang committed."""
        started = time.perf_counter()
        step = getattr(result, STEP_ATTR, None)
        digest = self._claim(step)
        keep = [i for i, r in enumerate(reqs) if request_settled(r)]
        if not keep:  # only requests finished or retracted before this step: no verify step
            self._host_s += time.perf_counter() - started
            return None
        rec = StepRecord(
            step=step if step is not None else 0, time_unix_ns=time.time_ns(), ranks=self.ranks,
            request_ids=[reqs[i].rid for i in keep],
            accept_lengths=[int(accept_lengths[i]) for i in keep],
            num_draft_tokens=num_draft_tokens, digest=digest, input_width=self.input_width,
            trace_ctxs=[getattr(getattr(reqs[i], "time_stats", None), "trace_ctx", None) for i in keep],
            max_accept_length=max_accept_length,
        )
        self._host_s += time.perf_counter() - started
        rec.host_overhead_s, self._host_s = self._host_s, 0.0
        self._enqueue(rec)
        return rec

    def _claim(self, step: int | None) -> StepDigest | None:
        if self.prefill is not None and self.prefill is not self.decode:
            self.prefill.probe.drain()  # prefill digests are not per-step records; windows carry them
        if self.decode is None:
            return None
        for sid, digest in self.decode.probe.drain():
            if sid > 0:  # prefill observations (negative numbers) are never a step's digest
                self._digests[sid] = digest
        found = self._digests.pop(step, None) if step is not None else None
        while len(self._digests) > self._max_pending:  # steps whose results never came (aborted)
            del self._digests[min(self._digests)]
        return found

"""Sampled capture of the draft's live input features to disk, for ``hs-tracer replay`` / ``diagnose``.

Off unless ``HS_TRACER_CAPTURE_DIR`` is set. The scheduler thread does only the cheap part: a
deterministic sampling decision (a credit counter: rate 0.01 takes every 100th step, 1.0 every step)
and, for a sampled step, a copy of the features and token ids that never waits on the device: on
CUDA an asynchronous copy into pinned host memory followed by an event, on CPU a clone. The
recorder thread calls :meth:`CaptureSink.poll`, which writes each capture whose event has completed
(``event.query()``, never ``synchronize()``) as one safetensors shard in the
:mod:`hs_tracer.profile.capture_format` layout, and rotates: the oldest shards are deleted when the
directory would exceed ``HS_TRACER_CAPTURE_MAX_BYTES``.

Which rows: the prefill draft extend (``EagleDraftWorker._draft_extend_for_prefill``): the
``[extend_tokens, K*H]`` target features of each request's prompt with the prompt's token ids,
their positions (``prefix_len + i``) and the token SGLang appends after the last row. Those rows are
whole causal prefixes, so replay can run the draft over them exactly as training does and score its
prediction against the actual next tokens. Decode verify windows are not captured: their rows mix
accepted and rejected draft tokens and the draft's own context from earlier steps, which a sampled
step does not carry. Accept lengths of sampled verify steps are written alongside (the recorder
already has them; the scheduler thread does nothing for them).

Captured hidden states are user data (prompts can be reconstructed from them): files are 0600 in a
0700 directory, and one warning line says so when capture starts.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hs_tracer.records import Ranks, WiringRecord

logger = logging.getLogger("hs_tracer")

ROWS = "prefill_draft_extend"
MAX_PENDING = 4  # captures copied but not yet written; more are dropped (counted), never queued
ACCEPT_IDLE_S = 0.5  # accept lengths are written once no step arrived for this long (a burst ended)
ACCEPT_FLUSH_S = 10.0  # ... or once the oldest waited this long, or this many are waiting:
ACCEPT_FLUSH_COUNT = 4096


class Sampler:
    """Deterministic fraction: every step adds ``rate`` credit; a step is taken when a whole unit
    has accumulated. No random numbers, no allocation."""

    __slots__ = ("credit", "rate")

    def __init__(self, rate: float) -> None:
        self.rate = float(rate)
        self.credit = 1.0 - 1e-9 if rate > 0 else 0.0  # the first eligible step is taken

    def take(self) -> bool:
        self.credit += self.rate
        if self.credit >= 1.0:
            self.credit -= 1.0
            return True
        return False


@dataclass
class _Pending:
    """One sampled prefill, copied off the device (or being copied: ``event`` not yet done)."""

    features: Any  # torch tensor on the host (pinned on CUDA)
    input_ids: Any
    next_token_ids: Any | None
    prefix_lens: list[int]
    extend_lens: list[int]
    event: Any | None = None  # torch.cuda.Event on CUDA

    def ready(self) -> bool:
        return self.event is None or bool(self.event.query())


def _host_copy(t: Any) -> tuple[Any, bool]:
    """``t`` on the host without a sync: (copy, is_async). CUDA: pinned buffer + non_blocking copy."""
    import torch

    if t.device.type == "cuda":
        buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        buf.copy_(t, non_blocking=True)
        return buf, True
    return t.detach().clone(), False


def capture_path(root: Path, ranks: Ranks | None) -> Path:
    """Where one scheduler writes: ``root`` itself for pp, DP-replica and attention-DP rank 0 (the
    usual single-process view), ``root/pp<i>-dp<j>`` (plus ``-adp<k>`` with DP attention) for the
    others (only attention-TP rank 0 of each captures)."""
    if ranks is None or (ranks.pp == 0 and ranks.dp == 0 and ranks.attn_dp == 0):
        return root
    name = f"pp{ranks.pp}-dp{ranks.dp}"
    return root / (f"{name}-adp{ranks.attn_dp}" if ranks.attn_dp else name)


class CaptureSink:
    """Owns one capture directory. ``offer_prefill`` runs on the scheduler thread; ``poll``,
    ``note_accept_lengths`` and ``flush`` on the recorder thread."""

    def __init__(self, root: Path, wiring: WiringRecord, *, rate: float, max_bytes: int,
                 ranks: Ranks | None = None, target_path: str | None = None) -> None:
        from hs_tracer import __version__
        from hs_tracer.profile import capture_format as cf

        self.path = capture_path(Path(root), ranks)
        self.max_bytes = int(max_bytes)
        self.sampler = Sampler(rate)
        self.accept_sampler = Sampler(rate)
        self.pending: collections.deque[_Pending] = collections.deque()
        self.dropped = 0  # sampled but not written (writer behind, or larger than the bound)
        self.written = 0
        self._oversized = 0  # prefills refused before any copy, not yet in the manifest
        self.stopped: str | None = None  # why capture stopped for good (the disk refused a write)
        self._accept: list[int] = []
        self._accept_since = self._accept_last = 0.0
        manifest = cf.CaptureManifest(
            num_slots=len(wiring.sources) or int(wiring.draft_num_aux_states or 1),
            hidden_size=wiring.hidden_size,
            sources=list(wiring.sources),
            layers_to_capture=list(wiring.layers_to_capture),
            num_layers=wiring.num_layers,
            target_arch=wiring.target_arch,
            producer=f"hs_tracer {__version__} / {wiring.engine} {wiring.engine_version}",
            model=wiring.model,
            target_path=target_path,
            engine=wiring.engine,
            engine_version=wiring.engine_version,
            sample_rate=float(rate),
            rows=ROWS,
            wiring=wiring.to_json(),
        )
        if cf.is_capture_dir(self.path):
            old = cf.read_manifest(self.path)
            if (old.num_slots, old.hidden_size, old.model, old.sources) != (
                    manifest.num_slots, manifest.hidden_size, manifest.model, manifest.sources):
                raise ValueError(
                    f"{self.path} already holds a capture of {old.model} "
                    f"({old.num_slots}x{old.hidden_size}, sources {old.sources}) from another wiring; "
                    "point HS_TRACER_CAPTURE_DIR at an empty directory"
                )
            manifest.shards, manifest.next_shard = old.shards, old.next_shard
            manifest.skipped = old.skipped
        self.writer = cf.CaptureWriter(self.path, manifest)
        self.writer.write_manifest()
        logger.warning(
            "hs_tracer: capturing the draft's input features of %.4g%% of prefill steps to %s (at most %d "
            "bytes): captures contain user data (prompts can be reconstructed from hidden states); files "
            "are 0600", 100 * rate, self.path, self.max_bytes,
        )

    # ---- scheduler thread ------------------------------------------------------------------------
    def offer_prefill(self, features: Any, input_ids: Any, next_token_ids: Any,
                      prefix_lens: Sequence[int], extend_lens: Sequence[int],
                      tail_tokens: Callable[[], Any] | None = None) -> None:
        """Maybe take this prefill's draft input. No host sync; keeps no reference to SGLang's tensors.

        Whether it fits ``max_bytes`` is decided from its shape before any host copy or pinned
        allocation. ``tail_tokens`` (called only for a taken prefill) gives the token SGLang appends
        after each request's last row: the sampled token, or for a non-final chunk of a chunked
        prefill the next prompt token; without it ``next_token_ids`` is recorded."""
        if features is None or input_ids is None or self.stopped or not self.sampler.take():
            return
        if len(self.pending) >= MAX_PENDING:
            self.dropped += 1
            return
        rows = int(features.shape[0])
        if features.numel() * features.element_size() + 16 * rows + 4096 > self.max_bytes:
            self.dropped += 1
            self._oversized += 1  # the recorder thread records it in the manifest
            return
        if tail_tokens is not None:
            next_token_ids = tail_tokens()
        feats, is_async = _host_copy(features)
        ids, _ = _host_copy(input_ids)
        nxt = _host_copy(next_token_ids)[0] if next_token_ids is not None else None
        event = None
        if is_async:
            import torch

            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(features.device))
        self.pending.append(_Pending(feats, ids, nxt, list(prefix_lens), list(extend_lens), event))

    # ---- recorder thread -------------------------------------------------------------------------
    def note_accept_lengths(self, lengths: Sequence[int]) -> None:
        """Accept lengths of one verify step (sampled at the capture rate)."""
        if not self.accept_sampler.take():
            return
        now = time.monotonic()
        if not self._accept:
            self._accept_since = now
        self._accept_last = now
        self._accept.extend(int(v) for v in lengths)

    def poll(self) -> int:
        """Write every capture whose copy has completed; flush old accept lengths. Returns shards written.

        A write the disk refuses (full, removed, read-only) stops capture for good with one log line;
        tracing and serving go on."""
        try:
            return self._poll()
        except OSError as exc:
            self._stop(exc)
            return 0

    def _stop(self, exc: OSError) -> None:
        if self.stopped is None:
            self.stopped = f"{exc.strerror or exc} ({self.path})"
            logger.error("hs_tracer: capture stopped: %s; tracing and serving continue", self.stopped)
        self.dropped += len(self.pending)
        self.pending.clear()
        self._accept = []

    def _poll(self) -> int:
        written = 0
        if self._oversized:
            self.writer.manifest.skipped += self._oversized
            self._oversized = 0
            self.writer.write_manifest()
        while self.pending and self.pending[0].ready():
            self._write(self.pending.popleft())
            written += 1
        now = time.monotonic()
        if self._accept and (len(self._accept) >= ACCEPT_FLUSH_COUNT
                             or now - self._accept_last >= ACCEPT_IDLE_S
                             or now - self._accept_since >= ACCEPT_FLUSH_S):
            self._write(None)
            written += 1
        return written

    def flush(self) -> None:
        """Write whatever is ready and pending accept lengths (at shutdown)."""
        self.poll()
        if self._accept and not self.stopped:
            try:
                self._write(None)
            except OSError as exc:
                self._stop(exc)

    def _write(self, cap: _Pending | None) -> None:
        import torch

        accept, self._accept = self._accept, []
        if cap is None:
            feats = torch.zeros((0, self.writer.manifest.num_slots * self.writer.manifest.hidden_size))
            ids = positions = torch.zeros(0, dtype=torch.int64)
            extras: dict[str, Any] = {}
        else:
            feats, ids = cap.features, cap.input_ids.long()
            positions = torch.cat([torch.arange(p, p + n) for p, n in zip(cap.prefix_lens, cap.extend_lens,
                                                                           strict=True)])
            if positions.numel() != feats.shape[0]:
                raise ValueError(f"prefill rows {feats.shape[0]} != extend lengths {positions.numel()}")
            extras = {"extend_lens": cap.extend_lens}
            if cap.next_token_ids is not None and cap.next_token_ids.numel() == len(cap.extend_lens):
                extras["next_token_ids"] = cap.next_token_ids.long()
        size = feats.numel() * feats.element_size() + 16 * (feats.shape[0] + len(accept)) + 4096
        if size > self.max_bytes:
            self.dropped += 1
            self.writer.manifest.skipped += 1
            self.writer.write_manifest()
            return
        self._rotate(size)
        self.writer.write(feats, ids, positions, accept or None, extras)
        self.written += 1

    def _rotate(self, incoming: int) -> None:
        """Delete the oldest shards until ``incoming`` more bytes fit under the bound."""
        while self.writer.manifest.shards and self.disk_bytes() + incoming > self.max_bytes:
            self.writer.drop_oldest()

    def disk_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.path.iterdir() if f.is_file())


def make_sink(capture_dir: Path, wiring: WiringRecord, rate: float, max_bytes: int, ranks: Ranks | None,
              target_path: str | None) -> CaptureSink | None:
    """The sink, or None (logged) when the directory cannot be used: capture must not stop tracing."""
    try:
        return CaptureSink(capture_dir, wiring, rate=rate, max_bytes=max_bytes, ranks=ranks,
                           target_path=target_path)
    except (OSError, ValueError) as exc:
        logger.error("hs_tracer: capture stays off: %s", exc)
        return None


__all__ = ["ROWS", "CaptureSink", "Sampler", "capture_path", "make_sink"]

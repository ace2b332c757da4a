"""The per-step fingerprint probe the SGLang hooks call: observe on the step path, drain later.

On CUDA, :meth:`FingerprintProbe.observe` enqueues the fused kernel on the current stream; the
kernel writes the step digest straight into a slot of a pinned host ring (or, where the GPU cannot
write that memory, into a device buffer that is then copied there asynchronously), and a CUDA event
is recorded behind it. :meth:`drain` returns the slots whose event has completed (``query()``),
oldest first; nothing ever waits for the GPU. The ring is bounded: when the host falls behind, the
oldest undrained slot is overwritten and :attr:`dropped` counts it.

Windows: the kernel adds per-channel count/sum/sumsq into device accumulators. :meth:`end_window`
(step thread, non-blocking) copies them asynchronously to pinned memory behind an event and zeroes
them in stream order; :meth:`read_window` (any thread, host only) folds the copies that have landed
into a float64 :class:`ChannelStats` and returns it. If both pinned window slots are still in
flight, the device keeps accumulating and the next window covers both (counted in
:attr:`window_skips`): nothing is lost, windows only get longer.

On CPU (testbed, CI) the same API runs the torch reference synchronously with float64 sums.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from hs_tracer.fingerprint.reference import ChannelAccumulators, fingerprint_host
from hs_tracer.fingerprint.stats import DIGEST_WIDTH, ChannelStats, StepDigest
from hs_tracer.fingerprint.verify import with_exact_count

if TYPE_CHECKING:
    from hs_tracer.fingerprint.kernel import KernelConfig

_WINDOW_SLOTS = 2


@dataclass
class _Slot:
    step_id: int
    tokens: int
    event: torch.cuda.Event | None  # None: computed on the host, ready now


class FingerprintProbe:
    """Fingerprints the draft input ``x [N, K*H]`` every step without a host-device sync.

    ``observe`` and ``end_window`` must be called from the thread and stream that produce ``x``
    (the scheduler's); ``drain`` and ``read_window`` only touch host memory and events.
    """

    def __init__(self, num_slots: int, hidden: int, device: torch.device | str, ring_size: int = 64, *,
                 window_steps: int = 0, warmup_dtype: torch.dtype | None = torch.bfloat16,
                 digest_to_host: bool | None = None, config: KernelConfig | None = None) -> None:
        """``window_steps > 0`` ends a window automatically every that many observed steps.
        ``warmup_dtype`` compiles the CUDA kernel now instead of on the first step (None: lazily).
        ``digest_to_host`` (CUDA): let the kernel write the digest into pinned memory directly
        (None: try it, fall back to an async copy). ``config``: a ``kernel.KernelConfig``."""
        if num_slots < 1 or hidden < 1 or ring_size < 1:
            raise ValueError(f"num_slots, hidden and ring_size must be positive, got "
                             f"{num_slots}, {hidden}, {ring_size}")
        self.num_slots = num_slots
        self.hidden = hidden
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.ring_size = ring_size
        self.window_steps = window_steps
        self._lock = threading.Lock()
        self._cuda = self.device.type == "cuda"
        self.dropped = 0
        self.width_mismatches = 0
        self.last_width: int | None = None
        self.window_skips = 0
        self.steps = 0
        self._steps_in_window = 0
        self._window = ChannelStats.zeros(num_slots, hidden)
        self._window_fresh = False
        if self._cuda:
            self._init_cuda(config, digest_to_host, warmup_dtype)
        else:
            self._acc = ChannelAccumulators.zeros(num_slots, hidden, self.device)
            self._ready: deque[tuple[int, StepDigest]] = deque()

    # ---- CUDA state -------------------------------------------------------------------------------
    def _init_cuda(self, config: KernelConfig | None, digest_to_host: bool | None,
                   warmup_dtype: torch.dtype | None) -> None:
        from hs_tracer.fingerprint import kernel

        k, h, r = self.num_slots, self.hidden, self.ring_size
        cfg = config if config is not None else kernel.DEFAULT_CONFIG
        self._ws = kernel.FingerprintWorkspace(k, h, self.device, cfg)
        self._acc = self._ws.acc
        self._launch = kernel.fingerprint_fused
        # Slots padded to 16 bytes: every slot has the alignment the kernel was compiled for.
        width = k * DIGEST_WIDTH
        ring = torch.zeros((r, -(-width // 4) * 4), dtype=torch.float32, pin_memory=True)
        self._ring_views = [ring[i, :width].view(k, DIGEST_WIDTH) for i in range(r)]
        self._ring_np = [v.numpy() for v in self._ring_views]
        self._slots: list[_Slot | None] = [None] * r
        self._events = [torch.cuda.Event() for _ in range(r)]
        self._head = 0  # next slot to write
        self._size = 0  # undrained slots, ending at _head
        self._win_count = torch.zeros((_WINDOW_SLOTS, k, h), dtype=torch.int32, pin_memory=True)
        self._win_sums = torch.zeros((_WINDOW_SLOTS, 2, k, h), dtype=torch.float32, pin_memory=True)
        self._win_events = [torch.cuda.Event() for _ in range(_WINDOW_SLOTS)]
        self._win_pending = [False] * _WINDOW_SLOTS
        self._direct = digest_to_host is not False
        if warmup_dtype is not None or digest_to_host is None:
            self._warmup(warmup_dtype or torch.bfloat16, probe_direct=digest_to_host is None)

    def _warmup(self, dtype: torch.dtype, probe_direct: bool) -> None:
        """Compile the kernel and check that it can write pinned memory; leaves no trace in the stats.

        Pinned memory is device-addressable under unified addressing (every 64-bit CUDA platform),
        so the kernel's last program can store the 20-byte-per-slot digest over the bus itself,
        saving a copy launch per step; the check below confirms the bytes arrived."""
        x = torch.ones((1, self.num_slots * self.hidden), dtype=dtype, device=self.device)
        stream = torch.cuda.current_stream(self.device)
        with torch.cuda.device(self.device):
            if self._direct:
                self._ring_np[0][:] = 0.0
                try:
                    self._launch(x, self._ws, self._ring_views[0])
                    stream.synchronize()  # construction time, not a step
                    ok = bool(np.all(self._ring_np[0][:, 1] == self.hidden))
                except Exception:
                    if not probe_direct:
                        raise
                    ok = False
                if not ok and not probe_direct:
                    raise RuntimeError("the fingerprint kernel could not write the pinned digest ring; "
                                       "construct the probe with digest_to_host=None or False")
                self._direct = ok
            if not self._direct:
                self._launch(x, self._ws)
            stream.synchronize()
        self._acc.reset()
        stream.synchronize()

    # ---- step path --------------------------------------------------------------------------------
    def observe(self, x: torch.Tensor, step_id: int) -> bool:
        """Fingerprint one step's draft input. Returns False (and counts it in
        :attr:`width_mismatches`, width in :attr:`last_width`) if ``x`` is not ``[N, K*H]``.

        No host sync, no allocation on CUDA, and no reference to ``x`` is kept (it may live in
        CUDA-graph memory that the next replay overwrites). Under CUDA-graph capture only the kernel
        is recorded (digest into the workspace's device buffer, window sums accumulate per replay).
        """
        width = x.shape[-1] if x.dim() >= 1 else 0
        if x.dim() != 2 or width != self.num_slots * self.hidden:
            with self._lock:
                self.width_mismatches += 1
                self.last_width = width
            return False
        if x.device != self.device:
            raise ValueError(f"probe lives on {self.device} but x is on {x.device}; "
                             f"create the probe on the device of the draft input")
        n = x.shape[0]
        if self._cuda:
            self._observe_cuda(x, n, step_id)
        else:
            digest = self._empty_digest()
            if n:
                raw = fingerprint_host(x, self.num_slots, self.hidden, self._acc)
                digest = self._digest(n, raw.numpy())
            with self._lock:
                if len(self._ready) == self.ring_size:
                    self._ready.popleft()
                    self.dropped += 1
                self._ready.append((step_id, digest))
        self._count_step()
        return True

    def _observe_cuda(self, x: torch.Tensor, n: int, step_id: int) -> None:
        if torch.cuda.current_device() != self.device.index:  # launches go to the current device
            with torch.cuda.device(self.device):
                return self._observe_cuda(x, n, step_id)
        if torch.cuda.is_current_stream_capturing():
            if n:
                self._launch(x, self._ws)
            return
        with self._lock:
            if self._size == self.ring_size:
                self._size -= 1
                self.dropped += 1
            slot = self._head
            event = None
            if n:
                if self._direct:
                    self._launch(x, self._ws, self._ring_views[slot])
                else:
                    self._launch(x, self._ws)
                    self._ring_views[slot].copy_(self._ws.digest, non_blocking=True)
                event = self._events[slot]
                event.record()
            self._slots[slot] = _Slot(step_id, n, event)
            self._head = (slot + 1) % self.ring_size
            self._size += 1

    def _count_step(self) -> None:
        self.steps += 1
        self._steps_in_window += 1
        if self.window_steps and self._steps_in_window >= self.window_steps:
            self.end_window()

    def end_window(self) -> None:
        """Close the current window: snapshot and zero the channel accumulators, without waiting."""
        with self._lock:
            self._steps_in_window = 0
            if not self._cuda:
                self._window = self._window.merge(self._acc.to_stats())
                self._window_fresh = True
                self._acc.reset()
                return
            if torch.cuda.is_current_stream_capturing():
                return
            self._fold_windows(block=False)
            free = [w for w in range(_WINDOW_SLOTS) if not self._win_pending[w]]
            if not free:
                self.window_skips += 1
                return
            w = free[0]
            with torch.cuda.device(self.device):
                self._win_count[w].copy_(self._acc.count, non_blocking=True)
                self._win_sums[w].copy_(self._acc.sums, non_blocking=True)
                self._acc.reset()  # stream-ordered after the copies
                self._win_events[w].record()
            self._win_pending[w] = True

    # ---- host side --------------------------------------------------------------------------------
    def drain(self) -> list[tuple[int, StepDigest]]:
        """Digests of completed steps, oldest first, as ``(step_id, digest)``. Never waits."""
        with self._lock:
            if not self._cuda:
                out = list(self._ready)
                self._ready.clear()
                return out
            out = []
            while self._size:
                slot = (self._head - self._size) % self.ring_size
                entry = self._slots[slot]
                assert entry is not None
                if entry.event is not None and not entry.event.query():
                    break
                tokens = entry.tokens
                digest = self._digest(tokens, self._ring_np[slot]) if tokens else self._empty_digest()
                out.append((entry.step_id, digest))
                self._slots[slot] = None
                self._size -= 1
            return out

    def read_window(self, block: bool = False) -> ChannelStats | None:
        """Per-channel stats of the windows whose snapshot has landed since the last read, merged;
        None if none has. ``block=True`` waits for snapshots in flight (shutdown and tests only)."""
        with self._lock:
            if self._cuda:
                self._fold_windows(block)
            if not self._window_fresh:
                return None
            out = self._window
            self._window = ChannelStats.zeros(self.num_slots, self.hidden)
            self._window_fresh = False
            return out

    def _fold_windows(self, block: bool) -> None:
        for w in range(_WINDOW_SLOTS):
            if not self._win_pending[w]:
                continue
            if block:
                self._win_events[w].synchronize()
            elif not self._win_events[w].query():
                continue
            sums = self._win_sums[w].numpy()
            self._window.count += self._win_count[w].numpy()
            self._window.sum += sums[0]
            self._window.sumsq += sums[1]
            self._window_fresh = True
            self._win_pending[w] = False

    def _digest(self, tokens: int, raw: np.ndarray) -> StepDigest:
        return StepDigest.from_raw(tokens, with_exact_count(raw, tokens, self.hidden))

    def _empty_digest(self) -> StepDigest:
        return StepDigest.from_raw(0, np.zeros((self.num_slots, DIGEST_WIDTH)))

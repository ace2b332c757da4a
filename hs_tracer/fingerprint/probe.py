"""The per-step fingerprint probe the SGLang hooks call: observe on the step path, drain later.

On CUDA, :meth:`FingerprintProbe.observe` enqueues the fused kernel on the current stream, through a
:class:`~hs_tracer.fingerprint.launch.StepLauncher` (a one-kernel CUDA graph replayed per input
address, or a direct launch). The kernel writes the step's partial sums straight into the next row
of a pinned host ring, every word tagged with its launch (:class:`~hs_tracer.fingerprint.ring.DigestRing`);
:meth:`drain` returns the digests of the rows that have landed, oldest first, from any one thread. Nothing
ever waits for the GPU, and the step path records no event and builds no digest: it notes
``(launch, step, tokens)`` and launches. The ring is bounded: when the reader falls behind, the
oldest unread rows are overwritten and :attr:`dropped` counts them.

Windows: the kernel adds per-channel count/sum/sumsq into device accumulators. :meth:`end_window` (step
thread, non-blocking) copies them asynchronously to pinned memory behind an event and zeroes them in
stream order; :meth:`read_window` (any thread, host only) folds the copies that have landed into a
float64 :class:`ChannelStats` and returns it (``end_window`` folds too, but only when every snapshot
slot is taken: one fold took ~70 µs of numpy at K x H = 3 x 7168 on a 2-vCPU CPU machine). If every
pinned window slot is still in flight, the device keeps accumulating and the next window covers them
(counted in :attr:`window_skips`): nothing is lost, windows only get longer.

Recorded into the target's graphs: under SGLang's CUDA graphs the draft input is an output of the
target's verify graph, so the kernel can be part of that graph (:meth:`record_in_graph`, called
while SGLang captures it) and the step path has nothing to launch: it notes the step in a ring of
its own. The graph is captured for a padded batch; the kernel reads only the rows whose KV-cache
slot is non-zero (SGLang zeroes the padding's slots on every replay and never hands out slot 0),
counts them into the digest, and the drain checks that count against the rows the step path saw.
Any disagreement, or launches the step path never noted (a replay it did not see), stops the
recorded kernels for good (:attr:`in_graph_fault`; a device flag read by the kernel) and the steps
go back to a launch each.

On CPU (testbed, CI) the same API runs the torch reference synchronously with float64 sums.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import ClassVar

import numpy as np
import torch

from hs_tracer.fingerprint.reference import ChannelAccumulators, fingerprint_host
from hs_tracer.fingerprint.stats import DIGEST_WIDTH, ChannelStats, StepDigest

logger = logging.getLogger("hs_tracer")

_IN_GRAPH_LEAD = 8
"""Launches the target's graph may run ahead of the step path's notes (it notes a step once the
graph replayed; one replay is in flight at most, the rest is margin)."""

_RING_BYTES = 8 << 20
"""Pinned bytes per digest ring at most: on CUDA a ring row holds every program's partial sums
(about 21 KB at K x H = 3 x 7168), so a ring keeps at most the power of two of rows that fits (256
there: the recorder drains every 50 ms, room for 5,000 steps a second)."""

_WINDOW_SLOTS = 8
"""Pinned snapshot slots for closed windows: windows close at most every 0.1 s (the step path's
``MIN_WINDOW_S``) and the recorder frees slots at least every 0.5 s while steps flow, so 8 leave
room; only with all of them in flight does ``end_window`` fold on the scheduler thread."""


class FingerprintProbe:
    """Fingerprints the draft input ``x [N, K*H]`` every step without a host-device sync.

    ``observe`` and ``end_window`` must be called from the thread and stream that produce ``x``
    (the scheduler's); ``drain`` and ``read_window`` only touch host memory and events, from one
    thread at a time (the recorder's).
    """

    GPU_TIMING_ROWS: ClassVar[int] = 64  # rows of the step whose kernel time is timed: batch 16 x 4 tokens
    GPU_TIMING_LAUNCHES: ClassVar[int] = 21

    def __init__(self, num_slots: int, hidden: int, device: torch.device | str, ring_size: int = 64, *,
                 window_steps: int = 0, warmup_dtype: torch.dtype = torch.bfloat16,
                 graphs: bool = True) -> None:
        """``window_steps > 0`` ends a window automatically every that many observed steps.
        ``warmup_dtype``: the input dtype the CUDA kernel is compiled and checked for at
        construction. ``graphs`` (CUDA): replay per-input CUDA graphs instead of launching each
        step."""
        if num_slots < 1 or hidden < 1 or ring_size < 1:
            raise ValueError(f"num_slots, hidden and ring_size must be positive, got "
                             f"{num_slots}, {hidden}, {ring_size}")
        self.num_slots = num_slots
        self.hidden = hidden
        self._width = num_slots * hidden
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.ring_size = ring_size
        self.window_steps = window_steps
        self._lock = threading.Lock()
        self._cuda = self.device.type == "cuda"
        self._dropped = 0  # CPU path; on CUDA the ring counts
        self.width_mismatches = 0
        self.last_width: int | None = None
        self.window_skips = 0
        self.steps = 0
        self._steps_in_window = 0
        self._window = ChannelStats.zeros(num_slots, hidden)
        self._window_fresh = False
        # GPU seconds of the fused kernel per step (GPU_TIMING_ROWS rows), timed at warm-up; None on
        # the CPU, where the reference runs on the host inside the hook's own time.
        self.kernel_gpu_s: float | None = None
        if self._cuda:
            self._init_cuda(graphs, warmup_dtype)
        else:
            self._acc = ChannelAccumulators.zeros(num_slots, hidden, self.device)
            self._ready: deque[tuple[int, int, np.ndarray]] = deque()

    # ---- CUDA state -------------------------------------------------------------------------------
    def _init_cuda(self, graphs: bool, warmup_dtype: torch.dtype) -> None:
        from hs_tracer.fingerprint import kernel, launch
        from hs_tracer.fingerprint.ring import DigestRing, row_words

        k, h = self.num_slots, self.hidden
        self._index = self.device.index
        self._ws = kernel.FingerprintWorkspace(k, h, self.device)
        self._acc = self._ws.acc
        programs = self._ws.programs
        rows = max(1, min(self.ring_size, _RING_BYTES // (8 * row_words(programs))))
        self.ring_size = 1 << (rows.bit_length() - 1)  # a power of two (ring.DigestRing)
        self._ring = DigestRing(k, h, self.ring_size, self.device, pinned=True, programs=programs)
        target = kernel.RingTarget(self._ring.records, self._ring.seq)
        capture = launch.cuda_graph_capture(self.device) if graphs else None
        self.launcher = launch.StepLauncher(self._ws, target, capture)
        self._capturing = launch.stream_capturing
        self._replays = self.launcher.replays_by_key
        self._idle: deque[int] = deque(maxlen=self.ring_size)  # N=0 steps: digest is known on the host
        # Launches recorded into the target's graphs: scratch and ring of their own (their launches
        # run inside SGLang's replays, possibly on another stream), the same window accumulators.
        self._ig_ws = kernel.FingerprintWorkspace(k, h, self.device, acc=self._acc)
        self._ig_ring = DigestRing(k, h, self.ring_size, self.device, pinned=True, programs=programs,
                                    lead=min(_IN_GRAPH_LEAD, self.ring_size // 2))
        self._ig_target = kernel.RingTarget(self._ig_ring.records, self._ig_ring.seq)
        self._ig_on = torch.ones(1, dtype=torch.int32, device=self.device)
        self.in_graph_inputs: dict[int, int] = {}  # graph output fingerprinted in its graph: address -> rows
        self.in_graph_fault: str | None = None  # set by the drain; the step path then stops them
        self.in_graph_mismatches = 0
        self._win_count = torch.zeros((_WINDOW_SLOTS, k, h), dtype=torch.int32, pin_memory=True)
        self._win_sums = torch.zeros((_WINDOW_SLOTS, 2, k, h), dtype=torch.float32, pin_memory=True)
        self._win_events = [torch.cuda.Event() for _ in range(_WINDOW_SLOTS)]
        self._win_pending = [False] * _WINDOW_SLOTS
        self._win_held = [False] * _WINDOW_SLOTS  # handed out by landed_windows, not yet released
        self._warmup(warmup_dtype)
        # One graph per slot replays its snapshot (two copies and the zeroing) in one call: issued
        # as single torch calls they cost the scheduler thread ~20 µs in a hot loop and 150-185 µs
        # inside SGLang, where every call runs on cold caches (benchmarks/gpu_sglang.py
        # --host-breakdown); None where graphs are off or cannot be captured.
        self._win_snapshots: list[launch.GraphLaunch] | None = None
        if capture is not None:
            try:
                self._win_snapshots = [capture(lambda w=w: self._snapshot(w)) for w in range(_WINDOW_SLOTS)]
            except Exception:  # graphs are an optimisation: snapshot with single calls
                self._win_snapshots = None

    def _warmup(self, dtype: torch.dtype) -> None:
        """Compile the kernel (plain and masked, one row count per tier of the workspace), check that
        it can write the pinned rings; no trace left. Nothing may compile while SGLang captures its
        graphs, nor on the step path.

        Pinned memory is device-addressable under unified addressing (every 64-bit CUDA platform),
        so the kernel's programs store their tagged partial sums over the bus themselves; the check
        below confirms that the bytes arrived."""
        from hs_tracer.fingerprint.kernel import fingerprint_fused

        bounds = [most for most, _cfg in self._ws.tiers if most is not None]
        counts = [*bounds, (bounds[-1] + 1) if bounds else 1]  # a row count in every tier
        x = torch.ones((max(counts), self._width), dtype=dtype, device=self.device)
        valid = torch.ones(max(counts), dtype=torch.int64, device=self.device)
        stream = torch.cuda.current_stream(self.device)
        with torch.cuda.device(self.device):
            for n in counts:
                self._ring.note(-1, n)
                self.launcher.launch(x[:n], n)
                self._ig_ring.note(-1, n)
                fingerprint_fused(x[:n], self._ig_ws, ring=self._ig_target, valid=valid[:n],
                                  enable=self._ig_on)
            stream.synchronize()  # construction time, not a step
            want = [n * self.hidden for n in counts]
            if [float(raw[0, 1]) for _s, _t, raw in self._ring.drain()] != want:
                raise RuntimeError("the fingerprint kernel could not write its digest into pinned host "
                                   "memory; fingerprints need a GPU with unified addressing")
            if [float(raw[0, 0]) for _s, _t, raw in self._ig_ring.drain()] != want:
                raise RuntimeError("the masked fingerprint launch did not write its digest")
            self.launcher.direct = 0
            self._ig_ring.skip_launched()
            self._ig_warmup = self._ig_ring.launched  # not steps (in_graph_steps)
            self.kernel_gpu_s = self._time_kernel(dtype, stream)
            self._acc.reset()
            stream.synchronize()

    def _time_kernel(self, dtype: torch.dtype, stream: torch.cuda.Stream) -> float | None:
        """The kernel's GPU time for one step of ``GPU_TIMING_ROWS`` rows as it runs while serving:
        the masked launch, digest into a pinned ring, ``GPU_TIMING_LAUNCHES`` of them captured in
        one CUDA graph over rotating random inputs and replayed (median of five replays, per
        launch). Events around single launches would add the host's launch latency to it. Measured
        once here, at construction, where a sync is allowed: the per-step GPU part of hs_tracer's
        own cost, which no host clock sees. A workspace and ring of its own (nothing reaches the
        window or the step ring). None if the timing fails (it is a report, not a check)."""
        from hs_tracer.fingerprint import kernel
        from hs_tracer.fingerprint.ring import DigestRing

        try:
            rows, launches = self.GPU_TIMING_ROWS, self.GPU_TIMING_LAUNCHES
            xs = [torch.randn((rows, self._width), device=self.device).to(dtype) for _ in range(4)]
            valid = torch.ones(rows, dtype=torch.int64, device=self.device)
            ws = kernel.FingerprintWorkspace(self.num_slots, self.hidden, self.device)
            ring = DigestRing(self.num_slots, self.hidden, 4, self.device, pinned=True, programs=ws.programs)
            target = kernel.RingTarget(ring.records, ring.seq)

            def launch(i: int) -> None:
                kernel.fingerprint_fused(xs[i % len(xs)], ws, ring=target, valid=valid, enable=self._ig_on)

            launch(0)  # binds this specialisation through the JIT
            side = torch.cuda.Stream(self.device)
            side.wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=side, capture_error_mode="thread_local"):
                for i in range(launches):
                    launch(i)
            stream.wait_stream(side)
            graph.replay()
            times = []
            for _ in range(5):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record(stream)
                graph.replay()
                end.record(stream)
                end.synchronize()  # construction time, not a step
                times.append(start.elapsed_time(end) / 1e3 / launches)
            del graph
            return sorted(times)[len(times) // 2]
        except Exception:  # the kernel worked above: only the timing failed; report it as unknown
            logger.debug("hs_tracer: could not time the fingerprint kernel", exc_info=True)
            return None

    # ---- step path --------------------------------------------------------------------------------
    def observe(self, x: torch.Tensor, step_id: int) -> bool:
        """Fingerprint one step's draft input. Returns False (and counts it in
        :attr:`width_mismatches`, width in :attr:`last_width`) if ``x`` is not ``[N, K*H]``.

        No host sync, no allocation on CUDA, and no reference to ``x`` is kept (it may live in
        CUDA-graph memory that the next replay overwrites). Under CUDA-graph capture only the kernel
        is recorded (digest into the workspace's device buffer, window sums accumulate per replay).
        """
        return self.observe_rows(x, step_id) >= 0

    def observe_rows(self, x: torch.Tensor, step_id: int) -> int:
        """:meth:`observe`, returning the rows fingerprinted (``N``, 0 for an idle step) or -1 if ``x``
        is not ``[N, K*H]``: the step path needs the count and, this way, never reads ``x.shape``
        itself. An input whose launch graph exists (it was checked when the graph was made) goes
        straight to the replay."""
        if self._cuda:
            ptr, shape = x.data_ptr(), x.shape
            if ptr in self.in_graph_inputs and self.in_graph_fault is None and shape[-1] == self._width:
                n = shape[0]  # the target's graph fingerprinted it: note the step, nothing to launch
                if n:
                    self._ig_ring.note(step_id, n)
                else:
                    self._idle.append(step_id)
            else:
                if self.in_graph_fault is not None and self.in_graph_inputs:
                    self._stop_in_graph()
                replay = self._replays.get((ptr, shape, x.stride(), x.dtype))
                if replay is not None:
                    n = shape[0]
                    self._ring.note(step_id, n)
                    if replay():
                        self.launcher.replays += 1
                    else:  # the stream is capturing: nothing was launched, the kernel goes into the capture
                        self._ring.unnote()
                        self._observe_cuda(x, n, step_id)
                else:
                    n = self._checked_rows(x)
                    if n >= 0:
                        self._observe_cuda(x, n, step_id)
        else:
            n = self._checked_rows(x)
            if n >= 0:
                self._observe_host(x, n, step_id)
        if n < 0:
            return n
        self.steps += 1
        if self.window_steps:
            self._steps_in_window += 1
            if self._steps_in_window >= self.window_steps:
                self.end_window()
        return n

    def _checked_rows(self, x: torch.Tensor) -> int:
        """Rows of ``x`` if it is ``[N, K*H]`` on the probe's device, else -1 (counted); raises for
        another device."""
        shape = x.shape
        if len(shape) != 2 or shape[1] != self._width:
            with self._lock:
                self.width_mismatches += 1
                self.last_width = shape[-1] if shape else 0
            return -1
        if (x.get_device() != self._index) if self._cuda else (x.device != self.device):
            raise ValueError(f"probe lives on {self.device} but x is on {x.device}; "
                             f"create the probe on the device of the draft input")
        return shape[0]

    def _observe_host(self, x: torch.Tensor, n: int, step_id: int) -> None:
        raw = np.zeros((self.num_slots, DIGEST_WIDTH))
        if n:
            raw = fingerprint_host(x, self.num_slots, self.hidden, self._acc).numpy()
        with self._lock:
            if len(self._ready) == self.ring_size:
                self._ready.popleft()
                self._dropped += 1
            self._ready.append((step_id, n, raw))

    def _observe_cuda(self, x: torch.Tensor, n: int, step_id: int) -> None:
        if torch._C._cuda_getDevice() != self._index:  # launches go to the current device
            with torch.cuda.device(self.device):
                return self._observe_cuda(x, n, step_id)
        if self._capturing():
            if n:
                from hs_tracer.fingerprint.kernel import fingerprint_fused

                fingerprint_fused(x, self._ws)
            return
        if not n:
            self._idle.append(step_id)
            return
        self._ring.note(step_id, n)
        self.launcher.launch(x, n)

    def record_in_graph(self, x: torch.Tensor, valid: torch.Tensor) -> bool:
        """While the current stream captures a CUDA graph whose output ``x [P, K*H]`` (a padded batch)
        becomes a later step's draft input: record the masked kernel into that graph, reading the
        rows whose ``valid`` entry (P integers the graph's replays refill, 0 for padding) is
        non-zero. Steps whose input is ``x`` (or a view of its first rows) then only note
        themselves. False, recording nothing, where this cannot be done safely (not capturing, not
        ``[P, K*H]`` on this device, or a kernel specialisation that would need compiling)."""
        from hs_tracer.fingerprint import kernel

        if not self._cuda or not self._capturing() or self.in_graph_fault is not None:
            return False
        shape = x.shape
        if (len(shape) != 2 or shape[1] != self._width or shape[0] < 1
                or x.get_device() != self._index or valid.dim() != 1 or valid.shape[0] < shape[0]
                or valid.get_device() != self._index):
            return False
        if valid.dtype != torch.int64:
            valid = valid.to(torch.int64)  # recorded into the graph too
        valid = valid[:shape[0]]
        if not kernel.is_compiled(x, self._ig_ws, self._ig_target, valid):
            return False
        kernel.fingerprint_fused(x, self._ig_ws, ring=self._ig_target, valid=valid, enable=self._ig_on)
        self.in_graph_inputs[x.data_ptr()] = shape[0]
        return True

    def stop_in_graph(self, reason: str) -> None:
        """Switch the launches recorded into the target's graphs off (from the thread and stream
        that replay them): later replays read nothing, and steps launch their own kernel."""
        self._fault(reason)
        if self._cuda and self.in_graph_inputs:
            self._stop_in_graph()

    def _stop_in_graph(self) -> None:
        """Step thread: the recorded launches read nothing from the next replay on (stream order)."""
        self._ig_on.zero_()
        self.in_graph_inputs.clear()
        logger.warning("hs_tracer: %s; the fingerprint kernel recorded into the target's CUDA graphs "
                       "is switched off and each step launches its own", self.in_graph_fault)

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
            free = [w for w in range(_WINDOW_SLOTS) if not self._win_pending[w]]
            if not free:  # folding is the reader's (read_window); here only when no slot is free
                self._window_fresh |= self._fold_windows(False)
                free = [w for w in range(_WINDOW_SLOTS) if not self._win_pending[w]]
            if not free:
                self.window_skips += 1
                return
            w = free[0]
            snapshots = self._win_snapshots
            if snapshots is not None and torch._C._cuda_getDevice() == self._index and snapshots[w].replay():
                self._win_events[w].record()
            else:
                with torch.cuda.device(self.device):
                    self._snapshot(w)
                    self._win_events[w].record()
            self._win_pending[w] = True

    def _snapshot(self, w: int) -> None:
        """Copy the channel accumulators into snapshot slot ``w`` and zero them (stream-ordered)."""
        self._win_count[w].copy_(self._acc.count, non_blocking=True)
        self._win_sums[w].copy_(self._acc.sums, non_blocking=True)
        self._acc.reset()

    # ---- host side --------------------------------------------------------------------------------
    def drain(self) -> list[tuple[int, StepDigest]]:
        """Digests of completed steps, oldest first, as ``(step_id, digest)``. Never waits."""
        return [(step, self.digest_of(tokens, raw)) for step, tokens, raw in self.drain_raw()]

    def drain_raw(self) -> list[tuple[int, int, np.ndarray]]:
        """:meth:`drain` without building digests: ``(step_id, tokens, raw [K, 5])``, the raw sums as
        the kernel wrote them (turn one into a digest with :meth:`digest_of`)."""
        if not self._cuda:
            with self._lock:
                out = list(self._ready)
                self._ready.clear()
                return out
        steps, tokens, raws = self.drain_block()
        return list(zip(steps.tolist(), tokens.tolist(), raws, strict=True))

    def drain_block(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`drain_raw` as arrays, oldest first: step ids ``[n]``, tokens ``[n]`` (int64) and raw
        sums ``[n, K, 5]`` (on CUDA straight from the rings, a few array operations per call)."""
        if not self._cuda:
            out = self.drain_raw()
            raws = np.zeros((len(out), self.num_slots, DIGEST_WIDTH))
            for i, (_step, _tokens, raw) in enumerate(out):
                raws[i] = raw
            return (np.fromiter((step for step, _t, _r in out), np.int64, len(out)),
                    np.fromiter((tokens for _s, tokens, _r in out), np.int64, len(out)), raws)
        blocks = [self._ring.drain_block()]
        if self._ig_ring.launched:
            blocks.append(self._drain_in_graph())
        if self._idle:
            idle = np.array([self._idle.popleft() for _ in range(len(self._idle))], dtype=np.int64)
            blocks.append((idle, np.zeros_like(idle), np.zeros((idle.size, self.num_slots, DIGEST_WIDTH),
                                                              dtype=np.float32)))
        if len(blocks) == 1:
            return blocks[0]
        steps, tokens, raws = (np.concatenate(parts) for parts in zip(*blocks, strict=True))
        order = np.argsort(steps, kind="stable")
        return steps[order], tokens[order], raws[order]

    def _drain_in_graph(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The in-graph ring's landed digests whose row count (the kernel's, from the KV slots)
        matches the rows the step path saw; a mismatch, launches nobody noted, or notes that never
        land set :attr:`in_graph_fault` (the step path then switches the recorded launches off)."""
        ring = self._ig_ring
        steps, tokens, raws = ring.drain_block()
        if steps.size:
            read = kernel_rows(raws, self.hidden)
            ok = np.abs(read - tokens) < 0.5
            if not ok.all():
                bad = int(np.flatnonzero(~ok)[0])
                self.in_graph_mismatches += int(np.count_nonzero(~ok))
                if read[bad] < 0:  # the kernel's mark for real rows that were not a prefix
                    self._fault(f"the target's graph held padding between the real rows of step {steps[bad]}")
                else:
                    self._fault(f"the target's graph fingerprinted {read[bad]:.0f} rows of step "
                                f"{steps[bad]}, the step path saw {tokens[bad]}")
                steps, tokens, raws = steps[ok], tokens[ok], raws[ok]
        ahead = ring.device_ahead()
        if ahead > ring.lead:
            self._fault(f"the target's graphs ran the fingerprint kernel {ahead} times more than the "
                        f"steps the step path saw")
        elif ring.pending() > ring.size // 4:
            self._fault(f"{ring.pending()} steps noted for the target's graphs were never fingerprinted")
        return steps, tokens, raws

    def _fault(self, reason: str) -> None:
        if self.in_graph_fault is None:
            self.in_graph_fault = reason

    def digest_of(self, tokens: int, raw: np.ndarray) -> StepDigest:
        """The digest of raw sums from :meth:`drain_raw` (count made exact on the host)."""
        return StepDigest.from_kernel(tokens, raw, self.hidden)

    @property
    def dropped(self) -> int:
        """Steps whose digest was overwritten before it was drained (the rings are bounded)."""
        return self._ring.dropped + self._ig_ring.dropped if self._cuda else self._dropped

    @property
    def in_graph_steps(self) -> int:
        """Steps fingerprinted by the kernel recorded into the target's graphs so far."""
        return self._ig_ring.launched - self._ig_warmup if self._cuda else 0

    def read_window(self, block: bool = False) -> ChannelStats | None:
        """Per-channel stats of the windows whose snapshot has landed since the last read, merged
        (float64); None if none has. ``block=True`` waits for snapshots in flight (shutdown and
        tests only)."""
        with self._lock:
            if self._cuda:
                self._window_fresh |= self._fold_windows(block)
            if not self._window_fresh:
                return None
            out, self._window_fresh = self._window, False
            self._window = ChannelStats.zeros(self.num_slots, self.hidden)
            return out

    def landed_windows(self) -> list[tuple[int, ChannelStats]]:
        """The windows whose snapshot has landed, unmerged, as ``(slot, stats)``: on CUDA views of the
        pinned snapshot slots in their own int32/float32 (nothing copied or added up), valid until
        :meth:`release_windows` frees those slots; slot -1 is a float64 window merged on the host
        (the CPU path, or what ``end_window`` folded when every slot was taken). For a reader that
        sends windows elsewhere instead of folding them (the recorder hands them to the export
        process)."""
        out: list[tuple[int, ChannelStats]] = []
        with self._lock:
            if self._window_fresh:
                out.append((-1, self._window))
                self._window, self._window_fresh = ChannelStats.zeros(self.num_slots, self.hidden), False
            if not self._cuda:
                return out
            for w in range(_WINDOW_SLOTS):
                if self._win_pending[w] and not self._win_held[w] and self._win_events[w].query():
                    sums = self._win_sums[w].numpy()
                    out.append((w, ChannelStats(self._win_count[w].numpy(), sums[0], sums[1])))
                    self._win_held[w] = True
        return out

    def release_windows(self, slots: list[int]) -> None:
        """Free the snapshot slots of windows from :meth:`landed_windows` (-1 needs no freeing)."""
        with self._lock:
            for w in slots:
                if w >= 0:
                    self._win_pending[w] = self._win_held[w] = False

    def _fold_windows(self, block: bool) -> bool:
        """Add the snapshots that landed to the host window, freeing their slots; whether any had."""
        into = self._window
        folded = False
        for w in range(_WINDOW_SLOTS):
            if not self._win_pending[w] or self._win_held[w]:  # a held slot is being read elsewhere
                continue
            if block:
                self._win_events[w].synchronize()
            elif not self._win_events[w].query():
                continue
            sums = self._win_sums[w].numpy()
            into.count += self._win_count[w].numpy()
            into.sum += sums[0]
            into.sumsq += sums[1]
            self._win_pending[w] = False
            folded = True
        return folded


def kernel_rows(raws: np.ndarray, hidden: int) -> np.ndarray:
    """Rows each raw digest ``[n, K, 5]`` covers, from its first slot's count of finite values and
    of non-finite ones (the two add up to rows x ``hidden``); -1 where a masked launch marked real
    rows that were not a prefix (``kernel.fingerprint_fused``)."""
    return (raws[:, 0, 0].astype(np.float64) + raws[:, 0, 4]) / hidden

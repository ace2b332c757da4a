"""The per-step launch of the fused kernel, at the lowest host cost the input allows.

A kernel launch through Triton's launcher costs the scheduler thread ~10 µs (argument marshalling
for 25 arguments, the stream lookup, the driver call); replaying a CUDA graph that holds the same
launch costs one driver call. The replay checks that the current stream is not capturing and calls
the driver's ``cuGraphLaunch`` on the graph's executable, both in one call of a small C helper
(``native.py``); where that cannot be built, through ctypes after torch's capture check, and where
the driver library or the handle is not to be had, through ``torch.cuda.CUDAGraph.replay`` (which
adds a device guard and its Python binding). benchmarks/graph_launch_gpu.py times each way.

A graph freezes the kernel's arguments, the input's address among them, so one graph serves one
(address, rows, strides, dtype). That is exactly what SGLang's decode gives the probe: the draft input
is the target's CUDA-graph output, whose address is fixed per batch-size bucket, so a handful of graphs
cover a whole serving run. An input seen ``promote_after`` times gets its graph; anything else (eager
mode, a fresh allocation each step) is launched directly. The digest row is picked on the device
(``kernel.RingTarget``), so a replayed launch still fills the next row of the ring.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

import torch

from hs_tracer.fingerprint.kernel import FingerprintWorkspace, RingTarget, fingerprint_fused

logger = logging.getLogger("hs_tracer")


class Replayable(Protocol):
    def replay(self) -> bool: ...


Capture = Callable[[Callable[[], None]], Replayable]
Key = tuple[int, tuple[int, ...], tuple[int, ...], torch.dtype]


def launch_key(x: torch.Tensor) -> Key:
    """What a captured launch freezes of its input: address, shape, strides, dtype."""
    return (x.data_ptr(), x.shape, x.stride(), x.dtype)


def _driver_graph_launch() -> Callable[[int, int], int] | None:
    """``cuGraphLaunch(exec, stream)`` of the CUDA driver this process already loaded, or None.
    Loaded as a ``PyDLL``: the call keeps the GIL (a few µs). A call that dropped it would let any
    other thread of the scheduler process (the recorder's) take the GIL in the middle of the step,
    and the scheduler thread would wait for it to be handed back."""
    import ctypes

    try:
        fn = ctypes.PyDLL("libcuda.so.1").cuGraphLaunch
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


def _driver_entry_points() -> tuple[int, int] | None:
    """Addresses of the driver's ``cuGraphLaunch`` and ``cuStreamIsCapturing``, or None."""
    import ctypes

    try:
        lib = ctypes.CDLL("libcuda.so.1")
        return (ctypes.cast(lib.cuGraphLaunch, ctypes.c_void_p).value,
                ctypes.cast(lib.cuStreamIsCapturing, ctypes.c_void_p).value)
    except (OSError, AttributeError):
        return None


stream_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", lambda: False)
"""Whether the current stream is capturing a CUDA graph (torch's C call itself: one frame less)."""


class GraphLaunch:
    """A captured one-kernel graph. :attr:`replay` launches it on the current stream and returns
    True, or returns False without launching while that stream is capturing a graph (the caller
    then records the kernel into that capture instead). :attr:`way` says how it launches:
    ``native`` (the C helper, ``native.py``: the capture check and ``cuGraphLaunch`` in one call),
    ``ctypes`` (``cuGraphLaunch`` through ctypes after torch's capture check) or ``torch``
    (``CUDAGraph.replay``), the first that this machine offers."""

    def __init__(self, graph: torch.cuda.CUDAGraph, device_index: int) -> None:
        self.graph = graph  # owns the executable the raw launches use
        self.way = "torch"
        self.replay: Callable[[], bool] = self._torch_replay
        handle = getattr(graph, "raw_cuda_graph_exec", None)
        if handle is None:
            return
        exec_ = handle()
        stream_of = torch._C._cuda_getCurrentRawStream
        from hs_tracer.fingerprint import native

        helper, entry = native.load(), _driver_entry_points()
        if helper is not None and entry is not None:
            c_replay, (launch, is_capturing) = helper.replay, entry

            def replay() -> bool:
                err = c_replay(launch, is_capturing, exec_, stream_of(device_index))
                if err > 0:
                    raise RuntimeError(f"cuGraphLaunch failed for the fingerprint graph (CUresult {err})")
                return err == 0

            self.replay, self.way = replay, "native"
            return
        ctypes_launch = _driver_graph_launch()
        if ctypes_launch is None:
            return

        def ctypes_replay() -> bool:
            if stream_capturing():
                return False
            err = ctypes_launch(exec_, stream_of(device_index))
            if err:
                raise RuntimeError(f"cuGraphLaunch failed for the fingerprint graph (CUresult {err})")
            return True

        self.replay, self.way = ctypes_replay, "ctypes"

    def _torch_replay(self) -> bool:
        if stream_capturing():
            return False
        self.graph.replay()
        return True


def cuda_graph_capture(device: torch.device) -> Capture:
    """Capture a launch into a CUDA graph on a private stream, without a device sync: nothing runs
    while capturing, and ``thread_local`` mode leaves other threads' CUDA calls alone."""
    stream = torch.cuda.Stream(device)
    pool = torch.cuda.graph_pool_handle()
    index = device.index if device.index is not None else torch.cuda.current_device()

    def capture(launch: Callable[[], None]) -> GraphLaunch:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                launch()
            finally:
                graph.capture_end()
        return GraphLaunch(graph, index)

    return capture


class StepLauncher:
    """Launches the fused kernel for one probe into one ring.

    ``capture=None`` launches directly every time. At most ``max_graphs`` graphs are kept (oldest
    dropped first) and at most ``4 * max_graphs`` inputs are counted towards promotion.
    :attr:`replays_by_key` maps :func:`launch_key` to the replay of its graph: the probe's step path
    looks the input up there first and counts the replay in :attr:`replays`.
    """

    def __init__(self, ws: FingerprintWorkspace, ring: RingTarget, capture: Capture | None, *,
                 max_graphs: int = 64, promote_after: int = 2) -> None:
        self._ws = ws
        self._ring = ring
        self._capture = capture
        self.max_graphs = max_graphs
        self.promote_after = promote_after
        self._graphs: dict[Key, Replayable] = {}
        self.replays_by_key: dict[Key, Callable[[], bool]] = {}
        self._seen: dict[Key, int] = {}
        self.replays = 0
        self.direct = 0
        self.captures = 0

    def launch(self, x: torch.Tensor, n: int) -> None:
        """Fingerprint ``x [n, K*H]`` (n >= 1) into the next ring row, on the current stream."""
        key = launch_key(x)
        replay = self.replays_by_key.get(key)
        if replay is not None and replay():
            self.replays += 1
            return
        ws, ring = self._ws, self._ring
        fingerprint_fused(x, ws, ring=ring)
        self.direct += 1
        if self._capture is None:
            return
        seen = self._seen.get(key, 0) + 1
        if seen < self.promote_after:
            if len(self._seen) >= 4 * self.max_graphs:
                self._seen.clear()
            self._seen[key] = seen
            return
        self._seen.pop(key, None)
        try:
            graph = self._capture(lambda: fingerprint_fused(x, ws, ring=ring))
        except Exception as exc:  # graphs are an optimisation: keep launching directly
            logger.warning("hs_tracer: capturing the fingerprint launch failed (%s: %s); launching "
                           "directly from now on", type(exc).__name__, exc)
            self._capture = None
            return
        if len(self._graphs) >= self.max_graphs:
            oldest = next(iter(self._graphs))
            del self._graphs[oldest], self.replays_by_key[oldest]
        self._graphs[key] = graph
        self.replays_by_key[key] = graph.replay
        self.captures += 1

    @property
    def graphs(self) -> int:
        return len(self._graphs)

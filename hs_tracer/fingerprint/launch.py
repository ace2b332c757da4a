"""The per-step launch of the fused kernel, at the lowest host cost the input allows.

A kernel launch through Triton's launcher costs the scheduler thread ~10 µs (argument marshalling
for 25 arguments, the stream lookup, the driver call); replaying a CUDA graph that holds the same
launch costs one driver call. A graph freezes the kernel's arguments, the input's address among
them, so one graph serves one (address, rows, strides, dtype). That is exactly what SGLang's decode
gives the probe: the draft input is the target's CUDA-graph output, whose address is fixed per
batch-size bucket, so a handful of graphs cover a whole serving run. An input seen
``promote_after`` times gets its graph; anything else (eager mode, a fresh allocation each step) is
launched directly. The digest row is picked on the device (``kernel.RingTarget``), so a replayed
launch still fills the next row of the ring.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

import torch

from hs_tracer.fingerprint.kernel import FingerprintWorkspace, RingTarget, fingerprint_fused

logger = logging.getLogger("hs_tracer")


class Replayable(Protocol):
    def replay(self) -> None: ...


Capture = Callable[[Callable[[], None]], Replayable]


def cuda_graph_capture(device: torch.device) -> Capture:
    """Capture a launch into a CUDA graph on a private stream, without a device sync: nothing runs
    while capturing, and ``thread_local`` mode leaves other threads' CUDA calls alone."""
    stream = torch.cuda.Stream(device)
    pool = torch.cuda.graph_pool_handle()

    def capture(launch: Callable[[], None]) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                launch()
            finally:
                graph.capture_end()
        return graph

    return capture


class StepLauncher:
    """Launches the fused kernel for one probe into one ring.

    ``capture=None`` launches directly every time. At most ``max_graphs`` graphs are kept (oldest
    dropped first) and at most ``4 * max_graphs`` inputs are counted towards promotion.
    """

    def __init__(self, ws: FingerprintWorkspace, ring: RingTarget, capture: Capture | None, *,
                 max_graphs: int = 64, promote_after: int = 2) -> None:
        self._ws = ws
        self._ring = ring
        self._capture = capture
        self.max_graphs = max_graphs
        self.promote_after = promote_after
        self._graphs: dict[tuple, Replayable] = {}
        self._seen: dict[tuple, int] = {}
        self.replays = 0
        self.direct = 0
        self.captures = 0

    def launch(self, x: torch.Tensor, n: int) -> None:
        """Fingerprint ``x [n, K*H]`` (n >= 1) into the next ring row, on the current stream."""
        key = (x.data_ptr(), n, x.stride(0), x.stride(1), x.dtype)
        graph = self._graphs.get(key)
        if graph is not None:
            graph.replay()
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
            del self._graphs[next(iter(self._graphs))]
        self._graphs[key] = graph
        self.captures += 1

    @property
    def graphs(self) -> int:
        return len(self._graphs)

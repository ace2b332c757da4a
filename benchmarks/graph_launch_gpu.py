"""Host cost of replaying a one-kernel CUDA graph, per way of launching it (CUDA only).

    PYTHONPATH=. python3 benchmarks/graph_launch_gpu.py [--out DIR]

The fingerprint probe replays a captured one-kernel graph every decode step on SGLang's scheduler
thread (``hs_tracer/fingerprint/launch.py``). This times, on the host, the median of ``--calls``
calls (``perf_counter_ns`` around each, the GPU drained every 8 calls outside the timing) of:
``torch.cuda.CUDAGraph.replay()``; the driver's ``cuGraphLaunch`` through ctypes on the graph's
executable (``raw_cuda_graph_exec``) with the current stream looked up each call and with it cached;
the C helper (``fingerprint/native.py``: the capture check and ``cuGraphLaunch`` in one call, what
``launch.GraphLaunch`` does where it builds) and ``GraphLaunch.replay`` itself; and
``cuda.bindings``' ``cudaGraphLaunch`` where that package is installed. The graph adds 1 to a
device scalar; the count after the run checks that every launch ran. Also the step path's small C
calls (input key, capture check).
Writes graph_launch_gpu.json under --out.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from provenance import source_state

from hs_tracer.fingerprint import native
from hs_tracer.fingerprint.launch import GraphLaunch, _driver_entry_points, _driver_graph_launch


def median_us(fn: Callable[[], object], calls: int) -> float:
    samples = []
    for i in range(calls):
        t0 = time.perf_counter_ns()
        fn()
        samples.append(time.perf_counter_ns() - t0)
        if i % 8 == 7:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return statistics.median(samples) / 1000


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    ap.add_argument("--calls", type=int, default=5000)
    args = ap.parse_args()
    dev = torch.device("cuda", torch.cuda.current_device())
    counter = torch.zeros(1, device=dev)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(torch.cuda.Stream(dev)):
        graph.capture_begin(capture_error_mode="thread_local")
        counter.add_(1)
        graph.capture_end()
    torch.cuda.synchronize()
    exec_ = graph.raw_cuda_graph_exec()
    launch = _driver_graph_launch()
    assert launch is not None, "no libcuda.so.1"
    stream_of = torch._C._cuda_getCurrentRawStream
    index = dev.index
    stream = stream_of(index)
    x = torch.zeros(256, 3 * 7168, dtype=torch.bfloat16, device=dev)
    rows: dict[str, float] = {}
    rows["torch CUDAGraph.replay()"] = median_us(graph.replay, args.calls)
    rows["cuGraphLaunch via ctypes, stream looked up (the fallback)"] = median_us(
        lambda: launch(exec_, stream_of(index)), args.calls)
    rows["cuGraphLaunch via ctypes, stream cached"] = median_us(lambda: launch(exec_, stream), args.calls)
    helper, entry = native.load(), _driver_entry_points()
    assert helper is not None and entry is not None, "the C helper did not build (see the log line)"
    c_replay, (c_launch, c_capturing) = helper.replay, entry
    rows["C helper: capture check + cuGraphLaunch, stream looked up (hs_tracer)"] = median_us(
        lambda: c_replay(c_launch, c_capturing, exec_, stream_of(index)), args.calls)
    rows["GraphLaunch.replay as the probe calls it"] = median_us(GraphLaunch(graph, index).replay, args.calls)
    import ctypes

    bare = ctypes.PyDLL("libcuda.so.1").cuGraphLaunch  # no argtypes: arguments passed as c_void_p
    bare.restype = ctypes.c_int
    exec_ptr = ctypes.c_void_p(exec_)
    rows["cuGraphLaunch via ctypes, no argtypes, stream wrapped per call"] = median_us(
        lambda: bare(exec_ptr, ctypes.c_void_p(stream_of(index))), args.calls)
    try:
        from cuda.bindings import runtime

        handle, rt_stream = runtime.cudaGraphExec_t(exec_), runtime.cudaStream_t(stream)
        rows["cuda.bindings cudaGraphLaunch, stream cached"] = median_us(
            lambda: runtime.cudaGraphLaunch(handle, rt_stream), args.calls)
        rows["cuda.bindings cudaGraphLaunch, stream looked up"] = median_us(
            lambda: runtime.cudaGraphLaunch(handle, runtime.cudaStream_t(stream_of(index))), args.calls)
    except ImportError:
        pass
    launches = args.calls * len(rows)  # every row so far launched the graph once per call
    rows["input key (data_ptr, shape, stride, dtype)"] = median_us(
        lambda: (x.data_ptr(), x.shape, x.stride(), x.dtype), args.calls)
    rows["torch._C._cuda_isCurrentStreamCapturing()"] = median_us(torch._C._cuda_isCurrentStreamCapturing,
                                                                   args.calls)
    ran = int(counter.item())
    res = {"machine": {"host": platform.node(), "cpu": platform.processor() or platform.machine(),
                       "gpu": torch.cuda.get_device_name(dev), "python": platform.python_version(),
                       "torch": torch.__version__,
                       "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")},
           "method": __doc__.strip(), "calls": args.calls, "host_us_median": rows,
           "launches_expected": launches, "launches_ran": ran}
    args.out.mkdir(parents=True, exist_ok=True)
    res["source"] = source_state(Path(__file__).resolve().parents[1])  # the commit measured
    (args.out / "graph_launch_gpu.json").write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res["host_us_median"], indent=2), f"\nlaunches ran {ran} of {launches}")
    return 0 if ran == launches else 1


if __name__ == "__main__":
    sys.exit(main())

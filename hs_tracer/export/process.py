"""hs_tracer's export process (``HS_TRACER_EXPORT=process``): acceptance, Prometheus, OpenTelemetry
spans, the online diagnosis and the live report of one scheduler process, on an interpreter of their
own.

Why a process: a thread in the scheduler process shares SGLang's GIL, so the exporters' and the
diagnosis's Python (span encoding, metric updates, the per-window diagnosis) would be time the
scheduler thread waits. Here it costs the scheduler process only the recorder thread's batching and
one pipe write per batch (benchmarks/hook_overhead.py measures both).

The scheduler process's recorder thread starts it with :meth:`ExportProcess.start` (``python -m
hs_tracer.export.process``, the same interpreter and environment, so ``PROMETHEUS_MULTIPROC_DIR``
and the ``OTEL_*`` variables apply here too) and writes framed messages to its stdin
(``export/channel.py``): ``setup`` once, then ``steps`` (a
:class:`~hs_tracer.export.batch.StepBatch`), ``window`` (a diagnosis window's channel sums) and
``status`` (the scheduler process's status and health, when they change). The export process
serves ``/metrics`` on the scheduler's port and writes the scheduler's report file
(``HS_TRACER_REPORT_DIR/scheduler-<scheduler pid>.json``). It exits when the pipe closes, that is
when the scheduler process exits however it ends; it never outlives it. If it dies first, the
recorder notices at its next wake-up and tracing switches itself off (serving goes on).
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from hs_tracer.export import channel
from hs_tracer.export.analysis import Analysis, ExportSetup, Health
from hs_tracer.export.batch import ARRAYS, StepBatch
from hs_tracer.export.report_file import ReportFile
from hs_tracer.fingerprint.stats import ChannelStats

logger = logging.getLogger("hs_tracer")

WAKE_S = 0.05  # the export process works off what arrived at this period (as the recorder does)


class ExportProcess:
    """The scheduler process's handle on its export process (recorder thread only)."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc
        assert proc.stdin is not None
        self._fd = proc.stdin.fileno()
        self._out: list[bytes | memoryview] = []  # buffers of the messages queued since the last flush
        self._lengths8 = np.zeros(0, np.int8)  # int8 accept lengths, reused by every batch (page faults)
        self._lengths8_queued = False

    @classmethod
    def start(cls, setup: ExportSetup, report_dir: Path | None) -> ExportProcess:
        proc = subprocess.Popen([sys.executable, "-m", "hs_tracer.export.process"], stdin=subprocess.PIPE,
                                close_fds=True)
        handle = cls(proc)
        channel.enlarge_pipe(handle._fd)
        handle._queue("setup", {"setup": setup.to_json(), "scheduler_pid": os.getpid(),
                                "report_dir": str(report_dir) if report_dir is not None else None})
        handle.flush()
        return handle

    def check(self) -> None:
        """Raise if the export process has exited (the recorder then switches tracing off)."""
        if self.proc.poll() is not None:
            raise RuntimeError(f"hs_tracer's export process (pid {self.proc.pid}) exited with code "
                               f"{self.proc.returncode}; its last lines are in the scheduler's log. "
                               "HS_TRACER_EXPORT=thread runs the exporters in the scheduler process instead")

    def _queue(self, kind: str, meta: dict[str, Any], arrays: list[np.ndarray] | tuple = ()) -> None:
        self._out.extend(channel.frame(kind, meta, arrays))

    def flush(self) -> None:
        """Write the queued messages, in one system call where the pipe takes them (a write costs
        the recorder tens of µs of system time whatever its size). Queued arrays are written from
        their own memory: they must not change before this."""
        parts, self._out = self._out, []
        self._lengths8_queued = False  # written below (or the handle is dead)
        if not parts:
            return
        try:
            channel.write_all(self._fd, parts)
        except OSError as exc:
            self.proc.wait(5)
            self.check()
            raise RuntimeError(f"cannot write to hs_tracer's export process (pid {self.proc.pid}): "
                               f"{exc}") from None

    def queue_batch(self, batch: StepBatch) -> None:
        """Queue a batch of steps (sent at the next :meth:`flush`). Accept lengths travel as int8
        when they fit (they never exceed the draft token count): at 1024 requests a step they are
        most of a batch's bytes, and encoding and writing them is most of its cost."""
        arrays = [getattr(batch, name) for name in ARRAYS]
        if batch.num_draft_tokens.size and int(batch.num_draft_tokens.max()) <= np.iinfo(np.int8).max:
            arrays[ARRAYS.index("lengths")] = self._int8(batch.lengths)
        self._queue("steps", {"max_accept_length": batch.max_accept_length, "input_width": batch.input_width,
                              "thread_cpu_s": batch.thread_cpu_s,
                              "scheduler_delay_s": batch.scheduler_delay_s}, arrays)

    def _int8(self, lengths: np.ndarray) -> np.ndarray:
        """``lengths`` as int8, in memory reused from one flush to the next."""
        if self._lengths8_queued:  # a second batch before the flush: its own array
            return lengths.astype(np.int8)
        if self._lengths8.size < lengths.size:
            self._lengths8 = np.zeros(max(lengths.size, 2 * self._lengths8.size), np.int8)
        out = self._lengths8[:lengths.size]
        np.copyto(out, lengths, casting="unsafe")
        self._lengths8_queued = True
        return out

    def queue_window(self, window: ChannelStats) -> None:
        """Queue a diagnosis window's channel sums (written from its arrays at :meth:`flush`)."""
        self._queue("window", {}, [window.count, window.sum, window.sumsq])

    def queue_identity(self, names: list[str], candidates: np.ndarray, slots: np.ndarray) -> None:
        """Queue one identity sample's rows (hs_tracer/core/identity.py)."""
        self._queue("identity", {"sources": list(names)}, [candidates, slots])

    def queue_status(self, status: dict[str, Any], health: Health) -> None:
        """Queue this process's status and health."""
        self._queue("status", {"status": status, "health": vars(health)})

    def close(self, timeout_s: float = 5.0) -> None:
        """Close the pipe (the export process flushes, writes its last report and exits)."""
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()


# ---- the export process -------------------------------------------------------------------------------
class _Worker:
    def __init__(self, setup: ExportSetup, scheduler_pid: int, report_dir: Path | None) -> None:
        self.analysis = Analysis(setup)
        self.report = ReportFile(report_dir, scheduler_pid) if report_dir is not None else None
        self.status: dict[str, Any] | None = None
        self.health = Health()
        self.batches: list[StepBatch] = []
        self.window: ChannelStats | None = None

    def take(self, kind: str, meta: dict[str, Any], arrays: list[np.ndarray]) -> None:
        if kind == "steps":
            self.batches.append(StepBatch(**dict(zip(ARRAYS, arrays, strict=True)),
                                          max_accept_length=meta["max_accept_length"],
                                          input_width=meta["input_width"],
                                          thread_cpu_s=meta.get("thread_cpu_s", 0.0),
                                          scheduler_delay_s=meta.get("scheduler_delay_s", 0.0)))
        elif kind == "window":
            window = window_from_message(arrays)
            self.window = window if self.window is None else self.window.merge(window)
        elif kind == "identity":
            self.analysis.on_identity(meta["sources"], arrays[0], arrays[1])
        elif kind == "status":
            self.status, self.health = meta["status"], Health(**meta["health"])
            self.analysis.mark_dirty()
        else:
            raise channel.ChannelError(f"unknown message kind {kind!r}")

    def wake(self) -> None:
        batches, window, self.batches, self.window = self.batches, self.window, [], None
        if self.analysis.work(batches, window, self.health):
            self.write_report()

    def write_report(self) -> None:
        if self.report is not None and self.status is not None:
            self.report.write({**self.status, "overhead": self.analysis.overhead_json(),
                               "diagnosis": self.analysis.report_json()})


def window_from_message(arrays: list[np.ndarray]) -> ChannelStats:
    """A window message's sums as float64 (the recorder sends them in the probe's int32/float32):
    the analysis keeps running totals over the whole run, which float32 sums or an int32 count
    would not hold."""
    return ChannelStats(*(np.asarray(a, dtype=np.float64) for a in arrays))


def main() -> int:
    logging.basicConfig(level=os.environ.get("HS_TRACER_LOG_LEVEL", "INFO").upper(),
                        format="%(asctime)s hs_tracer export process: %(message)s")
    fd = sys.stdin.fileno()
    reader = channel.Reader()
    worker: _Worker | None = None
    last = time.monotonic()
    open_ = True
    try:
        while open_:
            ready, _, _ = select.select([fd], [], [], WAKE_S)
            if ready:
                data = os.read(fd, channel.PIPE_BYTES)
                open_ = bool(data)
                for kind, meta, arrays in reader.feed(data):
                    if kind == "setup":
                        worker = _Worker(ExportSetup.from_json(meta["setup"]), int(meta["scheduler_pid"]),
                                         Path(meta["report_dir"]) if meta["report_dir"] else None)
                        worker.analysis.start()
                    elif worker is None:
                        raise channel.ChannelError(f"{kind!r} message before setup")
                    else:
                        worker.take(kind, meta, arrays)
            now = time.monotonic()
            if worker is not None and (now - last >= WAKE_S or not open_):
                worker.wake()
                last = now
        return 0
    finally:
        if worker is not None:
            worker.analysis.close()


if __name__ == "__main__":
    sys.exit(main())

"""Progress of a profile build that may run for hours: bytes read, tokens/s and ETA.

On a terminal a tqdm bar; otherwise (a Kubernetes pod log, a Slurm output file) one plain line every
``interval`` seconds and a last one at the end, so logs stay readable and grep-able. The ETA comes from
the bytes left in this shard's files (known before reading), which tracks the work far better than a
file count when records differ in length.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from tqdm import tqdm

LOG_INTERVAL_S = 60.0


class BuildProgress:
    """``update(nbytes, tokens)`` after each record or file; ``close()`` at the end."""

    def __init__(
        self,
        total_bytes: int,
        desc: str,
        enabled: bool | None = None,
        *,
        interval: float = LOG_INTERVAL_S,
        stream: TextIO | None = None,
        unit: str = "B",
    ) -> None:
        self.stream = stream or sys.stderr
        self.total = max(int(total_bytes), 1)
        self.desc = desc
        self.interval = interval
        self.unit = unit  # what ``total`` counts: bytes of a build, tokens of a recomputation
        self.done = 0
        self.tokens = 0
        self.start = self._last = time.monotonic()
        tty = self.stream.isatty()
        self.mode = "off" if enabled is False else ("bar" if tty else "log")
        self._bar = None
        if self.mode == "bar":
            self._bar = tqdm(total=self.total, desc=desc, unit=unit, unit_scale=True,
                             unit_divisor=1024 if unit == "B" else 1000, file=self.stream)

    def update(self, nbytes: int, tokens: int) -> None:
        self.done += nbytes
        self.tokens += tokens
        if self._bar is not None:
            self._bar.set_postfix_str(f"{self._rate(self.tokens)} tok/s", refresh=False)
            self._bar.update(nbytes)
        elif self.mode == "log" and time.monotonic() - self._last >= self.interval:
            self._log()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self.mode == "log":
            self._log()

    def _rate(self, amount: float) -> str:
        elapsed = max(time.monotonic() - self.start, 1e-9)
        return tqdm.format_sizeof(amount / elapsed)

    def line(self) -> str:
        """``desc: 1.2 GB/40.0 GB (3.0 %), 12.3M tokens, 45.6k tok/s, 210 MB/s, ETA 1:02:03``"""
        elapsed = max(time.monotonic() - self.start, 1e-9)
        rate = self.done / elapsed
        eta = tqdm.format_interval((self.total - self.done) / rate) if self.done else "?"
        return (
            f"{self.desc}: {tqdm.format_sizeof(self.done)}{self.unit}/{tqdm.format_sizeof(self.total)}"
            f"{self.unit} ({100 * self.done / self.total:.1f} %), {tqdm.format_sizeof(self.tokens)} tokens, "
            f"{self._rate(self.tokens)} tok/s, {tqdm.format_sizeof(rate)}{self.unit}/s, "
            f"elapsed {tqdm.format_interval(elapsed)}, ETA {eta}"
        )

    def _log(self) -> None:
        self._last = time.monotonic()
        print(self.line(), file=self.stream, flush=True)

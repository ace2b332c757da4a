"""Read hs_tracer's own counters from a running tracer's ``/metrics`` (the benchmarks that start
engines compare them with the engine's counters)."""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Iterable

SAMPLE = re.compile(r"^([a-z_]+)(\{[^}]*\})? ([-+0-9.eE]+|NaN)$")


def counters(port: int, names: Iterable[str]) -> dict[str, float]:
    """The series of ``names`` on ``127.0.0.1:port/metrics``, each summed over its label sets."""
    wanted = set(names)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = SAMPLE.match(line)
        if m and m.group(1) in wanted:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
    return out

"""Read a live dump (hs_tracer capture, SpecForge or speculators dir) into one window of statistics."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hs_tracer.findings import Acceptance
from hs_tracer.fingerprint.stats import ChannelStats
from hs_tracer.profile import readers, token_rows
from hs_tracer.profile.accumulate import StatsAccumulator


@dataclass
class LiveWindow:
    stats: ChannelStats
    tokens: int
    nonfinite: int
    width: int
    producer: str
    acceptance: Acceptance | None = None


def acceptance_of(accept_lengths: np.ndarray) -> Acceptance | None:
    """Accept lengths count the bonus token: length a means draft positions 0..a-2 were accepted."""
    a = np.asarray(accept_lengths, dtype=np.int64)
    if a.size == 0:
        return None
    positions = max(int(a.max()) - 1, 1)
    accepted = a - 1
    rates = [float((accepted > i).mean()) for i in range(positions)]
    return Acceptance(steps=int(a.size), mean_accept_length=float(a.mean()), per_position_rate=rates)


def _slots(reader: readers.Reader, hidden: int) -> tuple[int, int, int]:
    """(slots, width of a slot, row width) of a dump, split by ``hidden`` (the profile's hidden size).
    A width that is not a multiple of ``hidden`` is one slot of its full width."""
    layout = reader.layout()
    width = layout.width
    if isinstance(reader, readers.SpeculatorsReader):
        k = max(int(layout.layers_in_file or 1) - 1, 1)  # speculators trains on all layers but the last
        h = int(layout.hidden_size or hidden)
        return k, h, k * h
    if isinstance(reader, readers.SpecForgeReader):
        h = int(layout.hidden_size or hidden)
        return (width // h, h, width) if width % h == 0 else (1, width, width)
    return (width // hidden, hidden, width) if width % hidden == 0 else (1, width, width)


def _records(reader: readers.Reader, file: Path, k: int, h: int) -> Iterator[readers.Record]:
    if isinstance(reader, readers.SpeculatorsReader):
        return reader.records(file, k, h, list(range(k)))
    return reader.records(file, k, h)


def read_live(path: str | Path, hidden: int, skip_first: int = 1) -> LiveWindow:
    """All tokens of ``path`` as one window, split into slots of ``hidden`` (the profile's hidden size).

    A capture whose width is not a multiple of ``hidden`` becomes one slot of its full width (diagnosis
    then reports the width and cannot compare identities).
    """
    reader = readers.detect(path)
    k, h, width = _slots(reader, hidden)
    acc = StatsAccumulator(k, h)
    lengths: list[np.ndarray] = []
    for file in reader.files():
        for rec in _records(reader, file, k, h):
            x = rec.slots
            if rec.positions is not None and skip_first > 0:
                x = x[rec.positions >= skip_first]
            acc.add(x)
            if rec.accept_lengths is not None:
                lengths.append(rec.accept_lengths)
    acceptance = acceptance_of(np.concatenate(lengths)) if lengths else None
    return LiveWindow(acc.stats, acc.tokens, acc.nonfinite, width, reader.layout().producer, acceptance)


def live_sample(path: str | Path, hidden: int, skip_first: int, *, sequences: int,
                tokens: int) -> tuple[token_rows.Sample, str] | None:
    """Whole sequences of ``path`` with their rows, to recompute the target on, and the rows' dtype;
    None when the rows do not split into slots of ``hidden`` (the width finding says why)."""
    reader = readers.detect(path)
    k, h, width = _slots(reader, hidden)
    if h != hidden or k * h != width:
        return None
    sample = token_rows.sample(reader.files(), lambda f: _records(reader, f, k, h), sequences=sequences,
                               tokens=tokens, skip_first=skip_first)
    return sample, reader.layout().dtype

"""Read a live dump (hs_tracer capture, SpecForge or speculators dir) into one window of statistics."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hs_tracer.diagnosis.findings import Acceptance
from hs_tracer.fingerprint.stats import ChannelStats
from hs_tracer.profile import readers
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


def read_live(path: str | Path, hidden: int, skip_first: int = 1) -> LiveWindow:
    """All tokens of ``path`` as one window, split into slots of ``hidden`` (the profile's hidden size).

    A capture whose width is not a multiple of ``hidden`` becomes one slot of its full width (diagnosis
    then reports the width and cannot compare identities).
    """
    reader = readers.detect(path)
    layout = reader.layout()
    width = layout.width
    if isinstance(reader, readers.SpeculatorsReader):
        k = max(int(layout.layers_in_file or 1) - 1, 1)  # speculators trains on all layers but the last
        width = k * int(layout.hidden_size or hidden)
        h = int(layout.hidden_size or hidden)
    elif isinstance(reader, readers.SpecForgeReader):
        h = int(layout.hidden_size or hidden)
        k = width // h if width % h == 0 else 1
        h = h if width % h == 0 else width
    else:
        k, h = (width // hidden, hidden) if width % hidden == 0 else (1, width)
    acc = StatsAccumulator(k, h)
    lengths: list[np.ndarray] = []
    for file in reader.files():
        records = (
            reader.records(file, k, h, list(range(k)))
            if isinstance(reader, readers.SpeculatorsReader)
            else reader.records(file, k, h)
        )
        for rec in records:
            x = rec.slots
            if rec.positions is not None and skip_first > 0:
                x = x[rec.positions >= skip_first]
            acc.add(x)
            if rec.accept_lengths is not None:
                lengths.append(rec.accept_lengths)
    acceptance = acceptance_of(np.concatenate(lengths)) if lengths else None
    return LiveWindow(acc.stats, acc.tokens, acc.nonfinite, width, layout.producer, acceptance)

"""What the fingerprint kernel writes into a ring row, written from the host: for the ring's tests
on the CPU, where no kernel runs."""

from __future__ import annotations

import numpy as np
import torch

from hs_tracer.fingerprint.ring import HEADER_WORDS, PROGRAM_WORDS, DigestRing


def land(ring: DigestRing, launch: int, total: float, rows: int = 1) -> None:
    """Launch ``launch``'s row: ``rows`` rows read, one program per slot, each slot's sum ``total``."""
    tag = (launch % 2**32) << 32
    k = ring.num_slots
    partials = np.zeros((k, PROGRAM_WORDS), dtype=np.float32)
    partials[:, 0] = total
    body = partials.view(np.uint32).astype(np.int64).ravel()
    row = ring.records[launch % ring.size]
    row[:HEADER_WORDS] = torch.tensor([tag | (rows % 2**32), tag | k])
    row[HEADER_WORDS:HEADER_WORDS + body.size] = torch.from_numpy(tag | body)

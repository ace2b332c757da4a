"""Sequences for replay: the draft's input features with the tokens they belong to.

A :class:`Sequence` is one causal stretch of one request: ``features`` [T, K*H] (row t = the target's
states at position t), ``ids`` [T] (the token at each position) and ``tail`` (the token after the
last row, when known). That is what the draft saw at draft-extend time (SGLang shifts the ids left
by one and appends the tail) and what SpecForge trains on, so one runner serves both sources.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from hs_tracer.profile import capture_format, readers


@dataclass
class Sequence:
    features: torch.Tensor  # [T, K*H] float32
    ids: torch.Tensor  # [T] int64
    tail: int | None = None
    first_position: int = 0  # > 0: a cached prefix whose draft context is not in the capture

    @property
    def rows(self) -> int:
        return int(self.ids.shape[0])


def load_capture(path: Path, max_tokens: int | None = None) -> tuple[capture_format.CaptureManifest,
                                                                      list[Sequence], np.ndarray]:
    """Sequences of an hs_tracer capture (prefill rows), and all accept lengths it holds."""
    manifest = capture_format.read_manifest(path)
    seqs: list[Sequence] = []
    lengths: list[np.ndarray] = []
    tokens = 0
    for _name, shard in capture_format.iter_shards(path, manifest):
        if shard.accept_lengths is not None:
            lengths.append(shard.accept_lengths)
        n = shard.features.shape[0]
        if n == 0 or (max_tokens is not None and tokens >= max_tokens):
            continue
        extend = shard.extras.get("extend_lens")
        spans = list(extend) if extend is not None else _spans_from_positions(shard.positions)
        tails = shard.extras.get("next_token_ids")
        start = 0
        for i, length in enumerate(int(v) for v in spans):
            stop = start + length
            seqs.append(Sequence(
                features=torch.from_numpy(np.ascontiguousarray(shard.features[start:stop])),
                ids=torch.from_numpy(shard.input_ids[start:stop].astype(np.int64)),
                tail=int(tails[i]) if tails is not None else None,
                first_position=int(shard.positions[start]) if length else 0,
            ))
            tokens += length
            start = stop
    acc = np.concatenate(lengths) if lengths else np.zeros(0, dtype=np.int64)
    return manifest, seqs, acc


def finite_only(seqs: list[Sequence]) -> tuple[list[Sequence], int, int]:
    """The sequences whose features are all finite, the non-finite values left out, all values seen."""
    kept, nonfinite, values = [], 0, 0
    for s in seqs:
        bad = int((~torch.isfinite(s.features)).sum())
        nonfinite += bad
        values += s.features.numel()
        if not bad:
            kept.append(s)
    return kept, nonfinite, values


def _spans_from_positions(positions: np.ndarray) -> list[int]:
    """Request boundaries where positions stop counting up by one (captures without extend_lens)."""
    if positions.size == 0:
        return []
    breaks = [0, *(np.nonzero(np.diff(positions) != 1)[0] + 1).tolist(), int(positions.size)]
    return [b - a for a, b in itertools.pairwise(breaks)]


def load_training(path: Path, num_slots: int, hidden: int, max_tokens: int | None = None) -> list[Sequence]:
    """Sequences of a SpecForge dump (``input_ids`` + ``aux_hidden_state``), as the draft trained on them.

    A speculators dump carries its slot layers in ``hidden_states`` [T, L, H]; the draft trained on the
    first ``num_slots`` of them (the last one is the verifier's own state).
    """
    reader = readers.detect(path)
    seqs: list[Sequence] = []
    tokens = 0
    for file in reader.files():
        if max_tokens is not None and tokens >= max_tokens:
            break
        if isinstance(reader, readers.SpecForgeReader):
            data = reader.load(file)
            aux = reader._squeeze(data["aux_hidden_state"]).float()
            ids = reader._squeeze(data["input_ids"]).reshape(-1).long()
        elif isinstance(reader, readers.SpeculatorsReader):
            from safetensors import safe_open

            with safe_open(str(file), framework="pt") as f:
                hs = f.get_tensor("hidden_states")
                ids = f.get_tensor("token_ids").reshape(-1).long()
            aux = hs[:, :num_slots].float().reshape(hs.shape[0], -1)
        else:
            raise readers.LayoutError(f"{path}: training data must be a SpecForge or speculators dump")
        if aux.shape[-1] != num_slots * hidden:
            raise readers.LayoutError(
                f"{file}: training features are {aux.shape[-1]} wide, the draft reads {num_slots}x{hidden}"
            )
        seqs.append(Sequence(aux.contiguous(), ids))
        tokens += int(ids.shape[0])
    return seqs

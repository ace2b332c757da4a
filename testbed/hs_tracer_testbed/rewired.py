"""Dumps and captures whose rows come from other layers than their record says, from a target's own states.

Why: the record a dump or capture carries (a capture manifest's ``sources``, a SpecForge dump's layer
ids) is an account of the wiring, and the failure that matters is an account that is wrong: an
engine whose capture loop feeds other layers than its ``layers_to_capture`` says, a training dump
described with the wrong ids or convention. These helpers write real files in the formats hs_tracer
reads, with the rows of the layers ``fed`` and the record of ``recorded``, so the tests can check
that recomputing the target names what the rows really hold.

Rows are the target's own hidden states (:func:`hs_tracer_testbed.dumps.layer_states`: hooks on the
embedding, every decoder layer and the final norm), rounded to bf16 as served and as SpecForge stores.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from hs_tracer.profile.capture_format import CaptureManifest, CaptureWriter
from hs_tracer.sources import EMBEDDING, Source
from hs_tracer_testbed.dumps import LayerStates, layer_states, write_specforge, write_speculators


def states_of(model: Any, sequences: Sequence[Sequence[int]]) -> list[LayerStates]:
    """Every source of each sequence, recomputed once (the slow part of the tests that use them)."""
    return [layer_states(model, torch.tensor(list(ids))) for ids in sequences]


def c_out(source: str) -> int:
    """A pre-norm source as a C_out id (``embedding`` = -1), the index ``LayerStates.block`` takes."""
    return -1 if source == EMBEDDING else int(Source.parse(source).block)


def rows(st: LayerStates, fed: Sequence[str]) -> torch.Tensor:
    """``[T, K*H]`` bf16: the rows an engine feeding ``fed`` (one source per slot) hands the draft."""
    return st.aux([c_out(s) for s in fed]).to(torch.bfloat16)


def channel_rows(model: Any, states: Sequence[LayerStates], source: str, fault: str) -> list[torch.Tensor]:
    """Per sequence, the ``[T, H]`` rows a capture channel that goes wrong hands over for ``source``
    (``block:<j>``): ``residual_left_out`` layer j's MLP output alone (recomputed with a hook on that
    module), ``input_norm`` the RMS norm of layer j+1's input norm applied to the block's output
    (written out here, not taken from the model's module)."""
    j = int(Source.parse(source).block)
    layers = model.model.layers
    out = []
    for st in states:
        if fault == "input_norm":
            norm = layers[j + 1].input_layernorm
            x = st.block(j).float()
            out.append(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon) * norm.weight)
            continue
        seen: list[torch.Tensor] = []
        hook = layers[j].mlp.register_forward_hook(lambda _m, _i, o, seen=seen: seen.append(o))
        try:
            with torch.no_grad():
                model(input_ids=st.input_ids[None])
        finally:
            hook.remove()
        out.append(seen[0][0].float())
    return out


def write_capture(out: Path, states: Sequence[LayerStates], fed: Sequence[str], recorded: Sequence[str],
                  num_layers: int, prefixed: int = 0,
                  replaced: dict[int, list[torch.Tensor]] | None = None) -> Path:
    """An hs_tracer capture of whole requests (prefix 0) holding ``fed``'s rows while its manifest
    records ``recorded``. ``prefixed``: that many more requests whose first 8 tokens came from a
    prefix cache (their rows start at position 8; they cannot be recomputed from the capture).
    ``replaced``: per slot, rows of each sequence fed there instead (:func:`channel_rows`)."""
    hidden = int(states[0].layers.shape[-1])
    manifest = CaptureManifest(num_slots=len(fed), hidden_size=hidden, sources=list(recorded),
                               num_layers=num_layers, target_arch="LlamaForCausalLM",
                               producer="hs_tracer_testbed.rewired", rows="prefill_draft_extend")
    writer = CaptureWriter(out, manifest)
    feats, ids, pos, lens = [], [], [], []
    for i, st in enumerate(states):
        start = 8 if i >= len(states) - prefixed else 0
        blocks = list(rows(st, fed).chunk(len(fed), dim=-1))
        for k, per_seq in (replaced or {}).items():
            blocks[k] = per_seq[i].to(torch.bfloat16)
        feats.append(torch.cat(blocks, dim=-1)[start:])
        ids.append(st.input_ids[start:])
        pos.append(torch.arange(start, len(st.input_ids)))
        lens.append(len(st.input_ids) - start)
    writer.write(torch.cat(feats), torch.cat(ids), torch.cat(pos), extras={"extend_lens": lens})
    return out


def write_specforge_dump(out: Path, states: Sequence[LayerStates], fed: Sequence[str]) -> Path:
    """A SpecForge dump whose ``aux_hidden_state`` holds ``fed``'s rows (whatever ids describe it)."""
    for i, st in enumerate(states):
        mask = torch.ones(len(st.input_ids), dtype=torch.long)
        mask[0] = 0
        write_specforge(out, i, st, [c_out(s) for s in fed], mask)
    return out


def write_speculators_dump(out: Path, states: Sequence[LayerStates], fed: Sequence[str]) -> Path:
    """A speculators dump whose first layers hold ``fed``'s rows, then the last block's output (the
    verifier layer speculators stores after the draft's)."""
    n = int(states[0].layers.shape[0]) - 1
    for i, st in enumerate(states):
        write_speculators(out, i, st, [c_out(s) + 1 for s in fed] + [n])  # C_in ids
    return out

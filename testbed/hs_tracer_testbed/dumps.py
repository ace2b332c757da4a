"""Hidden-state dumps of the testbed target in the layouts real draft-training tools write.

* SpecForge offline layout (``prepare_hidden_states.py``): ``rows_{g}-{g+2000}/data_{i}.ckpt``, one
  ``torch.save`` dict of plain tensors per sequence: ``input_ids`` [T] int64, ``loss_mask`` [T],
  ``hidden_state`` [1, T, H] (after the final norm), ``aux_hidden_state`` [1, T, 3H] (residual
  stream, pre-norm, of the three capture layers, ascending). Plus ``vocab_mapping/vocab_mapping.pt``
  (``d2t`` diffs, ``t2d`` bool).
* speculators layout (``data_generation``): ``hidden_states/hs_{i}.safetensors`` with
  ``hidden_states`` [T, 4, H] (C_in ids ``[2, N//2, N-3, N]``: the three aux layers then the last
  block's output, pre-norm) and ``token_ids`` [T].
* atlas: speculators layout with every C_in id ``0..N`` (embedding, then every block output,
  pre-norm) plus a ``final_norm`` [T, H] key: for layer-identification profiles.

Layer ids: SpecForge picks C_out ``[1, N//2-1, N-4]``; the same tensors are C_in ``[2, N//2, N-3]``
(conversions: :mod:`hs_tracer.sources`; see ``docs/testbed.md``). Each data dir carries an
``hs_tracer_data.json`` sidecar naming the layout, ids, convention and canonical sources.
Files hold hidden states of prompts, so they are written 0600 like every hidden-state file.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from transformers import DeepseekV3ForCausalLM

SPECFORGE_GROUP = 2000


@dataclass
class LayerStates:
    """Every canonical source of one sequence: ``layers[0]`` = embedding, ``layers[j+1]`` = block j."""

    input_ids: torch.Tensor  # [T]
    layers: torch.Tensor  # [N+1, T, H] pre-norm residual stream
    final_norm: torch.Tensor  # [T, H]
    logits: torch.Tensor  # [T, V]

    def block(self, j: int) -> torch.Tensor:
        """Output of block ``j`` (``j=-1``: the embedding)."""
        return self.layers[j + 1]

    def aux(self, c_out_ids: Iterable[int]) -> torch.Tensor:
        """[T, K*H] concatenation of the given C_out sources (in the given order)."""
        import torch

        return torch.cat([self.block(j) for j in c_out_ids], dim=-1)


def layer_states(model: DeepseekV3ForCausalLM, input_ids: torch.Tensor) -> LayerStates:
    """Run the target on one sequence and record the embedding, every block output and the final norm.

    Forward hooks on the modules (not ``output_hidden_states``) so each tensor's meaning is explicit.
    """
    return layer_states_batch(model, [input_ids])[0]


def layer_states_batch(model: DeepseekV3ForCausalLM, seqs: list[torch.Tensor]) -> list[LayerStates]:
    """:func:`layer_states` of several sequences in one forward (right-padded, attention-masked: each
    sequence's rows are its own, up to float rounding; a GPU builds thousands of records in seconds)."""
    import torch

    inner = model.model
    seen: dict[str, torch.Tensor] = {}
    hooks = [inner.embed_tokens.register_forward_hook(lambda m, i, o: seen.__setitem__("emb", o))]
    for j, layer in enumerate(inner.layers):
        hooks.append(
            layer.register_forward_hook(
                lambda m, i, o, j=j: seen.__setitem__(f"b{j}", o[0] if isinstance(o, tuple) else o)
            )
        )
    hooks.append(inner.norm.register_forward_hook(lambda m, i, o: seen.__setitem__("norm", o)))
    lengths = [len(s) for s in seqs]
    ids = torch.zeros(len(seqs), max(lengths), dtype=torch.long, device=seqs[0].device)
    mask = torch.zeros_like(ids)
    for b, s in enumerate(seqs):
        ids[b, : len(s)] = s
        mask[b, : len(s)] = 1
    try:
        with torch.no_grad():
            # one sequence: no mask, exactly the unpadded forward
            logits = model(input_ids=ids, attention_mask=mask if len(seqs) > 1 else None).logits
    finally:
        for h in hooks:
            h.remove()
    n = len(inner.layers)
    layers = torch.stack([seen["emb"]] + [seen[f"b{j}"] for j in range(n)], dim=1)  # [B, N+1, T, H]
    return [LayerStates(s, layers[b, :, :t].float(), seen["norm"][b, :t].float(), logits[b, :t].float())
            for b, (s, t) in enumerate(zip(seqs, lengths, strict=True))]


def _private_write(path: Path) -> None:
    os.chmod(path, 0o600)


def vocab_mapping(token_lists: Iterable[list[int]], vocab_size: int, draft_vocab: int) -> dict[str, Any]:
    """SpecForge's d2t/t2d: the ``draft_vocab`` most frequent tokens, sorted; d2t holds diffs."""
    import torch

    counts: Counter[int] = Counter()
    for toks in token_lists:
        counts.update(toks)
    used = sorted(tok for tok, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:draft_vocab])
    fill = iter(i for i in range(vocab_size) if i not in set(used))
    while len(used) < draft_vocab:  # SpecForge pads with the lowest unused ids
        used = sorted([*used, next(fill)])
    d2t = torch.tensor([t - i for i, t in enumerate(used)], dtype=torch.long)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[used] = True
    return {"d2t": d2t, "t2d": t2d}


def specforge_record(st: LayerStates, c_out_ids: list[int], loss_mask: torch.Tensor) -> dict[str, Any]:
    """One SpecForge record on the CPU (bf16 hidden states, as SGLang's capture writes them)."""
    import torch

    return {
        "input_ids": st.input_ids.cpu().clone().long(),
        "loss_mask": loss_mask.cpu().clone().long(),
        "hidden_state": st.final_norm[None].to("cpu", torch.bfloat16).contiguous(),
        "aux_hidden_state": st.aux(c_out_ids)[None].to("cpu", torch.bfloat16).contiguous(),
    }


def write_specforge(
    out_dir: Path, i: int, st: LayerStates, c_out_ids: list[int], loss_mask: torch.Tensor
) -> Path:
    """Write one SpecForge record ``rows_{g}-{g+2000}/data_{i}.ckpt``."""
    import torch

    g = i // SPECFORGE_GROUP * SPECFORGE_GROUP
    d = out_dir / f"rows_{g}-{g + SPECFORGE_GROUP}"
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"data_{i}.ckpt"
    torch.save(specforge_record(st, c_out_ids, loss_mask), path)
    _private_write(path)
    return path


def write_speculators(
    out_dir: Path, i: int, st: LayerStates, c_in_ids: list[int], final_norm: bool = False
) -> Path:
    """One speculators record ``hidden_states/hs_{i}.safetensors`` ([T, L, H] bf16, C_in ids)."""
    import torch
    from safetensors.torch import save_file

    d = out_dir / "hidden_states"
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"hs_{i}.safetensors"
    tensors = {
        "hidden_states": torch.stack([st.layers[k] for k in c_in_ids], dim=1).to(torch.bfloat16).contiguous(),
        "token_ids": st.input_ids.clone().long(),
    }
    if final_norm:
        tensors["final_norm"] = st.final_norm.to(torch.bfloat16).contiguous()
    save_file(tensors, str(path))
    _private_write(path)
    return path


def write_sidecar(out_dir: Path, info: dict[str, Any]) -> None:
    """``hs_tracer_data.json``: what the files in ``out_dir`` hold (layout, ids, convention, sources)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "hs_tracer_data.json").write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")


def read_specforge(data_dir: Path) -> list[dict[str, torch.Tensor]]:
    """All SpecForge records under ``data_dir`` in index order (``weights_only`` loads)."""
    import torch

    files = sorted(data_dir.glob("rows_*/data_*.ckpt"), key=lambda p: int(p.stem.split("_")[1]))
    if not files:
        raise FileNotFoundError(f"no rows_*/data_*.ckpt under {data_dir}: not a SpecForge hidden-state dir")
    return [torch.load(f, weights_only=True) for f in files]


def read_speculators(data_dir: Path) -> list[dict[str, torch.Tensor]]:
    """All speculators records ``hidden_states/hs_*.safetensors`` in index order."""
    from safetensors.torch import load_file

    files = sorted(
        (data_dir / "hidden_states").glob("hs_*.safetensors"), key=lambda p: int(p.stem.split("_")[1])
    )
    if not files:
        raise FileNotFoundError(f"no hidden_states/hs_*.safetensors under {data_dir}: not a speculators dir")
    return [load_file(str(f)) for f in files]

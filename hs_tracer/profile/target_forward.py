"""The target recomputed on token ids: every candidate source's rows for the same tokens.

Why: which layer a slot carries is a measurement once the target runs on the slot's own tokens: one
candidate equals the slot's rows up to rounding, every other differs by what a whole layer adds
(:mod:`hs_tracer.diagnosis.same_token` compares them). Candidates are named canonically:
``embedding`` (the input of decoder layer 0), ``block:<j>`` (the residual stream after block ``j``,
before the final norm) and ``final_norm`` (the final norm's output).

The states are taken with forward hooks on the decoder's own modules, not from
``output_hidden_states``: in transformers 5.19 the last entry of ``hidden_states`` is the final
norm's output (``last_hidden_state``), so the last block's pre-norm output is not among them, and
the index meaning differs between releases. A pre-hook on decoder layer 0 gives the embedding as the
residual stream receives it (models that scale the embedding scale it before that layer).

Weights are read from safetensors files only (no pickle), in float32, on the CPU.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hs_tracer.errors import InputError
from hs_tracer.sources import EMBEDDING, FINAL_NORM, all_sources

FIX = "pass the target model's directory (config.json and its safetensors weights)"
_CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")
_FLOAT32 = 4
RESIDUAL_LEFT_OUT = "residual_left_out"
INPUT_NORM = "input_norm"


@dataclass
class Target:
    """A loaded target: the transformers model, its decoder and what it computes."""

    path: Path
    model: Any
    decoder: Any  # the module holding ``layers`` and ``norm``
    arch: str

    @property
    def num_layers(self) -> int:
        return len(self.decoder.layers)

    @property
    def hidden_size(self) -> int:
        return int(self.model.get_input_embeddings().weight.shape[-1])

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_input_embeddings().weight.shape[0])

    @property
    def sources(self) -> list[str]:
        """Every candidate source this target computes, shallowest first."""
        return all_sources(self.num_layers)

    def states(self, input_ids: Sequence[int] | np.ndarray | torch.Tensor,
               rows: Sequence[int] | np.ndarray | None = None,
               channels: dict[str, dict[str, torch.Tensor]] | None = None) -> dict[str, torch.Tensor]:
        """Run the target on one sequence (``input_ids`` [T], positions 0..T-1) and return every
        candidate source's rows ``[R, H]`` float32 at positions ``rows`` (default: all). With
        ``channels`` (a dict, filled here), also what a capture channel hands over when it goes wrong
        the usual ways, per source ``block:<j>``: ``residual_left_out`` the output of layer ``j``'s
        last sublayer (its MLP) alone, ``input_norm`` the input norm of layer ``j + 1`` applied to
        it (``embedding``: layer 0's), where the layers have those modules."""
        ids = torch.as_tensor(np.asarray(input_ids), dtype=torch.long).reshape(1, -1)
        seen: dict[str, torch.Tensor] = {}
        layers = self.decoder.layers

        def first_input(_m: Any, args: tuple, kwargs: dict) -> None:
            seen[EMBEDDING] = args[0] if args else kwargs["hidden_states"]

        def keep(name: str) -> Any:
            def hook(_m: Any, _i: Any, out: Any) -> None:
                seen[name] = out[0] if isinstance(out, tuple) else out
            return hook

        hooks = [layers[0].register_forward_pre_hook(first_input, with_kwargs=True)]
        hooks += [layer.register_forward_hook(keep(f"block:{j}")) for j, layer in enumerate(layers)]
        hooks.append(self.decoder.norm.register_forward_hook(keep(FINAL_NORM)))
        if channels is not None:
            for j, layer in enumerate(layers):
                if getattr(layer, "mlp", None) is not None:
                    hooks.append(layer.mlp.register_forward_hook(keep(f"{RESIDUAL_LEFT_OUT}|block:{j}")))
                if getattr(layer, "input_layernorm", None) is not None:
                    before = EMBEDDING if j == 0 else f"block:{j - 1}"
                    hooks.append(layer.input_layernorm.register_forward_hook(keep(f"{INPUT_NORM}|{before}")))
        try:
            with torch.no_grad():
                self.decoder(input_ids=ids, use_cache=False)
        finally:
            for h in hooks:
                h.remove()
        pick = slice(None) if rows is None else torch.as_tensor(np.asarray(rows), dtype=torch.long)
        if channels is not None:
            for key, value in seen.items():
                if "|" in key:
                    kind, source = key.split("|")
                    channels.setdefault(kind, {})[source] = value[0, pick].float()
        return {name: seen[name][0, pick].float() for name in self.sources}


def has_weights(path: Path) -> bool:
    """Whether ``path`` is a model directory with safetensors weights (not a config alone)."""
    return path.is_dir() and any(path.glob("*.safetensors"))


def float32_bytes(path: Path) -> int:
    """What the target's weights take in float32: their element count (read from the safetensors
    headers, no tensor loaded) times 4."""
    from safetensors import safe_open

    elements = 0
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            names = f.keys()
            elements += sum(int(np.prod(f.get_slice(k).get_shape())) for k in names)
    return elements * _FLOAT32


def memory_limit() -> int:
    """The memory this process may use: physical memory, or the container's limit when lower (a pod's
    ``limits.memory``: exceeding it kills the process instead of failing an allocation)."""
    import os

    limit = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    for file in _CGROUP_LIMITS:
        try:
            text = Path(file).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            limit = min(limit, int(text))
    return limit


def too_large(path: Path) -> str | None:
    """Why the target at ``path`` cannot be recomputed here (its float32 weights would not fit in
    memory), or None when it can."""
    need, have = float32_bytes(path), memory_limit()
    if need <= 0.8 * have:
        return None
    return f"its weights take {need / 2**30:.1f} GiB in float32, this machine allows {have / 2**30:.1f} GiB"


def _decoder(model: Any) -> Any:
    """The module that runs the decoder layers and the final norm (text decoders and the language
    model of multimodal wrappers)."""
    inner = getattr(model, "model", None)
    for cand in (inner, getattr(inner, "language_model", None), getattr(model, "language_model", None)):
        if cand is not None and hasattr(cand, "layers") and hasattr(cand, "norm"):
            return cand
    return None


def load_target(path: str | Path, flag: str = "--target") -> Target:
    """The target at ``path`` (a Hugging Face model directory) in float32 on the CPU, ready to recompute
    hidden states. Bad or missing input raises :class:`InputError`."""
    path = Path(path)
    where = f"{flag} {path}"
    if not path.is_dir():
        raise InputError(where, "not a model directory", FIX)
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise InputError(where, f"no readable config.json ({exc.__class__.__name__})", FIX) from None
    if not has_weights(path):
        raise InputError(where, "holds no safetensors weights (other weight formats are pickles, never "
                         "loaded)", FIX)
    problem = too_large(path)
    if problem is not None:
        raise InputError(where, problem, "recompute on a machine that holds the target in float32")
    arch = ((config.get("architectures") or ["?"]) if isinstance(config, dict) else ["?"])[0]
    # transformers is imported here only: loading it costs seconds, and only a recomputation needs it.
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the recomputation shows its own progress; one bar, not two
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, use_safetensors=True).eval()
    except Exception as exc:  # any loader failure is about this directory: say it in one line
        raise InputError(where, f"transformers cannot load {arch} from it ({exc.__class__.__name__}: "
                         f"{str(exc).splitlines()[0] if str(exc) else ''})", FIX) from None
    decoder = _decoder(model)
    if decoder is None:
        raise InputError(where, f"{arch}: no decoder with layers and a final norm found",
                         "hidden states can be recomputed for decoder-only language models")
    return Target(path, model, decoder, arch)

"""Synthetic training dumps at production width for the profile-build benchmark, written deterministically.

SpecForge offline layout (``rows_0-2000/data_{i}.ckpt``: ``aux_hidden_state [1, T, 3*H]``,
``hidden_state [1, T, H]``, ``input_ids``, ``loss_mask``) and speculators layout
(``hidden_states/hs_{i}.safetensors``: ``hidden_states [T, 4, H]`` - three draft slots plus the
verifier's layer - and ``token_ids``), bf16, hidden 7168 (DeepSeek-V3 / Kimi-K2.5). Each layer gets
its own per-channel mean and scale plus a few massive-activation channels, so the numbers look like
residual-stream states; only the bytes and shapes matter for throughput. The data is user-data-like
(written 0600) and never committed: the benchmark generates it under a temporary directory.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

NUM_LAYERS = 61  # DeepSeek-V3 / Kimi-K2.5 decoder layers
SPECFORGE_IDS = [1, 29, 57]  # the SpecForge default triple for 61 layers (outputs of blocks 1, 29, 57)


@dataclass(frozen=True)
class Recipe:
    hidden: int = 7168
    slots: int = 3
    tokens_per_record: int = 512
    records: int = 10
    seed: int = 0

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]


def _layer_params(recipe: Recipe, layers: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(recipe.seed)
    mean = rng.normal(0.0, 0.05, size=(layers, recipe.hidden)).astype(np.float32)
    scale = rng.lognormal(0.0, 0.3, size=(layers, recipe.hidden)).astype(np.float32)
    massive = rng.choice(recipe.hidden, size=4, replace=False)
    scale[:, massive] *= 40.0
    scale *= np.linspace(0.5, 3.0, layers, dtype=np.float32)[:, None]  # the residual norm grows with depth
    return mean, scale


def _record(recipe: Recipe, i: int, layers: int):
    """``[T, layers, H]`` bf16 states and ``[T]`` token ids of record ``i`` (same for both layouts)."""
    import torch

    mean, scale = _layer_params(recipe, layers)
    rng = np.random.default_rng([recipe.seed, i])
    x = rng.standard_normal((recipe.tokens_per_record, layers, recipe.hidden), dtype=np.float32)
    x = x * scale + mean
    ids = rng.integers(0, 160_000, size=recipe.tokens_per_record)
    return torch.from_numpy(x).to(torch.bfloat16), torch.from_numpy(ids)


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def generate(root: Path, recipe: Recipe = Recipe()) -> dict[str, Path]:
    """Write both layouts under ``root/<recipe digest>/`` (once; a finished build is reused)."""
    import io

    import torch
    from safetensors.torch import save

    out = root / recipe.digest()
    dirs = {"specforge": out / "specforge", "speculators": out / "speculators"}
    if (out / "recipe.json").is_file():
        return dirs
    (dirs["specforge"] / "rows_0-2000").mkdir(parents=True, exist_ok=True)
    (dirs["speculators"] / "hidden_states").mkdir(parents=True, exist_ok=True)
    for i in range(recipe.records):
        # slots + one more: the final-norm state (SpecForge) or the verifier's layer (speculators)
        x, ids = _record(recipe, i, recipe.slots + 1)
        t = recipe.tokens_per_record
        buf = io.BytesIO()
        torch.save(
            {
                "input_ids": ids[None],
                "aux_hidden_state": x[:, : recipe.slots].reshape(1, t, -1).contiguous(),
                "hidden_state": x[:, recipe.slots][None].contiguous(),
                "loss_mask": torch.ones(1, t, dtype=torch.int64),
            },
            buf,
        )
        _write_private(dirs["specforge"] / "rows_0-2000" / f"data_{i}.ckpt", buf.getvalue())
        _write_private(
            dirs["speculators"] / "hidden_states" / f"hs_{i}.safetensors",
            save({"hidden_states": x.contiguous(), "token_ids": ids}),
        )
    (out / "recipe.json").write_text(json.dumps(asdict(recipe), indent=1))
    return dirs

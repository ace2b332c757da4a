"""Small valid inputs of every kind, for the reliability tests: a capture, a profile built from it by
the CLI, a SpecForge-style draft and a target config (all generated, deterministic, seconds)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from test_check_drafts import N_LAYERS, H, specforge_draft, target_config

from hs_tracer.cli import main
from hs_tracer.profile.capture_format import CaptureManifest, CaptureWriter

K = 3
SOURCES = ["block:1", "block:3", "block:4"]
SERVER_ARGS = ("--speculative-algorithm EAGLE3 --speculative-num-steps 3 --speculative-eagle-topk 1 "
               "--speculative-num-draft-tokens 4")


@dataclass(frozen=True)
class Inputs:
    root: Path
    capture: Path
    profile: Path
    draft: Path
    target: Path


def write_capture(path: Path, *, hidden: int = H, shards: int = 2, rows: int = 320, seed: int = 0,
                  nan: bool = False) -> Path:
    """A capture of ``shards`` prefills: slot k's channels centred on k (so slots are distinguishable)."""
    rng = np.random.default_rng(seed)
    writer = CaptureWriter(path, CaptureManifest(num_slots=K, hidden_size=hidden, sources=list(SOURCES),
                                                 layers_to_capture=[2, 4, 5], num_layers=N_LAYERS,
                                                 target_arch="LlamaForCausalLM", model="tiny"))
    for i in range(shards):
        feats = np.concatenate([rng.normal(k, 1.0 + k, (rows, hidden)) for k in range(K)], axis=1)
        if nan and i == 0:
            feats[: rows // 2, 3] = np.nan
        writer.write(torch.from_numpy(feats.astype(np.float32)), rng.integers(0, 500, rows),
                     np.arange(rows), [2, 3, 1], extras={"extend_lens": [rows]})
    return path


def write_atlas(path: Path, *, hidden: int = H, rows: int = 128, seed: int = 2) -> Path:
    """A speculators-layout dump holding every layer (embedding + each block's output)."""
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    g = torch.Generator().manual_seed(seed)
    save_file({"hidden_states": torch.randn(rows, N_LAYERS + 1, hidden, generator=g),
               "token_ids": torch.arange(rows)}, str(path / "hs_0.safetensors"))
    return path


def make_inputs(root: Path) -> Inputs:
    root.mkdir(parents=True, exist_ok=True)
    capture = write_capture(root / "capture")
    profile = root / "ref.profile"
    assert main(["profile", "build", str(write_capture(root / "train", seed=1)), "-o", str(profile),
                 "--no-progress"]) == 0
    draft = specforge_draft(root / "draft", layer_ids=[1, 3, 4])
    target = target_config(root / "target")
    return Inputs(root, capture, profile, draft, target)

"""The tensors a draft directory offers to SGLang's loader (its newest supported release): names,
shapes, small values.

Which files are read mirrors ``DefaultModelLoader._prepare_weights`` (sglang/srt/model_loader/
loader.py, load format ``auto``): the first of ``*.safetensors``, ``*.bin``, ``*.pt`` that matches
anything wins; safetensors files not named in ``model.safetensors.index.json`` are skipped when the
index exists; trainer side files (``optimizer.pt``, ...) are skipped. Side files that SGLang never
opens (``vocab_mapping.pt``, ``d2t.npy``) therefore contribute nothing, exactly as at serving time.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hs_tracer.errors import InputError
from hs_tracer.preflight.safetensors_header import TensorEntry, read_header, read_tensor

# sglang/srt/model_loader/weight_utils.py::filter_files_not_needed_for_inference
_TRAINER_FILES = ("training_args.bin", "optimizer.bin", "optimizer.pt", "scheduler.pt", "scaler.pt")
_INDEX = "model.safetensors.index.json"


class CheckpointError(InputError):
    """The draft directory cannot be read safely; the message says what to do."""


@dataclass
class Checkpoint:
    """Tensor names and shapes SGLang would iterate over, plus a reader for small tensors."""

    directory: Path
    files: list[Path]
    shapes: dict[str, tuple[int, ...]]
    _entries: dict[str, TensorEntry] = field(default_factory=dict, repr=False)
    _values: dict[str, np.ndarray] = field(default_factory=dict, repr=False)

    def load_small(self, name: str, max_elements: int = 16 * 1024 * 1024) -> np.ndarray:
        """Values of a small tensor (d2t, t2d). Large tensors are never read."""
        if name in self._values:
            return self._values[name]
        shape = self.shapes[name]
        n = int(np.prod(shape)) if shape else 1
        if n > max_elements:
            raise CheckpointError(f"{name} has {n} elements; refusing to read it whole")
        entry = self._entries.get(name)
        if entry is None:
            raise CheckpointError(f"{name}: values not available")
        return read_tensor(entry)


def select_weight_files(directory: Path) -> list[Path]:
    """The weight files SGLang would load from ``directory`` (load format auto)."""
    for pattern in ("*.safetensors", "*.bin", "*.pt"):
        found = sorted(directory.glob(pattern))
        if not found:
            continue
        if pattern == "*.safetensors":
            index = directory / _INDEX
            if index.is_file():
                try:
                    weight_map = json.loads(index.read_text())["weight_map"]
                except (ValueError, KeyError) as exc:
                    raise CheckpointError(f"{index} is not a valid safetensors index ({exc}); fix or "
                                          "remove it") from exc
                listed = {directory / f for f in weight_map.values()}
                missing = sorted(str(p.name) for p in listed if not p.is_file())
                if missing:
                    raise CheckpointError(f"{index} names shard files that are not there: {missing}; "
                                          "complete the download")
                found = [p for p in found if p in listed]
            elif len(found) == 2 and found[0].name.endswith("consolidated.safetensors") and \
                    found[1].name.endswith("model.safetensors"):
                found = [found[1]]
            return found
        return [p for p in found if not any(p.name.endswith(x) for x in _TRAINER_FILES)]
    return []


def read_checkpoint(directory: str | Path) -> Checkpoint:
    """Index the draft's weights without loading large tensors."""
    directory = Path(directory)
    files = select_weight_files(directory)
    if not files:
        raise CheckpointError(f"no *.safetensors, *.bin or *.pt weights in {directory}; SGLang would fail "
                              "with 'Cannot find any model weights'. Point --draft at the exported draft "
                              "directory (config.json + model.safetensors)")
    ckpt = Checkpoint(directory=directory, files=files, shapes={})
    for path in files:
        if path.suffix == ".safetensors":
            entries, _ = read_header(path)
            for name, entry in entries.items():
                ckpt.shapes[name] = entry.shape
                ckpt._entries[name] = entry
        else:
            _read_pickled(path, ckpt)
    return ckpt


def _read_pickled(path: Path, ckpt: Checkpoint) -> None:
    """A .bin/.pt state dict, read with ``weights_only=True`` only: never run code from a file."""
    import torch

    try:
        try:  # mmap keeps multi-GB drafts out of memory; legacy (non-zip) files cannot be mapped
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as exc:
            if "mmap" not in str(exc):
                raise
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # any unpickling refusal or corruption: same advice
        raise CheckpointError(
            f"{path} cannot be read with torch.load(weights_only=True) ({type(exc).__name__}: {exc}); "
            "hs-tracer never unpickles arbitrary objects. Convert the draft to safetensors "
            "(safetensors.torch.save_file(state_dict, 'model.safetensors'))") from exc
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        raise CheckpointError(f"{path} holds a training state, not a state dict: SGLang would load its "
                              "top-level keys. Export the draft weights to model.safetensors")
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} does not hold a state dict (got {type(state).__name__})")
    for name, value in state.items():
        if not isinstance(value, torch.Tensor):
            continue
        ckpt.shapes[name] = tuple(value.shape)
        if ("d2t" in name or "t2d" in name) and value.numel() <= 16 * 1024 * 1024 \
                and not value.is_floating_point():
            ckpt._values[name] = value.numpy().copy()

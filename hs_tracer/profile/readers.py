"""Readers for hidden-state dumps: SpecForge offline data, speculators data, hs_tracer captures.

Every reader streams one record (one sequence or one capture shard) at a time as a :class:`Record`:
the draft-input slots ``[T, K, H]`` as a torch tensor in the stored dtype (bf16 dumps stay bf16: the
accumulators convert a few tokens at a time, which is what keeps a build near the read speed),
optional extra named states ``[T, H]`` that the dump also holds (they become extra reference
candidates), and token positions. Memory stays bounded by
the largest record. Files are listed sorted by their path relative to the root, so ``--shard i/n``
splits any dump the same way on every machine.

Layouts:

* SpecForge: ``rows_*/data_*.ckpt[.gz]``, one ``torch.save`` dict per sequence with ``aux_hidden_state``
  ``[1, T, K*H]`` (pre-norm residual states), ``hidden_state`` ``[1, T, H]`` (**after** the final norm),
  ``input_ids``, ``loss_mask``. Loaded with ``torch.load(weights_only=True)`` only: no pickle code runs.
* speculators: ``hs_*.safetensors`` with ``hidden_states`` ``[T, L, H]`` and ``token_ids`` ``[T]``; the
  draft trains on ``[:, :-1]`` and the last layer is the verifier's pre-norm last hidden state.
* hs_tracer capture: :mod:`hs_tracer.profile.capture_format`.
"""

from __future__ import annotations

import gzip
import io
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

from hs_tracer.errors import InputError
from hs_tracer.profile import capture_format

SPECFORGE = "specforge"
SPECULATORS = "speculators"
CAPTURE = "hs_tracer_capture"


class LayoutError(InputError):
    """The directory is not in a layout a reader accepts, or a file in it is malformed."""


@dataclass
class Record:
    key: str  # stable across machines and shardings: "<relative file path>:<index>"
    slots: torch.Tensor  # [T, K, H] in the stored dtype
    positions: np.ndarray | None = None  # [T] token positions within their sequence, if known
    extras: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> [T, H] in the stored dtype
    accept_lengths: np.ndarray | None = None  # captures: accept lengths of the steps in this shard
    input_ids: np.ndarray | None = None  # [T] token ids of the rows, where the dump keeps them
    extend_lens: np.ndarray | None = None  # captures: rows per request, in row order


@dataclass
class Layout:
    """What a dump holds, read from its first file (and manifest)."""

    producer: str
    num_slots: int | None  # None: width known, slot count not (SpecForge without ids)
    hidden_size: int | None
    width: int  # per-token width of the slot part (K*H, or L*H for speculators)
    dtype: str
    layers_in_file: int | None = None  # speculators: L
    extras: list[str] = field(default_factory=list)  # extra state names a record carries
    manifest: capture_format.CaptureManifest | None = None


def _token_ids(value: object, rows: int) -> np.ndarray | None:
    """A dump's token ids as int64, or None when it kept none or not one per row (then nothing can be
    recomputed on them, and nothing else reads them)."""
    import torch

    if not isinstance(value, torch.Tensor) or value.numel() != rows:
        return None
    return value.reshape(-1).long().numpy()


def _torch_dtype_name(t) -> str:
    return str(t.dtype).replace("torch.", "")


class Reader:
    """Base: list files, probe the layout, stream records."""

    producer = ""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self._files = self._list()
        if not self._files:
            raise LayoutError(f"{self.root}: no {self.producer} files found")

    def _list(self) -> list[Path]:
        raise NotImplementedError

    def files(self, shard: tuple[int, int] | None = None) -> list[Path]:
        """Files of shard ``(i, n)``: every n-th file of the sorted list, starting at i."""
        if shard is None:
            return list(self._files)
        i, n = shard
        return self._files[i::n]

    def rel(self, file: Path) -> str:
        return file.relative_to(self.root).as_posix()

    def layout(self) -> Layout:
        raise NotImplementedError

    def records(self, file: Path, num_slots: int, hidden: int) -> Iterator[Record]:
        raise NotImplementedError


class SpecForgeReader(Reader):
    producer = SPECFORGE

    def _list(self) -> list[Path]:
        files = [p for p in self.root.rglob("data_*.ckpt*") if p.name.endswith((".ckpt", ".ckpt.gz"))]
        return sorted(files, key=lambda p: p.relative_to(self.root).as_posix())

    @staticmethod
    def load(file: Path) -> dict:
        import torch

        try:
            if file.name.endswith(".gz"):
                with gzip.open(file, "rb") as f:
                    data = torch.load(io.BytesIO(f.read()), weights_only=True, map_location="cpu")
            elif zipfile.is_zipfile(file):  # mapped, not copied: the accumulators read the pages once
                data = torch.load(file, weights_only=True, map_location="cpu", mmap=True)
            else:  # torch.save's legacy format cannot be mapped
                data = torch.load(file, weights_only=True, map_location="cpu")
        except Exception as exc:  # weights_only refuses pickled code: say so instead of a traceback
            raise LayoutError(
                f"{file}: not a SpecForge tensor dict loadable with weights_only=True ({exc})"
            ) from exc
        if not isinstance(data, dict) or "aux_hidden_state" not in data:
            raise LayoutError(f"{file}: SpecForge record without an 'aux_hidden_state' tensor")
        return data

    @staticmethod
    def _squeeze(t):
        return t[0] if t.dim() == 3 else t

    def layout(self) -> Layout:
        data = self.load(self._files[0])
        aux = self._squeeze(data["aux_hidden_state"])
        hidden = int(self._squeeze(data["hidden_state"]).shape[-1]) if "hidden_state" in data else None
        return Layout(
            producer=self.producer,
            num_slots=None if hidden is None else int(aux.shape[-1]) // hidden,
            hidden_size=hidden,
            width=int(aux.shape[-1]),
            dtype=_torch_dtype_name(aux),
            extras=["final_norm"] if hidden is not None else [],
        )

    def records(self, file: Path, num_slots: int, hidden: int) -> Iterator[Record]:
        data = self.load(file)
        aux = self._squeeze(data["aux_hidden_state"])
        if aux.shape[-1] != num_slots * hidden:
            raise LayoutError(
                f"{file}: aux_hidden_state is {aux.shape[-1]} wide, expected {num_slots}x{hidden}"
            )
        t = aux.shape[0]
        extras = {}
        if "hidden_state" in data:  # SpecForge keeps the post-final-norm state (the LM head input)
            extras["final_norm"] = self._squeeze(data["hidden_state"]).reshape(t, -1)
        yield Record(
            key=f"{self.rel(file)}:0",
            slots=aux.reshape(t, num_slots, hidden),
            positions=np.arange(t),
            extras=extras,
            input_ids=_token_ids(data.get("input_ids"), t),
        )


class SpeculatorsReader(Reader):
    """speculators' ``hs_*.safetensors``. The caller picks which of the L stored layers are slots
    (speculators trains on all but the last); the others become extras named ``layer:<l>`` (index in
    the file), which the profile builder maps to canonical sources. An optional ``final_norm`` [T, H]
    tensor (post-norm, written by hs_tracer's testbed and atlas dumps) becomes the extra ``final_norm``."""

    producer = SPECULATORS

    def _list(self) -> list[Path]:
        return sorted(self.root.rglob("hs_*.safetensors"), key=lambda p: p.relative_to(self.root).as_posix())

    @staticmethod
    def load(file: Path):
        from safetensors import safe_open

        try:
            with safe_open(str(file), framework="pt") as f:
                keys = set(f.keys())
                hs = f.get_tensor("hidden_states")
                final = f.get_tensor("final_norm") if "final_norm" in keys else None
                ids = f.get_tensor("token_ids") if "token_ids" in keys else None
        except Exception as exc:
            raise LayoutError(
                f"{file}: not a speculators hidden-state file with 'hidden_states' ({exc})"
            ) from exc
        if hs.dim() != 3:
            raise LayoutError(f"{file}: hidden_states must be [T, L, H], got {tuple(hs.shape)}")
        return hs, final, _token_ids(ids, hs.shape[0])

    def layout(self) -> Layout:
        hs, final, _ids = self.load(self._files[0])
        _t, layers, hidden = hs.shape
        return Layout(
            producer=self.producer,
            num_slots=max(layers - 1, 1),
            hidden_size=int(hidden),
            width=int(layers * hidden),
            dtype=_torch_dtype_name(hs),
            layers_in_file=int(layers),
            extras=["final_norm"] if final is not None else [],
        )

    def records(
        self, file: Path, num_slots: int, hidden: int, layer_index: list[int] | None = None
    ) -> Iterator[Record]:
        """``layer_index``: which file layers form the slots, in slot order (default: the first K)."""
        hs, final, ids = self.load(file)
        t, layers, h = hs.shape
        if h != hidden:
            raise LayoutError(f"{file}: hidden size {h}, expected {hidden}")
        idx = list(range(num_slots)) if layer_index is None else list(layer_index)
        if max(idx) >= layers:
            raise LayoutError(f"{file}: holds {layers} layers, slots need layer {max(idx)}")
        extras = {f"layer:{i}": hs[:, i] for i in range(layers) if i not in idx}
        if final is not None:
            extras["final_norm"] = final.reshape(t, h)
        slots = hs[:, : len(idx)] if idx == list(range(len(idx))) else hs[:, idx]  # a view when it can
        yield Record(key=f"{self.rel(file)}:0", slots=slots, positions=np.arange(t), extras=extras,
                     input_ids=ids)


class CaptureReader(Reader):
    producer = CAPTURE

    def __init__(self, root: str | Path) -> None:
        self.manifest = capture_format.read_manifest(Path(root))
        super().__init__(root)

    def _list(self) -> list[Path]:
        return [capture_format.shard_file(self.root, s) for s in self.manifest.shards]

    def layout(self) -> Layout:
        m = self.manifest
        from safetensors import safe_open

        with safe_open(str(self._files[0]), framework="pt") as f:
            width = int(f.get_slice("features").get_shape()[-1])
        return Layout(
            producer=self.producer,
            num_slots=m.num_slots,
            hidden_size=m.hidden_size,
            width=width,
            dtype=m.dtype,
            manifest=m,
        )

    def records(self, file: Path, num_slots: int, hidden: int) -> Iterator[Record]:
        import torch

        manifest = capture_format.CaptureManifest(
            **{**self.manifest.__dict__, "shards": [{"file": file.name}]}
        )
        for name, shard in capture_format.iter_shards(self.root, manifest):
            n, width = shard.features.shape
            if width != num_slots * hidden:
                raise LayoutError(f"{file}: features are {width} wide, expected {num_slots}x{hidden}")
            pos = shard.positions if (shard.positions >= 0).all() else None
            yield Record(
                key=f"{name}:0",
                slots=torch.from_numpy(shard.features.reshape(n, num_slots, hidden)),
                positions=pos,
                accept_lengths=shard.accept_lengths,
                input_ids=shard.input_ids if (shard.input_ids >= 0).all() else None,
                extend_lens=shard.extras.get("extend_lens"),
            )


def detect(path: str | Path) -> Reader:
    """The reader for a directory, by its layout; raises :class:`LayoutError` naming the accepted ones."""
    path = Path(path)
    if not path.is_dir():
        raise LayoutError(
            f"{path} is not a directory; pass a SpecForge, speculators or hs_tracer capture dir"
        )
    if capture_format.is_capture_dir(path):
        return CaptureReader(path)
    if next(path.rglob("hs_*.safetensors"), None) is not None:
        return SpeculatorsReader(path)
    if next((p for p in path.rglob("data_*.ckpt*") if p.name.endswith((".ckpt", ".ckpt.gz"))), None):
        return SpecForgeReader(path)
    raise LayoutError(
        f"{path}: no known layout (SpecForge rows_*/data_*.ckpt[.gz], speculators hs_*.safetensors, "
        "or an hs_tracer capture with manifest.json)"
    )

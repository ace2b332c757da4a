"""hs_tracer's own capture format: what a live deployment (or a test) writes for offline diagnosis.

A capture is a directory::

    manifest.json                 format, version, wiring (sources per slot, ids), sizes, shard list
    capture_00000.safetensors     features [N, K*H] (the draft input rows as fed), input_ids [N] int64,
    capture_00001.safetensors     positions [N] int64, optional accept_lengths [R] int64
    ...

``manifest.json`` keys (version 1): ``format`` = ``"hs_tracer_capture"``, ``version`` = 1,
``num_slots`` K, ``hidden_size`` H, ``dtype`` (of ``features``), ``sources`` (canonical source per slot
as the live wiring claims it, or null when unknown), ``layers_to_capture`` (SGLang's internal list, or
null), ``num_layers`` (target depth, or null), ``target_arch``, ``producer`` (free text, e.g.
``"hs_tracer 0.1.0 / vllm <release>"``), ``shards``: ``[{"file": name, "tokens": N}]``. A reader needs
only ``format``, ``version``, ``num_slots``, ``hidden_size`` and ``shards``; ``features`` may be wider
or narrower than K*H when the wiring is broken (that is what diagnosis looks for).

Live captures (:mod:`hs_tracer.export.capture`) add, all optional: ``model``, ``target_path``,
``engine`` and ``engine_version`` (the serving engine and its release), ``sglang_version``
(deprecated: ``engine_version`` under SGLang, "" under another engine), ``sample_rate`` (fraction of
steps captured), ``rows`` (which draft inputs the rows are, e.g. ``"prefill_draft_extend"``),
``wiring`` (the WiringRecord as JSON), ``next_shard`` (the index the next shard file gets: rotation
deletes the oldest shards, names are never reused), ``skipped`` (captures dropped: writer behind or
shard larger than the size bound). Shards may hold extra int64 tensors: ``extend_lens`` [R] (rows per
request, in row order) and ``next_token_ids`` [R] (the token SGLang appends after each request's last row).

Captured hidden states are user data (prompts can be reconstructed from them): files are written 0600.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hs_tracer import engines
from hs_tracer.errors import InputError

FORMAT = "hs_tracer_capture"
VERSION = 1
MANIFEST = "manifest.json"
_CORE_KEYS = frozenset({"features", "input_ids", "positions", "accept_lengths"})


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    except BaseException:
        path.unlink(missing_ok=True)  # a shard cut short by a full disk is not left behind
        raise
    os.chmod(path, 0o600)


@dataclass
class CaptureManifest:
    num_slots: int
    hidden_size: int
    dtype: str = "float32"
    sources: list[str] | None = None
    layers_to_capture: list[int] | None = None
    num_layers: int | None = None
    target_arch: str | None = None
    producer: str = "hs_tracer"
    shards: list[dict[str, Any]] = field(default_factory=list)
    model: str | None = None
    target_path: str | None = None
    engine: str | None = None
    engine_version: str | None = None
    sample_rate: float | None = None
    rows: str | None = None
    wiring: dict[str, Any] | None = None
    next_shard: int | None = None
    skipped: int = 0

    @property
    def sglang_version(self) -> str | None:
        """Deprecated alias of ``engine_version`` under the engine that manifests without an ``engine``
        key came from ("" under any other engine); ``manifest.json`` keeps writing the key."""
        return self.engine_version if self.engine in (None, engines.DEFAULT) else ""

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, **self.__dict__, "sglang_version": self.sglang_version}

    @classmethod
    def from_json(cls, data: dict[str, Any], where: Path) -> CaptureManifest:
        if data.get("format") != FORMAT:
            raise InputError(f"{where}: not an hs_tracer capture manifest (format={data.get('format')!r})")
        if int(data.get("version", 0)) != VERSION:
            raise InputError(
                f"{where}: capture version {data.get('version')} is not supported (need {VERSION})"
            )
        try:
            for shard in data["shards"]:
                shard_name(shard, where)
            return cls(
                num_slots=int(data["num_slots"]),
                hidden_size=int(data["hidden_size"]),
                dtype=str(data.get("dtype", "float32")),
                sources=data.get("sources"),
                layers_to_capture=data.get("layers_to_capture"),
                num_layers=data.get("num_layers"),
                target_arch=data.get("target_arch"),
                producer=str(data.get("producer", "")),
                shards=list(data["shards"]),
                model=data.get("model"),
                target_path=data.get("target_path"),
                engine=data.get("engine"),
                engine_version=data.get("engine_version", _legacy_version(data)),
                sample_rate=data.get("sample_rate"),
                rows=data.get("rows"),
                wiring=data.get("wiring"),
                next_shard=data.get("next_shard"),
                skipped=int(data.get("skipped", 0) or 0),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise InputError(
                f"{where}: manifest lacks or mangles num_slots/hidden_size/shards ({exc})"
            ) from exc


def _legacy_version(data: Mapping[str, Any]) -> Any:
    """A manifest written before ``engine_version``: its deprecated ``sglang_version`` (None: none)."""
    if data.get("engine", engines.DEFAULT) != engines.DEFAULT:
        return None
    return data.get("sglang_version")


def shard_name(entry: Any, where: Path) -> str:
    """A manifest's shard file name: a plain file name in the capture directory, nothing else."""
    name = entry.get("file") if isinstance(entry, dict) else None
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name \
            or "\0" in name or name.startswith("."):
        raise InputError(f"{where}: shard entry {entry!r} is not a plain file name inside the capture "
                         "directory (paths, '..' and hidden files are refused)")
    return name


def shard_file(root: Path, entry: Any) -> Path:
    """The shard's path, refused when it is a symlink or resolves outside the capture directory."""
    root = Path(root)
    file = root / shard_name(entry, root / MANIFEST)
    if file.is_symlink() or file.resolve().parent != root.resolve():
        raise InputError(f"{file}: a capture shard must be a regular file inside {root} (symlinks are "
                         "refused)")
    return file


def is_capture_dir(path: Path) -> bool:
    manifest = Path(path) / MANIFEST
    if not manifest.is_file():
        return False
    try:
        return json.loads(manifest.read_text()).get("format") == FORMAT
    except ValueError:
        return False


def read_manifest(path: Path) -> CaptureManifest:
    manifest = Path(path) / MANIFEST
    try:
        data = json.loads(manifest.read_text())
    except (OSError, ValueError) as exc:
        raise InputError(f"{manifest}: unreadable capture manifest ({exc})") from exc
    return CaptureManifest.from_json(data, manifest)


class CaptureWriter:
    """Writes a capture directory shard by shard (each :meth:`write` call is one shard file)."""

    def __init__(self, path: str | Path, manifest: CaptureManifest) -> None:
        self.path = Path(path)
        # Only a directory created here gets 0700; an existing one keeps its owner's mode.
        self.path.mkdir(parents=True, mode=0o700, exist_ok=True)
        self.manifest = manifest

    def write(
        self,
        features,
        input_ids=None,
        positions=None,
        accept_lengths: Sequence[int] | None = None,
        extras: Mapping[str, Any] | None = None,
    ) -> Path:
        """One shard: ``features`` [N, width] (torch tensor of any float dtype, e.g. bf16, or numpy);
        ``extras``: more int64 tensors by name (e.g. ``extend_lens``, ``next_token_ids``)."""
        import torch
        from safetensors.torch import save

        feats = torch.as_tensor(features).detach().to("cpu").contiguous()
        if feats.dim() != 2:
            raise InputError(f"features must be [N, width], got {tuple(feats.shape)}")
        n = feats.shape[0]

        def ints(v) -> torch.Tensor:
            return torch.as_tensor(np.asarray(v if v is not None else np.full(n, -1)), dtype=torch.int64)

        tensors = {"features": feats, "input_ids": ints(input_ids), "positions": ints(positions)}
        if accept_lengths is not None:
            tensors["accept_lengths"] = ints(accept_lengths)
        for key, value in (extras or {}).items():
            tensors[key] = torch.as_tensor(np.asarray(value), dtype=torch.int64)
        index = len(self.manifest.shards) if self.manifest.next_shard is None else self.manifest.next_shard
        name = f"capture_{index:05d}.safetensors"
        _write_private(self.path / name, save(tensors))
        self.manifest.shards.append({"file": name, "tokens": n})
        self.manifest.next_shard = index + 1
        self.manifest.dtype = str(feats.dtype).replace("torch.", "")
        self.write_manifest()
        return self.path / name

    def write_manifest(self) -> None:
        """Rewrite ``manifest.json`` (atomically: readers never see a half-written one)."""
        tmp = self.path / f".{MANIFEST}.tmp"
        _write_private(tmp, json.dumps(self.manifest.to_json(), indent=2).encode())
        tmp.replace(self.path / MANIFEST)

    def drop_oldest(self) -> int:
        """Delete the oldest shard (rotation); returns the bytes freed."""
        shard = self.manifest.shards.pop(0)
        file = self.path / shard["file"]
        size = file.stat().st_size if file.exists() else 0
        self.write_manifest()  # first forget it, then delete: a reader never sees a missing file listed
        file.unlink(missing_ok=True)
        return size


@dataclass
class CaptureShard:
    features: np.ndarray  # [N, width] float32
    input_ids: np.ndarray
    positions: np.ndarray
    accept_lengths: np.ndarray | None
    extras: dict[str, np.ndarray] = field(default_factory=dict)  # e.g. extend_lens, next_token_ids


def iter_shards(path: Path, manifest: CaptureManifest | None = None) -> Iterator[tuple[str, CaptureShard]]:
    """Yield ``(shard file name, shard)`` in manifest order, one shard in memory at a time."""
    from safetensors import safe_open

    manifest = manifest or read_manifest(path)
    for shard in manifest.shards:
        file = shard_file(Path(path), shard)
        with safe_open(str(file), framework="pt") as f:
            keys = set(f.keys())
            feats = f.get_tensor("features").float().numpy()
            ids = f.get_tensor("input_ids").numpy() if "input_ids" in keys else np.full(len(feats), -1)
            pos = f.get_tensor("positions").numpy() if "positions" in keys else np.full(len(feats), -1)
            acc = f.get_tensor("accept_lengths").numpy() if "accept_lengths" in keys else None
            extras = {k: f.get_tensor(k).numpy() for k in sorted(keys - _CORE_KEYS)}
        yield shard["file"], CaptureShard(feats, ids, pos, acc, extras)

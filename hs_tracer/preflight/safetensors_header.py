"""Read a safetensors file's tensor table without loading its tensors.

Drafts can be gigabytes (a Kimi-K2 draft's fc alone is 7168 x 21504). The format is an 8-byte
little-endian header length, a JSON header (name -> dtype, shape, byte offsets) and the raw data,
so names and shapes cost one small read, and a small tensor (d2t, t2d) can be read by its offsets.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# Header sizes above this are not plausible for a draft checkpoint; refuse rather than read GBs.
_MAX_HEADER_BYTES = 100 * 1024 * 1024

_NUMPY_DTYPES = {
    "BOOL": np.bool_,
    "U8": np.uint8,
    "I8": np.int8,
    "I16": np.int16,
    "I32": np.int32,
    "I64": np.int64,
    "U16": np.uint16,
    "U32": np.uint32,
    "U64": np.uint64,
    "F16": np.float16,
    "F32": np.float32,
    "F64": np.float64,
}


class SafetensorsError(ValueError):
    """The file is not a readable safetensors file."""


@dataclass(frozen=True)
class TensorEntry:
    """One tensor's table entry: where it is and what it looks like, not its data."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: Path
    begin: int  # absolute byte offset in ``file``
    end: int

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def read_header(path: str | Path) -> tuple[dict[str, TensorEntry], dict[str, str]]:
    """Return (tensors by name, ``__metadata__``) of one safetensors file."""
    path = Path(path)
    with path.open("rb") as fh:
        raw_len = fh.read(8)
        if len(raw_len) != 8:
            raise SafetensorsError(f"{path}: too short to be a safetensors file")
        (length,) = struct.unpack("<Q", raw_len)
        if length > _MAX_HEADER_BYTES:
            raise SafetensorsError(f"{path}: header length {length} is not plausible")
        raw = fh.read(length)
    if len(raw) != length:
        raise SafetensorsError(f"{path}: truncated header")
    try:
        header = json.loads(raw)
    except ValueError as exc:
        raise SafetensorsError(f"{path}: header is not JSON ({exc})") from exc
    data_start = 8 + length
    metadata = header.pop("__metadata__", {}) or {}
    tensors: dict[str, TensorEntry] = {}
    for name, info in header.items():
        try:
            begin, end = info["data_offsets"]
            tensors[name] = TensorEntry(
                name=name,
                dtype=str(info["dtype"]),
                shape=tuple(int(d) for d in info["shape"]),
                file=path,
                begin=data_start + int(begin),
                end=data_start + int(end),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise SafetensorsError(f"{path}: bad header entry for {name!r}") from exc
    return tensors, {str(k): str(v) for k, v in metadata.items()}


def read_tensor(entry: TensorEntry, max_bytes: int = 64 * 1024 * 1024) -> np.ndarray:
    """Read one (small) tensor by its offsets; integer, bool and IEEE float dtypes only."""
    dtype = _NUMPY_DTYPES.get(entry.dtype)
    if dtype is None:
        raise SafetensorsError(f"{entry.file}: cannot read {entry.name!r} of dtype {entry.dtype} as numpy")
    nbytes = entry.end - entry.begin
    if nbytes > max_bytes:
        raise SafetensorsError(f"{entry.file}: {entry.name!r} is {nbytes} bytes, larger than {max_bytes}")
    if nbytes != entry.numel * np.dtype(dtype).itemsize:
        raise SafetensorsError(f"{entry.file}: {entry.name!r} byte range does not match its shape")
    with entry.file.open("rb") as fh:
        fh.seek(entry.begin)
        raw = fh.read(nbytes)
    if len(raw) != nbytes:
        raise SafetensorsError(f"{entry.file}: {entry.name!r} data is truncated")
    return np.frombuffer(raw, dtype=np.dtype(dtype).newbyteorder("<")).reshape(entry.shape).copy()

"""Read a safetensors file's tensor table without loading its tensors.

Drafts can be gigabytes (a Kimi-K2 draft's fc alone is 7168 x 21504). The format is an 8-byte
little-endian header length, a JSON header (name -> dtype, shape, byte offsets) and the raw data,
so names and shapes cost one small read, and a small tensor (d2t, t2d) can be read by its offsets.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hs_tracer.errors import InputError

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


class SafetensorsError(InputError):
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


# Bytes per element of every dtype the format defines (sub-byte types are not used by drafts).
DTYPE_SIZES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "F8_E4M3FNUZ": 1,
    "F8_E5M2FNUZ": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8, "C64": 8,
}


def read_header(path: str | Path) -> tuple[dict[str, TensorEntry], dict[str, str]]:
    """Return (tensors by name, ``__metadata__``) of one safetensors file.

    Everything the format requires is checked before the header is trusted: a JSON object, known
    dtypes, shapes whose byte size matches the offsets, offsets that tile the data area without gaps
    or overlaps, and a data area that ends exactly at the end of the file (a download cut short has
    offsets past the end).
    """
    path = Path(path)
    with path.open("rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        raw_len = fh.read(8)
        if len(raw_len) != 8:
            raise SafetensorsError(f"{path}: too short to be a safetensors file")
        (length,) = struct.unpack("<Q", raw_len)
        if length > _MAX_HEADER_BYTES:
            raise SafetensorsError(f"{path}: header length {length} is not plausible")
        raw = fh.read(length)
    if len(raw) != length:
        raise SafetensorsError(f"{path}: truncated header ({size} bytes, header claims {length})")
    try:
        header = json.loads(raw)
    except ValueError as exc:
        raise SafetensorsError(f"{path}: header is not JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: header is not a JSON object")
    data_start = 8 + length
    metadata = header.pop("__metadata__", {}) or {}
    if not isinstance(metadata, dict):
        raise SafetensorsError(f"{path}: __metadata__ is not a JSON object")
    tensors: dict[str, TensorEntry] = {}
    for name, info in header.items():
        try:
            begin, end = info["data_offsets"]
            dtype, shape = info["dtype"], info["shape"]
            if not (isinstance(dtype, str) and isinstance(shape, list)
                    and all(type(v) is int and v >= 0 for v in (*shape, begin, end)) and begin <= end):
                raise TypeError("types")
        except (KeyError, TypeError, ValueError) as exc:
            raise SafetensorsError(f"{path}: bad header entry for {name!r}") from exc
        entry = TensorEntry(name=name, dtype=dtype, shape=tuple(shape), file=path,
                            begin=data_start + begin, end=data_start + end)
        if dtype not in DTYPE_SIZES:
            raise SafetensorsError(f"{path}: {name!r} has unknown dtype {dtype!r}")
        if end - begin != entry.numel * DTYPE_SIZES[dtype]:
            raise SafetensorsError(f"{path}: {name!r} byte range {begin}..{end} does not match its "
                                   f"shape {list(shape)} of {dtype}")
        tensors[name] = entry
    cursor = data_start
    for entry in sorted(tensors.values(), key=lambda e: (e.begin, e.end)):
        if entry.begin != cursor:
            raise SafetensorsError(f"{path}: tensor data of {entry.name!r} "
                                   f"{'overlaps another' if entry.begin < cursor else 'leaves a gap'}")
        cursor = entry.end
    if cursor != size:
        raise SafetensorsError(
            f"{path}: the header's data ends at byte {cursor} but the file has {size} bytes"
            + (" (truncated: an interrupted download or copy?)" if cursor > size else ""))
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

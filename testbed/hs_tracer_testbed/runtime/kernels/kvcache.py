"""Pure-Python stand-in for sgl-kernel's ``copy_all_layer_kv_cache_cpu``.

Why: SGLang 0.5.23's KV pools warm up their all-layer copy at allocation time when speculative
decoding is on (and move accepted tree tokens with it), so a KV pool cannot even be created
without this op. The pool describes its per-layer buffers by raw data pointers and row strides in
bytes, so the copy is done with ``ctypes.memmove`` on those addresses.
"""

from __future__ import annotations

import ctypes

import torch

__all__ = ["copy_all_layer_kv_cache"]


def copy_all_layer_kv_cache(
    data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor, src_loc: torch.Tensor
) -> None:
    """For every buffer i (address data_ptrs[i], row size strides[i] bytes), copy row src_loc[j]
    to row tgt_loc[j] for all j. Sources are read before any target is written, so overlapping
    source/target sets behave like the GPU kernel's one-shot gather/scatter."""
    ptrs = [int(p) for p in data_ptrs.reshape(-1).tolist()]
    row_bytes = [int(s) for s in strides.reshape(-1).tolist()]
    if len(row_bytes) == 1 and len(ptrs) > 1:
        row_bytes = row_bytes * len(ptrs)
    if len(ptrs) != len(row_bytes):
        raise ValueError(f"copy_all_layer_kv_cache: {len(ptrs)} data pointers but {len(row_bytes)} strides")
    tgt = tgt_loc.reshape(-1).tolist()
    src = src_loc.reshape(-1).tolist()
    if len(tgt) != len(src):
        raise ValueError(f"copy_all_layer_kv_cache: {len(tgt)} target rows but {len(src)} source rows")
    for base, size in zip(ptrs, row_bytes, strict=True):
        staged = [ctypes.string_at(base + s * size, size) for s in src]
        for t, row in zip(tgt, staged, strict=True):
            ctypes.memmove(base + t * size, row, size)

"""Fused Triton fingerprint kernel: one read of ``x [N, K*H]``, per-program partial sums to a ring,
channel sums into the window accumulators.

At the batch sizes of decoding (a few to a few hundred rows) the kernel's time is a chain of
dependent memory round trips, not bandwidth, so the design removes links from that chain:

* Grid: one program per (slot, column block), each over *all* rows, so no two programs of a launch
  touch the same column: the window sums are one relaxed atomic add per column and launch, and no
  program waits for another. Small batches use narrow blocks and one warp per program (the row
  reduction stays in registers and warp shuffles); larger ones wider blocks and taller row tiles
  (more bytes in flight per program). :data:`DEFAULT_TIERS` holds the choice by row count.
* No cross-program reduction on the device: each program writes its partial scalars (sum, sum of
  squares, absmax, non-finite count) into the ring row of its launch, and the host adds them up
  (``ring.DigestRing``). A cross-program reduction (ticket, last program, fence) cost 2.7 µs per
  launch on an H100, more than everything else at small batches.
* Every 8-byte word written to the ring carries the low 32 bits of the launch number in its upper
  half, so the host can tell a complete row from one still being written without any fence: a row
  is complete when every word it expects carries the launch's tag.
* The launch number comes from a device counter each program adds itself to when it starts (the
  atomic's latency overlaps the row loads): ``seq = (launches << 32) | programs arrived``; the
  program that arrives last closes the launch (``+ 2**32 - programs``), or takes it back (``-
  programs``) when the launch read no row. Because the counter lives on the device, the same launch
  replayed from a CUDA graph fills successive rows.

All-finite data takes a 4-operation-per-value path; a program whose rows hold a NaN/Inf reads them
a second time with masking. The masked variant (``VALID``) is the one recorded into someone else's
graph over a padded batch: every program counts the leading rows whose ``valid`` entry (a KV-cache
slot) is non-zero, and reads that many.

One launch, no memset, no allocation, nothing read back: safe to capture in a CUDA graph and
replay. Concurrent launches on different streams must not share one ring (the counter orders them).

The module imports Triton, so import it only where a kernel will run (CUDA, or CPU under
``TRITON_INTERPRET=1``, which is read when this module is imported).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from hs_tracer.fingerprint.reference import ChannelAccumulators
from hs_tracer.fingerprint.ring import reduce_rows, row_words


@dataclass(frozen=True)
class KernelConfig:
    """Tile shape of one program: ``block_h`` columns, ``block_n`` rows per loop step, ``num_warps``."""

    block_h: int
    block_n: int
    num_warps: int


# (largest row count, config), the last for any larger count. Measured on an H100 against the
# fastest one-launch read of the same bytes (benchmarks/kernel_floor_gpu.py).
DEFAULT_TIERS: tuple[tuple[int | None, KernelConfig], ...] = (
    (64, KernelConfig(block_h=32, block_n=4, num_warps=1)),
    (256, KernelConfig(block_h=64, block_n=16, num_warps=2)),
    (None, KernelConfig(block_h=64, block_n=64, num_warps=4)),
)


@triton.jit
def _scan_rows(col_ptr, col_ok, stride_row, row_end,
               BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, MASKED: tl.constexpr):
    """Per-column sum, sum of squares, absmax and non-finite count over rows [0, row_end).

    Tile-shaped accumulators, reduced over the rows once at the end. MASKED=False is the fast path
    for all-finite data; a non-finite value makes its column's sum of squares non-finite, which the
    caller detects and answers by scanning again with MASKED=True (non-finite values counted and
    excluded)."""
    t_s = tl.zeros([BLOCK_N, BLOCK_H], dtype=tl.float32)
    t_q = tl.zeros([BLOCK_N, BLOCK_H], dtype=tl.float32)
    t_m = tl.zeros([BLOCK_N, BLOCK_H], dtype=tl.float32)
    t_b = tl.zeros([BLOCK_N, BLOCK_H], dtype=tl.int32)
    row_ids = tl.arange(0, BLOCK_N)
    for r0 in range(0, row_end, BLOCK_N):
        rows = r0 + row_ids
        m = (rows < row_end)[:, None] & col_ok[None, :]
        ptrs = col_ptr[None, :] + rows.to(tl.int64)[:, None] * stride_row
        v = tl.load(ptrs, mask=m, other=0.0).to(tl.float32)
        if MASKED:
            ok = tl.abs(v) < float("inf")  # false for +-inf and NaN; masked lanes load 0 (finite)
            v = tl.where(ok, v, 0.0)
            t_b += (~ok).to(tl.int32)
        t_s += v
        t_q += v * v
        t_m = tl.maximum(t_m, tl.abs(v))
    return tl.sum(t_s, axis=0), tl.sum(t_q, axis=0), tl.max(t_m, axis=0), tl.sum(t_b, axis=0)


@triton.jit
def _real_rows(valid_ptr, enable_ptr, n_rows, BLOCK: tl.constexpr):
    """Rows of a padded batch to read: how many of the ``n_rows`` ``valid`` entries are non-zero
    when they form a prefix (SGLang's padding follows the real rows); -1 when they do not (the
    digest then says so and nothing is read); 0 while ``enable`` is 0. Every program computes it
    (a few KB from L2)."""
    count = 0
    end = 0
    for r0 in range(0, n_rows, BLOCK):
        idx = r0 + tl.arange(0, BLOCK)
        real = tl.load(valid_ptr + idx, mask=idx < n_rows, other=0) != 0
        count += tl.sum(real.to(tl.int32), axis=0)
        end = tl.maximum(end, tl.max(tl.where(real, idx + 1, 0), axis=0))
    rows = tl.where(count == end, count, -1)
    return tl.where(tl.load(enable_ptr) != 0, rows, 0)


@triton.jit
def _tagged(tag, value):
    """One ring word: the launch tag in the upper 32 bits, ``value``'s 32 bits below."""
    return tag | (value.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF)


@triton.jit(do_not_specialize=["n_rows", "ring_size"])
def _fingerprint_kernel(
    x_ptr, stride_row, stride_col, n_rows, hidden, num_col_blocks,
    ring_ptr, ring_stride, ring_size, seq_ptr,
    acc_count_ptr, acc_sum_ptr, acc_sumsq_ptr, valid_ptr, enable_ptr,
    BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, VALID: tl.constexpr,
):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    arrival = tl.atomic_add(seq_ptr, 1, sem="relaxed")  # used at the end: its latency overlaps the loads
    slot = pid // num_col_blocks
    cols = (pid % num_col_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_ok = cols < hidden
    rows_read = n_rows
    if VALID:  # a padded batch: its real rows come first, then padding whose valid entry is 0
        rows_read = _real_rows(valid_ptr, enable_ptr, n_rows, 128)
    row_end = tl.maximum(rows_read, 0)
    col_ptr = x_ptr + (slot * hidden + cols).to(tl.int64) * stride_col
    s, q, m, bad = _scan_rows(col_ptr, col_ok, stride_row, row_end, BLOCK_N, BLOCK_H, False)
    if tl.sum((~(q < float("inf"))).to(tl.int32), axis=0) > 0:  # a NaN/Inf (or overflow) in here
        s, q, m, bad = _scan_rows(col_ptr, col_ok, stride_row, row_end, BLOCK_N, BLOCK_H, True)

    acc_off = slot * hidden + cols  # this program's columns, added to by no other program of the launch
    tl.atomic_add(acc_sum_ptr + acc_off, s, mask=col_ok, sem="relaxed")
    tl.atomic_add(acc_sumsq_ptr + acc_off, q, mask=col_ok, sem="relaxed")
    tl.atomic_add(acc_count_ptr + acc_off, row_end - bad, mask=col_ok, sem="relaxed")

    launch = (arrival >> 32) + 1
    if (arrival & 0xFFFFFFFF) == programs - 1:  # the last to arrive closes the launch (or takes it back)
        p = programs.to(tl.int64)
        one_launch = tl.full([], 1, tl.int64) << 32
        tl.atomic_add(seq_ptr, tl.where(rows_read != 0, one_launch - p, -p), sem="relaxed")
    if rows_read != 0:  # a launch that read no row (disabled, or an idle batch) writes nothing
        tag = (launch & 0xFFFFFFFF) << 32
        row = ring_ptr + (launch % ring_size) * ring_stride
        field = tl.arange(0, 4)
        nonfinite = tl.sum(bad, axis=0).to(tl.float32)
        partial = tl.where(field == 2, tl.max(m, axis=0), nonfinite)
        partial = tl.where(field == 0, tl.sum(s, axis=0), tl.where(field == 1, tl.sum(q, axis=0), partial))
        tl.store(row + 2 + pid * 4 + field, _tagged(tag, partial))
        if pid == 0:
            head = tl.where(field == 0, rows_read, programs)
            tl.store(row + field, tag | (head.to(tl.int64) & 0xFFFFFFFF), mask=field < 2)


@dataclass(frozen=True)
class RingTarget:
    """Where the kernel writes: ``records [R, W]`` int64 (device or pinned host memory; ``W`` from
    ``ring.row_words``) and the launch counter ``seq [1]`` int64 on the device. Launch ``L``
    (1-based) fills row ``L % R``; ``R`` divides 2**32."""

    records: torch.Tensor
    seq: torch.Tensor


def max_programs(num_slots: int, hidden: int, tiers=DEFAULT_TIERS) -> int:
    """The most programs any launch of this width runs: the ring rows are sized for it."""
    return max(num_slots * triton.cdiv(hidden, cfg.block_h) for _rows, cfg in tiers)


class FingerprintWorkspace:
    """What one kernel launch touches besides its input and ring: the window's per-channel sums
    (``acc``; pass another workspace's to add into the same window: the kernel adds atomically) and
    a one-row device ring for launches that pass none (graph capture, tests: :meth:`last_digest`)."""

    def __init__(self, num_slots: int, hidden: int, device: torch.device | str,
                 tiers: tuple[tuple[int | None, KernelConfig], ...] = DEFAULT_TIERS,
                 acc: ChannelAccumulators | None = None) -> None:
        device = torch.device(device)
        if num_slots < 1 or hidden < 1:
            raise ValueError(f"num_slots and hidden must be positive, got {num_slots}, {hidden}")
        self.num_slots = num_slots
        self.hidden = hidden
        self.device = device
        self.tiers = tiers
        self.programs = max_programs(num_slots, hidden, tiers)
        self.acc = acc if acc is not None else ChannelAccumulators(
            torch.zeros((num_slots, hidden), dtype=torch.int32, device=device),
            torch.zeros((2, num_slots, hidden), dtype=torch.float32, device=device))
        self.own = RingTarget(torch.zeros((1, row_words(self.programs)), dtype=torch.int64, device=device),
                              torch.zeros(1, dtype=torch.int64, device=device))
        # Fast relaunch (see fingerprint_fused): compiled kernels by specialisation, and the fixed
        # device pointers as plain integers (the launcher then skips its pointer checks).
        self._compiled: dict[tuple, object] = {}
        self._ptrs = (self.acc.count.data_ptr(), self.acc.sums[0].data_ptr(), self.acc.sums[1].data_ptr())

    def config(self, n_rows: int) -> KernelConfig:
        """The tile shape for a launch over ``n_rows`` rows."""
        for most, cfg in self.tiers:
            if most is None or n_rows <= most:
                return cfg
        return self.tiers[-1][1]

    def last_digest(self) -> tuple[int, np.ndarray]:
        """``(rows read, raw [K, 5])`` of the last launch into :attr:`own`: synchronous, tests only."""
        words = self.own.records.cpu().numpy()
        launch = int(self.own.seq.item()) >> 32
        age, rows, raw = reduce_rows(words, np.array([launch]), self.num_slots, self.hidden)
        if age[0] != 0:
            raise RuntimeError("the last launch's row is incomplete")
        return int(rows[0]), raw[0]


def _current_stream(device_index: int) -> int:
    return triton.runtime.driver.active.get_current_stream(device_index)


def _spec(v: int) -> tuple[bool, bool, bool]:
    """How Triton specialises an integer argument: equal to 1, divisible by 16, 64-bit."""
    return v == 1, v % 16 == 0, not -(2**31) <= v < 2**31


def fingerprint_fused(x: torch.Tensor, ws: FingerprintWorkspace, ring: RingTarget | None = None,
                      valid: torch.Tensor | None = None, enable: torch.Tensor | None = None) -> None:
    """Enqueue the fused kernel on the current stream: partial sums into the next row of ``ring``
    (default ``ws.own``), per-channel sums added to ``ws.acc``. ``x`` must be ``[N, K*H]`` with
    ``N >= 1``.

    Masked launch (``valid``: ``N`` integers on the device, ``enable``: one int32 there, both read
    when the kernel runs): ``x`` is a padded batch whose real rows, those with a non-zero ``valid``
    entry, come first; only they are read, and only while ``enable`` is non-zero. The row header
    counts the rows read; a launch that read none (``enable`` 0, or no real row) writes nothing and
    does not advance the counter; real rows that are not a prefix are not read, and the header says
    -1 rows. What a launch recorded once into a CUDA graph needs to fingerprint a padded batch
    that changes with every replay.

    The first launch per input specialisation goes through ``triton.jit`` (compiling if needed);
    later ones call the compiled kernel directly, skipping the JIT's per-call argument binding and
    cache lookup, which cost more host time than the kernel takes on the GPU at small N.
    """
    if x.dim() != 2 or x.shape[1] != ws.num_slots * ws.hidden:
        raise ValueError(f"expected x of shape [N, {ws.num_slots}*{ws.hidden}], got {tuple(x.shape)}")
    n = x.shape[0]
    if n == 0:
        raise ValueError("fingerprint_fused needs at least one row; handle N=0 on the host")
    ring = ws.own if ring is None else ring
    records = ring.records
    cfg = ws.config(n)
    num_col_blocks = triton.cdiv(ws.hidden, cfg.block_h)
    grid = ws.num_slots * num_col_blocks
    masked = valid is not None
    if masked and (enable is None or valid.dim() != 1 or valid.shape[0] < n or valid.dtype != torch.int64):
        raise ValueError("a masked launch needs valid (int64, one entry per row of x) and enable")
    key = _specialisation(x, ring, valid, cfg)
    compiled = ws._compiled.get(key)
    if compiled is not None:
        count, sums, sumsq = ws._ptrs
        compiled.run(grid, 1, 1, _current_stream(x.device.index), compiled.function, compiled.packed_metadata,
                     None, None, None,  # no launch metadata, no enter/exit hooks
                     x.data_ptr(), x.stride(0), x.stride(1), n, ws.hidden, num_col_blocks,
                     records.data_ptr() if records.is_cuda else records, records.stride(0), records.shape[0],
                     ring.seq.data_ptr(), count, sums, sumsq,
                     valid.data_ptr() if masked else count, enable.data_ptr() if masked else count,
                     cfg.block_n, cfg.block_h, masked)
        return
    compiled = _fingerprint_kernel[(grid,)](
        x, x.stride(0), x.stride(1), n, ws.hidden, num_col_blocks,
        records, records.stride(0), records.shape[0], ring.seq,
        ws.acc.count, ws.acc.sums[0], ws.acc.sums[1],
        valid if masked else ws.acc.count, enable if masked else ws.acc.count,  # unread unless masked
        cfg.block_n, cfg.block_h, masked, num_warps=cfg.num_warps)
    if x.is_cuda and all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata")):
        ws._compiled[key] = compiled


def _specialisation(x: torch.Tensor, ring: RingTarget, valid: torch.Tensor | None,
                    cfg: KernelConfig) -> tuple:
    """What a compiled kernel is specialised for, as far as the launches here vary it (Triton
    specialises pointers on 16-byte alignment and integers as :func:`_spec` says)."""
    records = ring.records
    return (x.dtype, x.data_ptr() % 16 == 0, _spec(x.stride(0)), _spec(x.stride(1)), records.is_cuda,
            records.data_ptr() % 16 == 0, _spec(records.stride(0)), cfg,
            None if valid is None else valid.data_ptr() % 16 == 0)


def is_compiled(x: torch.Tensor, ws: FingerprintWorkspace, ring: RingTarget,
                valid: torch.Tensor | None = None) -> bool:
    """Whether this launch needs no compilation (nor Triton's JIT): the only kind of launch safe to
    record while another library captures a CUDA graph."""
    return _specialisation(x, ring, valid, ws.config(x.shape[0])) in ws._compiled

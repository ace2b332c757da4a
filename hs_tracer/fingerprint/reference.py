"""Plain torch fingerprint: the reference the fused kernel is checked against, and the CPU path.

It computes exactly what :mod:`hs_tracer.fingerprint.kernel` computes, with ordinary torch
reductions (several passes, temporaries). It runs on any device without a host sync, but allocates;
on CUDA the probe uses the fused kernel instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hs_tracer.fingerprint.stats import DIGEST_WIDTH, ChannelStats


@dataclass
class ChannelAccumulators:
    """Per-window, per-slot, per-channel sums living on the device of the input.

    ``count`` is ``[K, H]`` (int32 on CUDA, where the kernel adds atomically; int64 on CPU);
    ``sums`` is ``[2, K, H]``: row 0 the sum, row 1 the sum of squares (float32 on CUDA, float64 on CPU).
    One tensor for both sums keeps the window readback to one copy.
    """

    count: torch.Tensor
    sums: torch.Tensor

    @classmethod
    def zeros(cls, num_slots: int, hidden: int, device: torch.device | str) -> ChannelAccumulators:
        device = torch.device(device)
        cuda = device.type == "cuda"
        count = torch.zeros((num_slots, hidden), dtype=torch.int32 if cuda else torch.int64, device=device)
        sums = torch.zeros((2, num_slots, hidden), dtype=torch.float32 if cuda else torch.float64,
                           device=device)
        return cls(count, sums)

    def reset(self) -> None:
        self.count.zero_()
        self.sums.zero_()

    def to_stats(self) -> ChannelStats:
        """Host copy as float64 :class:`ChannelStats` (synchronous: tests and the CPU path only)."""
        count = self.count.detach().to("cpu", torch.float64).numpy()
        sums = self.sums.detach().to("cpu", torch.float64).numpy()
        return ChannelStats(count, sums[0].copy(), sums[1].copy())


def fingerprint_reference(x: torch.Tensor, num_slots: int, hidden: int,
                          acc: ChannelAccumulators | None = None,
                          compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Step digest ``[K, DIGEST_WIDTH]`` (count, sum, sumsq, absmax, nonfinite) of ``x [N, K*H]``.

    Non-finite values are counted and replaced by zero before any sum, so one NaN row does not hide
    the rest. If ``acc`` is given, the per-channel count/sum/sumsq are added to it.
    """
    if x.dim() != 2 or x.shape[1] != num_slots * hidden:
        raise ValueError(f"expected x of shape [N, {num_slots}*{hidden}], got {tuple(x.shape)}")
    n = x.shape[0]
    out = torch.zeros((num_slots, DIGEST_WIDTH), dtype=compute_dtype, device=x.device)
    if n == 0:
        return out
    v = x.reshape(n, num_slots, hidden).to(compute_dtype)
    ok = torch.isfinite(v)
    vf = torch.where(ok, v, 0.0)
    col_count = ok.sum(0)
    col_sum = vf.sum(0)
    col_sumsq = (vf * vf).sum(0)
    count = col_count.sum(1)
    out[:, 0] = count.to(compute_dtype)
    out[:, 1] = col_sum.sum(1)
    out[:, 2] = col_sumsq.sum(1)
    out[:, 3] = vf.abs().amax(dim=(0, 2))
    out[:, 4] = (n * hidden - count).to(compute_dtype)
    if acc is not None:
        acc.count += col_count.to(acc.count.dtype)
        acc.sums[0] += col_sum.to(acc.sums.dtype)
        acc.sums[1] += col_sumsq.to(acc.sums.dtype)
    return out


def fingerprint_host(x: torch.Tensor, num_slots: int, hidden: int,
                     acc: ChannelAccumulators | None = None) -> torch.Tensor:
    """The probe's CPU path: :func:`fingerprint_reference` in float64, with one shortcut.

    On the host, testing for non-finite values costs no device sync, so all-finite input (the normal
    case) takes a pass without masks: half the full-size temporaries. A non-finite value makes its
    channel's float64 sum non-finite (NaN, or Inf without an opposite Inf), which routes the step to
    the reference.
    """
    if x.device.type != "cpu":
        raise ValueError(f"fingerprint_host runs on CPU tensors, got {x.device}; use the kernel on CUDA")
    n = x.shape[0]
    if x.dim() != 2 or x.shape[1] != num_slots * hidden or n == 0:
        return fingerprint_reference(x, num_slots, hidden, acc, torch.float64)
    v = x.reshape(n, num_slots, hidden).to(torch.float64)
    col_sum = v.sum(0)
    if not bool(torch.isfinite(col_sum).all()):
        return fingerprint_reference(x, num_slots, hidden, acc, torch.float64)
    col_sumsq = (v * v).sum(0)
    out = torch.zeros((num_slots, DIGEST_WIDTH), dtype=torch.float64)
    out[:, 0] = n * hidden
    out[:, 1] = col_sum.sum(1)
    out[:, 2] = col_sumsq.sum(1)
    out[:, 3] = v.abs().amax(dim=(0, 2))
    if acc is not None:
        acc.count += n
        acc.sums[0] += col_sum
        acc.sums[1] += col_sumsq
    return out

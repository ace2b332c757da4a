"""Pure-torch CUDA versions of the few ``sgl_kernel`` ops SGLang 0.5.23 still calls on the GPU path
the testbed uses (DeepSeek-V3 MLA target + EAGLE-3 draft, Triton attention, CUDA graphs on).

Why pure torch: the ``sglang-kernel`` wheel is built for SGLang's own torch, and the GPU machines
here carry another one, so the compiled ops cannot load. Every op below is device work only — no
``.item()``, ``.tolist()``, ``nonzero``, boolean-mask indexing or ``bincount`` — so SGLang can
capture it in its CUDA graphs, and every one has a CPU test against a plain reference.
"""

from __future__ import annotations

import torch

__all__ = [
    "fused_add_rmsnorm",
    "is_arch_support_pdl",
    "moe_align_block_size",
    "moe_sum_reduce",
    "rmsnorm",
    "silu_and_mul",
    "weak_ref_tensor",
]


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


def rmsnorm(input: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, out: torch.Tensor | None = None,
            enable_pdl: bool | None = None) -> torch.Tensor:
    """RMSNorm in fp32, result in the input's dtype; ``input`` may be row-strided (never modified)."""
    y = _rms(input.float(), weight, eps).to(input.dtype)
    if out is None:
        return y
    out.copy_(y)
    return out


def fused_add_rmsnorm(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                      enable_pdl: bool | None = None) -> None:
    """In place on both: ``residual += input`` (rounded to its dtype), ``input = rmsnorm(sum)``; the
    norm is taken on the unrounded fp32 sum, as the CUDA kernel does."""
    x = input.float() + residual.float()
    residual.copy_(x.to(residual.dtype))
    input.copy_(_rms(x, weight, eps).to(input.dtype))


def silu_and_mul(input: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` for a last dimension of 2d."""
    d = input.shape[-1] // 2
    y = torch.nn.functional.silu(input[..., :d]) * input[..., d:]
    if out is None:
        return y
    out.copy_(y)
    return out


def moe_sum_reduce(input: torch.Tensor, output: torch.Tensor, routed_scaling_factor: float = 1.0) -> None:
    """Sum the top-k expert outputs ``[tokens, topk, hidden]`` into ``output`` (fp32 accumulation)."""
    output.copy_((input.float().sum(1) * routed_scaling_factor).to(output.dtype))


def weak_ref_tensor(t: object) -> object:
    """A tensor viewing ``t``'s memory without owning it (the breakable prefill graph keeps these
    instead of the real intermediates, so the graph pool can reuse them)."""
    if not isinstance(t, torch.Tensor):
        return t
    st = t.untyped_storage()
    storage = torch._C._construct_storage_from_data_pointer(st.data_ptr(), t.device, st.nbytes())
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, t.storage_offset(), t.size(),
                                                                t.stride())


def moe_align_block_size(topk_ids: torch.Tensor, num_experts: int, block_size: int,
                         sorted_token_ids: torch.Tensor, experts_ids: torch.Tensor,
                         num_tokens_post_pad: torch.Tensor, cumsum_buffer: torch.Tensor,
                         pad_sorted_token_ids: bool = False, ignore_invalid_expert: bool = False) -> None:
    """Group the flattened (token, k) slots by expert into blocks of ``block_size`` for the fused-MoE
    Triton kernel, writing SGLang's preallocated buffers in place.

    Contract (SGLang 0.5.23 calls it with ``num_experts = E + 1``): expert id ``e`` goes to bucket
    ``e + 1`` and id -1 (a filtered slot) to bucket 0; buckets are padded to ``block_size``; slots keep
    their original order inside a bucket; ``sorted_token_ids`` holds slot indices with padding
    ``numel``; ``experts_ids[b]`` is the expert of block ``b`` (bucket - 1, so -1 for bucket 0);
    ``num_tokens_post_pad[0]`` is the padded total; ``cumsum_buffer`` the bucket ends after a 0.
    """
    flat = topk_ids.reshape(-1).to(torch.int64)
    numel, dev = flat.numel(), flat.device
    bucket = (flat + 1).clamp_(0, num_experts - 1)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, bucket, torch.ones_like(bucket))
    padded = (counts + block_size - 1) // block_size * block_size
    end = torch.cumsum(padded, 0)
    start = end - padded
    total = end[-1:]
    num_tokens_post_pad[:1].copy_(total.to(num_tokens_post_pad.dtype))
    cumsum_buffer[:1].zero_()
    cumsum_buffer[1:num_experts + 1].copy_(end.to(cumsum_buffer.dtype))
    sorted_bucket, order = torch.sort(bucket, stable=True)
    rank_in_bucket = torch.arange(numel, device=dev) - (torch.cumsum(counts, 0) - counts)[sorted_bucket]
    if pad_sorted_token_ids:
        sorted_token_ids.fill_(numel)
    else:
        idx = torch.arange(sorted_token_ids.numel(), device=dev)
        sorted_token_ids.masked_fill_(idx < total, numel)
    sorted_token_ids.scatter_(0, start[sorted_bucket] + rank_in_bucket, order.to(sorted_token_ids.dtype))
    block_start = torch.arange(experts_ids.numel(), device=dev, dtype=torch.int64) * block_size
    owner = torch.searchsorted(end, block_start, right=True).clamp_(max=num_experts - 1)
    experts_ids.copy_(torch.where(block_start < total, (owner - 1).to(experts_ids.dtype), experts_ids))


def is_arch_support_pdl() -> bool:
    """Programmatic dependent launch needs sm90 or newer."""
    return torch.cuda.get_device_capability()[0] >= 9

"""Pure-torch stand-ins for sgl-kernel's CPU attention ops (``decode_attention_cpu``,
``extend_attention_cpu``), with the argument order SGLang 0.5.23's ``IntelAMXAttnBackend`` passes.

Why: SGLang's EAGLE path on CPU only runs on the ``intel_amx`` attention backend, whose kernels are
C++ ops of a CPU sgl-kernel build that is not published. These versions are slow (a Python loop over
requests) but exact, which is what a testbed needs. Both compute in float32 and write into the
caller's output buffer, as the C++ ops do.

Semantics (read from the backend's call sites and the kernel contracts):
* KV layout: ``req_to_token[req_pool_indices[b], j]`` is the KV-pool row of token j of request b.
* extend: ``seq_lens[b]`` is prefix + extend length. The prefix comes from the KV buffers, the
  extend part from ``k_extend``/``v_extend`` (or from the buffers when those are None, as for
  KV-shared layers). Within the extend part a query sees keys by causal order, or, when a
  ``tree_mask`` is given, by that mask: a flat bool ``[sum_b ext_b * ext_b]`` in row-major
  (query, key) blocks per request (the QLEN_ONLY layout of ``build_tree_kernel_efficient``).
* decode: one query per row; ``key``/``value`` (when given) are first written to the KV buffers at
  ``loc`` (the CPU decode kernel stores the new token itself), then the query attends to
  ``seq_lens[b]`` tokens, which include the new one.
* ``sliding_window`` is ``layer.sliding_window_size + 1``: 0 means no window, w > 0 means a query at
  position p sees keys at positions > p - w. ``sinks`` (per head) add exp(sink) to the softmax
  denominator. Cross-attention (``encoder_lens``) is not supported here and raises.
"""

from __future__ import annotations

import torch

__all__ = ["decode_attention", "extend_attention"]


def _expand_kv_heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[S, Hkv, D] -> [S, H, D] for grouped-query attention."""
    num_kv_heads = x.shape[1]
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"query heads {num_heads} are not a multiple of kv heads {num_kv_heads}")
    if num_kv_heads == num_heads:
        return x
    return x.repeat_interleave(num_heads // num_kv_heads, dim=1)


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor,
    sm_scale: float,
    logit_cap: float,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Masked softmax attention in float32. q [M, H, D], k [S, H, D], v [S, H, Dv],
    allowed [M, S] bool -> [M, H, Dv]."""
    scores = torch.einsum("mhd,shd->hms", q, k) * sm_scale
    if logit_cap > 0:
        scores = logit_cap * torch.tanh(scores / logit_cap)
    scores = scores.masked_fill(~allowed.unsqueeze(0), float("-inf"))
    if sinks is not None:
        sink = sinks.to(torch.float32).view(-1, 1, 1).expand(-1, scores.shape[1], 1)
        scores = torch.cat([scores, sink], dim=-1)
    probs = torch.softmax(scores, dim=-1)
    if sinks is not None:
        probs = probs[..., :-1]
    return torch.einsum("hms,shd->mhd", probs, v)


def _window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, sliding_window: int) -> torch.Tensor:
    """True where key position k is inside the window of query position q."""
    return (q_pos.view(-1, 1) - k_pos.view(1, -1)) < sliding_window


def _reject_cross_attention(is_cross_attention: bool, encoder_lens: torch.Tensor | None) -> None:
    if is_cross_attention or encoder_lens is not None:
        raise NotImplementedError(
            "the testbed's pure-torch CPU attention has no cross-attention (encoder_lens); "
            "use a decoder-only model"
        )


def _load_kv(buffer: torch.Tensor, rows: torch.Tensor, scale: float) -> torch.Tensor:
    out = buffer[rows].to(torch.float32)
    return out * scale if scale != 1.0 else out


def extend_attention(
    q_extend: torch.Tensor,
    k_extend: torch.Tensor | None,
    v_extend: torch.Tensor | None,
    o_extend: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    key_scale: float,
    value_scale: float,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_seq_lens: torch.Tensor,
    extend_start_loc: torch.Tensor,
    max_len_extend: int | None,
    sm_scale: float,
    logit_cap: float,
    is_cross_attention: bool,
    sliding_window: int,
    encoder_lens: torch.Tensor | None,
    sinks: torch.Tensor | None,
    tree_mask: torch.Tensor | None,
    is_causal: bool,
) -> None:
    """Prefix + extend attention for a batch of requests; writes ``o_extend`` [T, H, Dv]."""
    _reject_cross_attention(is_cross_attention, encoder_lens)
    num_heads = q_extend.shape[1]
    seq_lens_l = seq_lens.tolist()
    ext_lens_l = extend_seq_lens.tolist()
    starts_l = extend_start_loc.tolist()
    pools_l = req_pool_indices.tolist()
    mask_offset = 0
    for b, (seq_len, ext_len, start, pool_idx) in enumerate(
        zip(seq_lens_l, ext_lens_l, starts_l, pools_l, strict=True)
    ):
        if ext_len == 0:
            continue
        prefix_len = seq_len - ext_len
        if prefix_len < 0:
            raise ValueError(f"request {b}: extend length {ext_len} exceeds seq_len {seq_len}")
        rows = req_to_token[pool_idx, :seq_len].to(torch.int64)
        k_prefix = _load_kv(k_buffer, rows[:prefix_len], key_scale)
        v_prefix = _load_kv(v_buffer, rows[:prefix_len], value_scale)
        if k_extend is not None and v_extend is not None:
            k_new = k_extend[start : start + ext_len].to(torch.float32)
            v_new = v_extend[start : start + ext_len].to(torch.float32)
        else:
            k_new = _load_kv(k_buffer, rows[prefix_len:], key_scale)
            v_new = _load_kv(v_buffer, rows[prefix_len:], value_scale)
        keys = _expand_kv_heads(torch.cat([k_prefix, k_new]), num_heads)
        values = _expand_kv_heads(torch.cat([v_prefix, v_new]), num_heads)

        if tree_mask is not None:
            block = tree_mask[mask_offset : mask_offset + ext_len * ext_len].view(ext_len, ext_len)
            mask_offset += ext_len * ext_len
        elif is_causal:
            block = torch.ones(ext_len, ext_len, dtype=torch.bool).tril_()
        else:
            block = torch.ones(ext_len, ext_len, dtype=torch.bool)
        allowed = torch.cat([torch.ones(ext_len, prefix_len, dtype=torch.bool), block.to("cpu")], dim=1)
        if sliding_window > 0:
            q_pos = torch.arange(prefix_len, seq_len)
            allowed &= _window_mask(q_pos, torch.arange(seq_len), sliding_window)

        q = q_extend[start : start + ext_len].to(torch.float32)
        out = _attend(q, keys, values, allowed, sm_scale, logit_cap, sinks)
        o_extend[start : start + ext_len] = out.to(o_extend.dtype)


def decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    key_scale: float,
    value_scale: float,
    output: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    loc: torch.Tensor,
    attn_logits: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    logit_cap: float,
    is_cross_attention: bool,
    sliding_window: int,
    encoder_lens: torch.Tensor | None,
    sinks: torch.Tensor | None,
) -> None:
    """One query token per row; stores key/value at ``loc`` first; writes ``output`` [B, H, Dv].
    ``attn_logits`` is the C++ kernel's split-KV scratch buffer and is not needed here."""
    del attn_logits
    _reject_cross_attention(is_cross_attention, encoder_lens)
    if key is not None and value is not None:
        if k_cache.dtype.is_floating_point and k_cache.dtype.itemsize == 1:
            raise NotImplementedError("the testbed's CPU decode attention does not store FP8 KV")
        rows = loc.to(torch.int64)
        k_cache[rows] = key.to(k_cache.dtype)
        v_cache[rows] = value.to(v_cache.dtype)
    num_heads = query.shape[1]
    for b, (seq_len, pool_idx) in enumerate(zip(seq_lens.tolist(), req_pool_indices.tolist(), strict=True)):
        rows = req_to_token[pool_idx, :seq_len].to(torch.int64)
        keys = _expand_kv_heads(_load_kv(k_cache, rows, key_scale), num_heads)
        values = _expand_kv_heads(_load_kv(v_cache, rows, value_scale), num_heads)
        allowed = torch.ones(1, seq_len, dtype=torch.bool)
        if sliding_window > 0:
            allowed &= _window_mask(torch.tensor([seq_len - 1]), torch.arange(seq_len), sliding_window)
        q = query[b : b + 1].to(torch.float32)
        output[b : b + 1] = _attend(q, keys, values, allowed, sm_scale, logit_cap, sinks).to(output.dtype)

"""Pure-torch stand-ins for sgl-kernel's CPU attention ops (``decode_attention_cpu``,
``extend_attention_cpu``), with the argument order SGLang 0.5.23's ``IntelAMXAttnBackend`` passes.

Why: SGLang's EAGLE path on CPU only runs on the ``intel_amx`` attention backend, whose kernels are
C++ ops of a CPU sgl-kernel build that is not published. These versions pad the batch to its
longest sequence and run plain batched matmuls: wasteful for long prompts, exact, and small enough
to read, which is what a testbed needs. Both compute in float32 and write into the caller's output
buffer, as the C++ ops do.

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


def _attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor,
    sm_scale: float,
    logit_cap: float,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Batched masked softmax attention in float32 with grouped KV heads.

    q [B, M, H, D], k [B, S, Hkv, D], v [B, S, Hkv, Dv], allowed [B, M, S] bool -> [B, M, H, Dv].
    Query head h reads KV head h // (H / Hkv), as SGLang's kernels do. Rows with no allowed key
    (padding) come out as zeros.
    """
    batch, m, heads, dim = q.shape
    kv_heads = k.shape[2]
    if heads % kv_heads != 0:
        raise ValueError(f"query heads {heads} are not a multiple of kv heads {kv_heads}")
    group = heads // kv_heads
    qg = q.view(batch, m, kv_heads, group, dim).permute(0, 2, 3, 1, 4)  # [B, Hkv, G, M, D]
    kt = k.permute(0, 2, 3, 1).unsqueeze(2)  # [B, Hkv, 1, D, S]
    scores = torch.matmul(qg, kt) * sm_scale  # [B, Hkv, G, M, S]
    if logit_cap > 0:
        scores = logit_cap * torch.tanh(scores / logit_cap)
    scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))
    if sinks is not None:
        sink = sinks.to(torch.float32).view(1, kv_heads, group, 1, 1).expand(batch, -1, -1, m, 1)
        scores = torch.cat([scores, sink], dim=-1)
    probs = torch.softmax(scores, dim=-1)
    if sinks is not None:
        probs = probs[..., :-1]
    probs = torch.nan_to_num(probs, nan=0.0)
    out = torch.matmul(probs, v.permute(0, 2, 1, 3).unsqueeze(2))  # [B, Hkv, G, M, Dv]
    return out.permute(0, 3, 1, 2, 4).reshape(batch, m, heads, v.shape[-1])


def _reject_cross_attention(is_cross_attention: bool, encoder_lens: torch.Tensor | None) -> None:
    if is_cross_attention or encoder_lens is not None:
        raise NotImplementedError(
            "the testbed's pure-torch CPU attention has no cross-attention (encoder_lens); "
            "use a decoder-only model"
        )


def _gather_kv(buffer: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor, scale: float) -> torch.Tensor:
    """buffer rows [B, S] (only where valid) -> float32 [B, S, Hkv, D], scaled."""
    out = buffer[rows.masked_fill(~valid, 0)].to(torch.float32)
    return out * scale if scale != 1.0 else out


def _extend_block_mask(
    tree_mask: torch.Tensor | None, is_causal: bool, ext_lens: list[int], width: int
) -> torch.Tensor:
    """[B, width, width] visibility among each request's extend tokens (query, key)."""
    batch = len(ext_lens)
    if tree_mask is None:
        block = torch.ones(width, width, dtype=torch.bool)
        if is_causal:
            block = block.tril()
        return block.expand(batch, width, width)
    if all(n == width for n in ext_lens):
        return tree_mask[: batch * width * width].view(batch, width, width).to("cpu", torch.bool)
    out = torch.zeros(batch, width, width, dtype=torch.bool)
    offset = 0
    for b, n in enumerate(ext_lens):
        out[b, :n, :n] = tree_mask[offset : offset + n * n].view(n, n)
        offset += n * n
    return out


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
    seq = seq_lens.to(torch.int64)
    ext = extend_seq_lens.to(torch.int64)
    prefix = seq - ext
    if bool((prefix < 0).any()):
        raise ValueError(f"extend lengths {ext.tolist()} exceed seq_lens {seq.tolist()}")
    ext_l = ext.tolist()
    width = max(ext_l, default=0)
    if width == 0:
        return
    batch, span = len(ext_l), int(seq.max())
    pos = torch.arange(span)
    valid = pos.view(1, -1) < seq.view(-1, 1)  # [B, S]
    # One request per entry of ``seq_lens``, as SGLang's C++ kernel: under attention DP
    # ``req_pool_indices`` and the query rows are padded beyond them; the padding stays untouched.
    rows = req_to_token[req_pool_indices[:batch].to(torch.int64), :span].to(torch.int64)
    keys = _gather_kv(k_buffer, rows, valid, key_scale)
    values = _gather_kv(v_buffer, rows, valid, value_scale)

    # token t of the batch is extend position i of request b, at sequence position prefix_b + i
    tok_b = torch.repeat_interleave(torch.arange(batch), ext)
    tok_i = torch.arange(int(ext.sum())) - torch.repeat_interleave(torch.cumsum(ext, 0) - ext, ext)
    tok_src = extend_start_loc.to(torch.int64)[tok_b] + tok_i
    if k_extend is not None and v_extend is not None:
        keys[tok_b, prefix[tok_b] + tok_i] = k_extend[tok_src].to(torch.float32)
        values[tok_b, prefix[tok_b] + tok_i] = v_extend[tok_src].to(torch.float32)
    q = q_extend.new_zeros((batch, width, *q_extend.shape[1:]), dtype=torch.float32)
    q[tok_b, tok_i] = q_extend[tok_src].to(torch.float32)

    # key j is visible to query i of request b if j is in b's prefix, or j is extend key
    # j - prefix_b that the causal/tree mask lets i see
    block = _extend_block_mask(tree_mask, is_causal, ext_l, width)  # [B, W, W]
    rel = pos.view(1, 1, -1) - prefix.view(-1, 1, 1)  # [B, 1, S] key position within the extend part
    in_ext = (rel >= 0) & valid.unsqueeze(1)
    ext_visible = torch.gather(block, 2, rel.clamp(0, width - 1).expand(batch, width, span))
    allowed = (valid.unsqueeze(1) & (rel < 0)) | (in_ext & ext_visible)
    if sliding_window > 0:
        q_pos = prefix.view(-1, 1, 1) + torch.arange(width).view(1, -1, 1)
        allowed &= (q_pos - pos.view(1, 1, -1)) < sliding_window
    out = _attention(q, keys, values, allowed, sm_scale, logit_cap, sinks)
    o_extend[tok_src] = out[tok_b, tok_i].to(o_extend.dtype)


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
    """One query token per sequence of ``seq_lens``; stores key/value at ``loc`` first; writes
    ``output`` [B, H, Dv] (rows beyond the sequences untouched).
    ``attn_logits`` is the C++ kernel's split-KV scratch buffer and is not needed here."""
    del attn_logits
    _reject_cross_attention(is_cross_attention, encoder_lens)
    if key is not None and value is not None:
        if k_cache.dtype.is_floating_point and k_cache.dtype.itemsize == 1:
            raise NotImplementedError("the testbed's CPU decode attention does not store FP8 KV")
        slots = loc.to(torch.int64)
        k_cache[slots] = key.to(k_cache.dtype)
        v_cache[slots] = value.to(v_cache.dtype)
    seq = seq_lens.to(torch.int64)
    if seq.numel() == 0:
        return
    span = int(seq.max())
    pos = torch.arange(span)
    valid = pos.view(1, -1) < seq.view(-1, 1)
    rows = req_to_token[req_pool_indices[: seq.numel()].to(torch.int64), :span].to(torch.int64)
    keys = _gather_kv(k_cache, rows, valid, key_scale)
    values = _gather_kv(v_cache, rows, valid, value_scale)
    allowed = valid
    if sliding_window > 0:
        allowed = allowed & ((seq.view(-1, 1) - 1 - pos.view(1, -1)) < sliding_window)
    # One row per sequence, as SGLang's C++ kernel (``num_seqs = seq_lens.size(0)``): under attention
    # DP the draft's decode batch can hold more query rows than sequences; those rows stay as they are.
    rows_q = seq.numel()
    q = query[:rows_q].to(torch.float32).unsqueeze(1)
    out = _attention(q, keys, values, allowed.unsqueeze(1), sm_scale, logit_cap, sinks)
    output[:rows_q].copy_(out[:, 0].to(output.dtype))

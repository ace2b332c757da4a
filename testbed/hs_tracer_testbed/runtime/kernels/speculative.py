"""Pure-torch stand-ins for sgl-kernel's CPU speculative-decoding ops, with the signatures SGLang
0.5.23 calls them with (``kernels/ops/speculative/{cache_locs,eagle,spec_tree}.py`` and
``IntelAMXMultiStepDraftBackend``).

Why: these are C++ ops of the unpublished CPU sgl-kernel build; EAGLE on CPU needs every one of
them. All of them mutate their output arguments in place (like the C++ ops) except
``build_draft_decode_metadata`` which returns a new table. They run as plain Python loops over the
batch: the tensors are small (batch x draft tokens) and exactness matters more than speed here.
"""

from __future__ import annotations

import torch

__all__ = [
    "assign_draft_cache_locs_contiguous",
    "assign_extend_cache_locs",
    "assign_req_to_token_pool",
    "build_draft_decode_metadata",
    "build_tree_kernel_efficient",
    "fill_accept_out_cache_loc",
    "fill_bonus_tokens",
    "verify_tree_greedy",
]

FULL_MASK = 0
QLEN_ONLY = 1


def verify_tree_greedy(
    predicts: torch.Tensor,
    accept_index: torch.Tensor,
    accept_token_num: torch.Tensor,
    candidates: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    target_predict: torch.Tensor,
) -> None:
    """Walk each request's draft tree from the root, following the child whose draft token equals
    the target's argmax at the last accepted node; stop at the first level with no match.

    predicts [bs*ndt] int32 (out: target token at every accepted node, incl. the bonus position),
    accept_index [bs, steps] int32 (out: flat indices of accepted nodes; caller pre-fills -1),
    accept_token_num [bs] int32 (out: accepted drafts, bonus excluded). Trees are given by
    retrive_index (flat index of node), retrive_next_token (first child) and retrive_next_sibling,
    all [bs, ndt] with -1 for none; candidates and target_predict [bs, ndt].
    """
    batch_size = candidates.shape[0]
    num_spec_step = accept_index.shape[1]
    flat_target = target_predict.reshape(-1).tolist()
    cand = candidates.tolist()
    r_index = retrive_index.tolist()
    r_next = retrive_next_token.tolist()
    r_sib = retrive_next_sibling.tolist()
    for b in range(batch_size):
        last = r_index[b][0]
        accept_index[b, 0] = last
        num_correct = 0
        cur = 0
        for _ in range(1, num_spec_step):
            cur = r_next[b][cur]
            target_tok = flat_target[last]
            while cur != -1 and cand[b][cur] != target_tok:
                cur = r_sib[b][cur]
            if cur == -1:
                break
            predicts[last] = target_tok
            num_correct += 1
            last = r_index[b][cur]
            accept_index[b, num_correct] = last
        accept_token_num[b] = num_correct
        predicts[last] = flat_target[last]


def _node_of(selected: list[int], token_idx: int) -> int:
    """Position in ``selected`` (one request's selected_index row) holding ``token_idx``, or -1."""
    try:
        return selected.index(token_idx)
    except ValueError:
        return -1


def build_tree_kernel_efficient(
    parent_list: torch.Tensor,
    selected_index: torch.Tensor,
    verified_seq_len: torch.Tensor,
    tree_mask: torch.Tensor,
    positions: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    topk: int,
    depth: int,
    draft_token_num: int,
    tree_mask_mode: int,
) -> None:
    """Turn the draft's (parent_list, selected_index) into the verify tree.

    Node 0 of each request is the bonus (root) token; node i > 0 is the draft token with
    ``selected_index[b, i-1]`` (an index into the flattened per-step top-k candidates, sorted).
    A candidate's parent is ``parent_list[b, selected_index // topk]`` (0 = the root). Writes:
    positions (seq_len + depth of node), retrive_index (flat node index), retrive_next_token /
    retrive_next_sibling (first child / next sibling, caller pre-fills -1; children end up in
    increasing node order), and the tree mask (each node sees the root, its ancestors and
    itself): QLEN_ONLY = [bs, ndt, ndt] flat; FULL_MASK = per request ndt rows of (seq_len + ndt)
    columns, of which only the last ndt are written (the caller pre-fills the prefix with True).
    """
    if tree_mask_mode not in (FULL_MASK, QLEN_ONLY):
        raise NotImplementedError(
            f"build_tree_kernel_efficient: tree_mask_mode {int(tree_mask_mode)} is not supported on CPU "
            "(only FULL_MASK=0 and QLEN_ONLY=1)"
        )
    bs = verified_seq_len.shape[0]
    ndt = draft_token_num
    parents = parent_list.tolist()
    selected_rows = selected_index.tolist()
    seq_lens = verified_seq_len.tolist()
    next_token = retrive_next_token.view(bs, ndt)
    next_sibling = retrive_next_sibling.view(bs, ndt)
    r_index = retrive_index.view(bs, ndt)
    full_offset = 0
    for b in range(bs):
        selected = selected_rows[b]
        seq_len = seq_lens[b]
        off = b * ndt

        # Parent of node i (> 0) as a node position (0 = root), or -1 for a malformed tree.
        parent_node = [0] * ndt
        for i in range(1, ndt):
            parent_tb = selected[i - 1] // topk
            if parent_tb > 0:
                found = _node_of(selected, parents[b][parent_tb])
                parent_node[i] = -1 if found < 0 else found + 1

        r_index[b] = torch.arange(off, off + ndt, dtype=r_index.dtype)
        for i in range(ndt - 1, 0, -1):
            p = parent_node[i]
            if p < 0:
                continue
            first = int(next_token[b, p])
            next_token[b, p] = i
            if first != -1:
                next_sibling[b, i] = first

        if tree_mask_mode == QLEN_ONLY:
            row_len, col0 = ndt, 0
            base = b * ndt * ndt
        else:
            row_len, col0 = seq_len + ndt, seq_len
            base = full_offset
            full_offset += ndt * (seq_len + ndt)
        positions[off] = seq_len
        for tid in range(ndt):
            row = base + tid * row_len + col0
            tree_mask[row : row + ndt] = False
            tree_mask[row] = True
            node, level = tid, 0
            while node > 0 and level < depth:
                tree_mask[row + node] = True
                level += 1
                node = parent_node[node]
            if tid > 0:
                positions[off + tid] = seq_len + level


def build_draft_decode_metadata(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    topk: int,
    num_steps: int,
    pool_len: int,
) -> torch.Tensor:
    """Expanded req->token table for the multi-step draft decode: row b*topk+k holds request b's
    committed prefix followed by branch k's draft slots (laid out at seq_len + k*num_steps).
    Returns [num_seqs*topk, pool_len] int32; only the first seq_len + num_steps entries are set."""
    num_seqs = req_pool_indices.shape[0]
    out = torch.zeros((num_seqs * topk, pool_len), dtype=req_to_token.dtype, device=req_to_token.device)
    for b, (pool_idx, seq_len) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist(), strict=True)):
        src = req_to_token[pool_idx]
        for k in range(topk):
            dst = out[b * topk + k]
            dst[:seq_len] = src[:seq_len]
            start = seq_len + k * num_steps
            dst[seq_len : seq_len + num_steps] = src[start : start + num_steps]
    return out


def fill_bonus_tokens(
    accept_tokens: torch.Tensor, accept_lens: torch.Tensor, bonus_tokens: torch.Tensor, accept_stride: int
) -> None:
    """bonus_tokens[b] = the last accepted token of request b (accept_lens include the bonus)."""
    flat = accept_tokens.reshape(-1)
    rows = torch.arange(accept_lens.shape[0], dtype=torch.int64)
    idx = rows * accept_stride + accept_lens.to(torch.int64) - 1
    bonus_tokens.copy_(flat[idx].to(bonus_tokens.dtype))


def fill_accept_out_cache_loc(
    accept_index: torch.Tensor, out_cache_loc: torch.Tensor, accept_out_cache_loc: torch.Tensor
) -> None:
    """Compact the KV slots of accepted nodes: out_cache_loc at every accept_index != -1, in order,
    into the front of accept_out_cache_loc (the tail is left untouched)."""
    flat = accept_index.reshape(-1).to(torch.int64)
    src = flat[flat > -1]
    if src.numel() and int(src.max()) >= out_cache_loc.numel():
        raise IndexError(f"fill_accept_out_cache_loc: accept_index {int(src.max())} out of range")
    accept_out_cache_loc[: src.numel()] = out_cache_loc[src]


def assign_draft_cache_locs_contiguous(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
    topk: int,
    num_steps: int,
) -> None:
    """out_cache_loc[b*topk*num_steps : ...] = the topk*num_steps KV slots that follow request b's
    committed tokens in req_to_token (the draft steps' write targets)."""
    del pool_len
    width = topk * num_steps
    for b, (pool_idx, seq_len) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist(), strict=True)):
        out_cache_loc[b * width : (b + 1) * width] = req_to_token[pool_idx, seq_len : seq_len + width]


def assign_extend_cache_locs(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Concatenate req_to_token[req_b, start_b:end_b] over the batch into the front of
    out_cache_loc (which may be larger than needed)."""
    del pool_len
    pos = 0
    for pool_idx, start, end in zip(
        req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist(), strict=True
    ):
        n = end - start
        if pos + n > out_cache_loc.numel():
            raise IndexError(
                f"assign_extend_cache_locs: out_cache_loc has {out_cache_loc.numel()} entries, "
                f"offsets need more than {pos + n}"
            )
        out_cache_loc[pos : pos + n] = req_to_token[pool_idx, start:end]
        pos += n


def assign_req_to_token_pool(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Inverse of :func:`assign_extend_cache_locs`: scatter consecutive chunks of out_cache_loc
    (freshly allocated KV slots) into req_to_token[req_b, start_b:end_b]."""
    del pool_len
    pos = 0
    for pool_idx, start, end in zip(
        req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist(), strict=True
    ):
        n = end - start
        if pos + n > out_cache_loc.numel():
            raise IndexError(
                f"assign_req_to_token_pool: out_cache_loc has {out_cache_loc.numel()} entries, "
                f"offsets need more than {pos + n}"
            )
        req_to_token[pool_idx, start:end] = out_cache_loc[pos : pos + n].to(req_to_token.dtype)
        pos += n

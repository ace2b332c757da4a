"""The testbed's pure-torch sgl-kernel CPU ops, called through ``torch.ops.sgl_kernel`` exactly as
SGLang 0.5.23 calls them, checked against hand-worked examples, an independent attention
reference (``scaled_dot_product_attention``) and SGLang's own Triton versions of the tree kernels
(run in Triton's CPU interpreter in a subprocess)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from hs_tracer_testbed.runtime.kernels import AMX_PROBE_OP, OP_NAMES, op

QLEN_ONLY, FULL_MASK = 1, 0


def test_ops_are_registered_without_the_amx_probe() -> None:
    for name in OP_NAMES:
        assert op(name) is getattr(torch.ops.sgl_kernel, name)
    # SGLang's cpu_has_amx_support() probes this op; it must stay absent so that ordinary layers
    # keep their forward_native paths.
    assert not hasattr(torch.ops.sgl_kernel, AMX_PROBE_OP)


# ---------------------------------------------------------------- attention


def _pool(num_slots: int, heads: int, dim: int, seed: int) -> torch.Tensor:
    return torch.randn(num_slots, heads, dim, generator=torch.Generator().manual_seed(seed))


def _reference(q, keys, values, mask, scale, logit_cap=0.0):
    """q [M,H,D], keys/values [S,Hkv,*] (logical order), mask [M,S] bool -> [M,H,Dv]."""
    rep = q.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(rep, 1).transpose(0, 1)
    v = values.repeat_interleave(rep, 1).transpose(0, 1)
    if logit_cap:
        s = torch.einsum("hmd,hsd->hms", q.transpose(0, 1), k) * scale
        s = (logit_cap * torch.tanh(s / logit_cap)).masked_fill(~mask, float("-inf"))
        return torch.einsum("hms,hsd->mhd", torch.softmax(s, -1), v)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask, scale=scale)
    return out.transpose(0, 1)


@pytest.mark.parametrize("logit_cap", [0.0, 5.0])
def test_extend_attention_matches_reference_with_prefix_gqa_and_scattered_slots(logit_cap: float) -> None:
    heads, kv_heads, dim, dim_v = 4, 2, 8, 6
    prefix, extend = [3, 0, 5], [2, 4, 1]
    pool = 64
    k_buf, v_buf = _pool(pool, kv_heads, dim, 1), _pool(pool, kv_heads, dim_v, 2)
    req_to_token = torch.zeros(4, 32, dtype=torch.int32)
    perm = torch.randperm(pool, generator=torch.Generator().manual_seed(3))
    pools = [2, 0, 3]
    used = 0
    for b, p in enumerate(pools):
        n = prefix[b] + extend[b]
        req_to_token[p, :n] = perm[used : used + n].to(torch.int32)
        used += n
    total = sum(extend)
    q = torch.randn(total, heads, dim)
    k_ext = torch.randn(total, kv_heads, dim)
    v_ext = torch.randn(total, kv_heads, dim_v)
    o = torch.zeros(total, heads, dim_v)
    starts = torch.tensor([0, 2, 6])
    seq_lens = torch.tensor([p + e for p, e in zip(prefix, extend, strict=True)])
    op("extend_attention_cpu")(
        q, k_ext, v_ext, o, k_buf, v_buf, 1.0, 1.0, req_to_token, torch.tensor(pools), seq_lens,
        torch.tensor(extend, dtype=torch.int32), starts.to(torch.int32), max(extend), 0.5, logit_cap,
        False, 0, None, None, None, True,
    )  # fmt: skip
    for b, p in enumerate(pools):
        rows = req_to_token[p, : prefix[b]].long()
        s = int(starts[b])
        keys = torch.cat([k_buf[rows], k_ext[s : s + extend[b]]])
        values = torch.cat([v_buf[rows], v_ext[s : s + extend[b]]])
        mask = torch.ones(extend[b], prefix[b] + extend[b], dtype=torch.bool).tril(prefix[b])
        want = _reference(q[s : s + extend[b]], keys, values, mask, 0.5, logit_cap)
        torch.testing.assert_close(o[s : s + extend[b]], want, rtol=1e-5, atol=1e-5)


def test_extend_attention_tree_mask_and_kv_from_buffers() -> None:
    """Verify-style call: a QLEN_ONLY tree mask per request, extend K/V read from the pool."""
    heads, dim, ndt = 2, 8, 4
    prefix = [2, 3]
    k_buf, v_buf = _pool(32, heads, dim, 4), _pool(32, heads, dim, 5)
    req_to_token = torch.arange(2 * 16, dtype=torch.int32).view(2, 16).flip(1).contiguous()
    # request 0: root -> {1, 2}, 1 -> 3; request 1: a chain written as an explicit mask
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    chain = torch.ones(ndt, ndt, dtype=torch.bool).tril()
    q = torch.randn(2 * ndt, heads, dim)
    o = torch.zeros(2 * ndt, heads, dim)
    op("extend_attention_cpu")(
        q, None, None, o, k_buf, v_buf, 1.0, 1.0, req_to_token, torch.tensor([0, 1]),
        torch.tensor([prefix[0] + ndt, prefix[1] + ndt]), torch.tensor([ndt, ndt]), torch.tensor([0, ndt]),
        ndt, 0.3, 0.0, False, 0, None, None, torch.cat([tree.flatten(), chain.flatten()]), True,
    )  # fmt: skip
    for b, block in enumerate([tree, chain]):
        rows = req_to_token[b, : prefix[b] + ndt].long()
        mask = torch.cat([torch.ones(ndt, prefix[b], dtype=torch.bool), block], 1)
        want = _reference(q[b * ndt : (b + 1) * ndt], k_buf[rows], v_buf[rows], mask, 0.3)
        torch.testing.assert_close(o[b * ndt : (b + 1) * ndt], want, rtol=1e-5, atol=1e-5)
    # the tree mask changes the answer: node 2 must not see node 1
    chain_o = torch.zeros_like(o)
    op("extend_attention_cpu")(
        q, None, None, chain_o, k_buf, v_buf, 1.0, 1.0, req_to_token, torch.tensor([0, 1]),
        torch.tensor([prefix[0] + ndt, prefix[1] + ndt]), torch.tensor([ndt, ndt]), torch.tensor([0, ndt]),
        ndt, 0.3, 0.0, False, 0, None, None, None, True,
    )  # fmt: skip
    assert not torch.allclose(chain_o[2], o[2])
    torch.testing.assert_close(chain_o[ndt:], o[ndt:])


def test_extend_attention_sliding_window() -> None:
    heads, dim, n = 1, 4, 6
    k_buf, v_buf = _pool(8, heads, dim, 6), _pool(8, heads, dim, 7)
    req_to_token = torch.arange(8, dtype=torch.int32).view(1, 8)
    q = torch.randn(n, heads, dim)
    o = torch.zeros(n, heads, dim)
    window = 2  # layer.sliding_window_size = 1: each query sees itself and one token back
    op("extend_attention_cpu")(
        q, k_buf[:n], v_buf[:n], o, k_buf, v_buf, 1.0, 1.0, req_to_token, torch.tensor([0]),
        torch.tensor([n]), torch.tensor([n]), torch.tensor([0]), n, 1.0, 0.0, False, window, None, None,
        None, True,
    )  # fmt: skip
    pos = torch.arange(n)
    mask = (pos.view(-1, 1) >= pos.view(1, -1)) & (pos.view(-1, 1) - pos.view(1, -1) < window)
    torch.testing.assert_close(o, _reference(q, k_buf[:n], v_buf[:n], mask, 1.0), rtol=1e-5, atol=1e-5)


def test_decode_attention_stores_new_token_then_attends_mla_layout() -> None:
    """MLA layout: the value buffer is a view of the first dims of the key buffer, one KV head."""
    heads, dim, dim_v = 4, 12, 8
    kv = _pool(40, 1, dim, 8)
    k_cache, v_cache = kv, kv[..., :dim_v]
    seq_lens = [5, 3]
    req_to_token = torch.zeros(3, 16, dtype=torch.int32)
    req_to_token[2, :5] = torch.tensor([9, 1, 30, 7, 12], dtype=torch.int32)
    req_to_token[0, :3] = torch.tensor([4, 22, 15], dtype=torch.int32)
    loc = torch.tensor([12, 15])  # the last slot of each request
    new_k = torch.randn(2, 1, dim)
    q = torch.randn(2, heads, dim)
    o = torch.zeros(2, heads, dim_v)
    attn_logits = torch.zeros(2, heads, 8, dim_v + 1)
    op("decode_attention_cpu")(
        q, k_cache, v_cache, 1.0, 1.0, o, new_k, new_k[..., :dim_v], loc, attn_logits, req_to_token,
        torch.tensor([2, 0]), torch.tensor(seq_lens), 0.25, 0.0, False, 0, None, None,
    )  # fmt: skip
    torch.testing.assert_close(kv[loc], new_k)
    for b, p in enumerate([2, 0]):
        rows = req_to_token[p, : seq_lens[b]].long()
        mask = torch.ones(1, seq_lens[b], dtype=torch.bool)
        want = _reference(q[b : b + 1], kv[rows], kv[rows][..., :dim_v], mask, 0.25)
        torch.testing.assert_close(o[b : b + 1], want, rtol=1e-5, atol=1e-5)


def test_decode_attention_sinks_add_to_the_denominator() -> None:
    heads, dim = 2, 4
    k, v = _pool(4, heads, dim, 9), _pool(4, heads, dim, 10)
    req_to_token = torch.arange(4, dtype=torch.int32).view(1, 4)
    q = torch.randn(1, heads, dim)
    sinks = torch.tensor([0.5, -1.0])
    o = torch.zeros(1, heads, dim)
    op("decode_attention_cpu")(
        q, k, v, 1.0, 1.0, o, None, None, torch.tensor([3]), torch.zeros(1), req_to_token,
        torch.tensor([0]), torch.tensor([4]), 1.0, 0.0, False, 0, None, sinks,
    )  # fmt: skip
    scores = torch.einsum("hd,shd->hs", q[0], k)
    weights = torch.exp(scores) / (torch.exp(scores).sum(-1, keepdim=True) + torch.exp(sinks).view(-1, 1))
    torch.testing.assert_close(o[0], torch.einsum("hs,shd->hd", weights, v), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- tree kernels (hand-worked)

# topk=2, depth=3, 5 verify tokens, verified seq_len 7. Flattened draft candidates: step 0 -> 0,1
# (children of the root); step 1 -> 2..5 (2,3 children of frontier f0, 4,5 of f1); step 2 -> 6..9.
# parent_list = [root, step-1 frontier (cand 0, 1), step-2 frontier (cand 2, 4)].
# selected [0, 1, 2, 6]: node1=cand0 (root child), node2=cand1 (root child),
# node3=cand2 (child of cand0 = node1), node4=cand6 (child of cand2 = node3).
TREE = {
    "parent_list": [[-1, 0, 1, 2, 4]],
    "selected": [[0, 1, 2, 6]],
    "positions": [7, 8, 8, 9, 10],
    "next_token": [1, 3, -1, 4, -1],
    "next_sibling": [-1, 2, -1, -1, -1],
    "mask": [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 1, 0, 1, 1]],
}


def _build(mode: int, seq_len: int = 7):
    ndt = 5
    if mode == QLEN_ONLY:
        mask = torch.ones(ndt * ndt, dtype=torch.bool)
    else:
        mask = torch.ones(ndt * (seq_len + ndt), dtype=torch.bool)
    positions = torch.empty(ndt, dtype=torch.int64)
    retrieve = torch.full((3, 1, ndt), -1, dtype=torch.int64)
    op("build_tree_kernel_efficient_cpu")(
        torch.tensor(TREE["parent_list"]), torch.tensor(TREE["selected"]), torch.tensor([seq_len]),
        mask, positions, retrieve[0], retrieve[1], retrieve[2], 2, 3, ndt, mode,
    )  # fmt: skip
    return mask, positions, retrieve


def test_build_tree_qlen_only_hand_worked() -> None:
    mask, positions, retrieve = _build(QLEN_ONLY)
    assert positions.tolist() == TREE["positions"]
    assert retrieve[0, 0].tolist() == [0, 1, 2, 3, 4]
    assert retrieve[1, 0].tolist() == TREE["next_token"]
    assert retrieve[2, 0].tolist() == TREE["next_sibling"]
    assert mask.view(5, 5).int().tolist() == TREE["mask"]


def test_build_tree_full_mask_keeps_prefix_columns() -> None:
    mask, positions, _ = _build(FULL_MASK)
    rows = mask.view(5, 7 + 5)
    assert rows[:, :7].all(), "prefix columns are the caller's pre-fill and must stay True"
    assert rows[:, 7:].int().tolist() == TREE["mask"]
    assert positions.tolist() == TREE["positions"]


def test_build_tree_rejects_bitpacked_mask() -> None:
    with pytest.raises(NotImplementedError, match="tree_mask_mode 2"):
        _build(2)


def _verify(target: list[int]):
    candidates = torch.tensor([[10, 11, 12, 13, 14]])
    _, _, retrieve = _build(QLEN_ONLY)
    predicts = torch.zeros(5, dtype=torch.int32)
    accept_index = torch.full((1, 4), -1, dtype=torch.int32)
    accept_num = torch.empty(1, dtype=torch.int32)
    op("verify_tree_greedy_cpu")(
        predicts=predicts, accept_index=accept_index, accept_token_num=accept_num, candidates=candidates,
        retrive_index=retrieve[0], retrive_next_token=retrieve[1], retrive_next_sibling=retrieve[2],
        target_predict=torch.tensor([target]),
    )  # fmt: skip
    return predicts.tolist(), accept_index[0].tolist(), int(accept_num[0])


def test_verify_tree_greedy_follows_the_matching_path_to_the_leaf() -> None:
    predicts, accept_index, accepted = _verify([11, 13, 0, 14, 50])
    assert accept_index == [0, 1, 3, 4] and accepted == 3
    assert predicts == [11, 13, 0, 14, 50]  # node 4's target token is the bonus


def test_verify_tree_greedy_tries_siblings_and_stops_at_first_mismatch() -> None:
    predicts, accept_index, accepted = _verify([12, 77, 99, 0, 0])
    assert accept_index == [0, 2, -1, -1] and accepted == 1
    assert predicts == [12, 0, 99, 0, 0]


def test_verify_tree_greedy_rejects_everything() -> None:
    predicts, accept_index, accepted = _verify([5, 0, 0, 0, 0])
    assert accept_index == [0, -1, -1, -1] and accepted == 0
    assert predicts == [5, 0, 0, 0, 0]


# ---------------------------------------------------------------- cache-location and bonus ops


def test_cache_location_ops() -> None:
    req_to_token = torch.arange(3 * 20, dtype=torch.int32).view(3, 20) + 100
    pools, seq_lens = torch.tensor([2, 0]), torch.tensor([4, 7])

    out = torch.empty(2 * 2 * 3, dtype=torch.int64)  # topk 2, num_steps 3
    op("assign_draft_cache_locs_contiguous_cpu")(pools, req_to_token, seq_lens, out, 20, 2, 3)
    assert out.tolist() == list(range(144, 150)) + list(range(107, 113))

    out = torch.full((8,), -7, dtype=torch.int64)
    op("assign_extend_cache_locs_cpu")(pools, req_to_token, seq_lens, seq_lens + 3, out, 20)
    assert out.tolist() == [144, 145, 146, 107, 108, 109, -7, -7]

    table = req_to_token.clone()
    op("assign_req_to_token_pool_cpu")(pools, table, seq_lens, seq_lens + 2, torch.tensor([1, 2, 3, 4]), 20)
    assert table[2, 4:6].tolist() == [1, 2] and table[0, 7:9].tolist() == [3, 4]
    table[2, 4:6], table[0, 7:9] = req_to_token[2, 4:6], req_to_token[0, 7:9]
    assert torch.equal(table, req_to_token)


def test_build_draft_decode_metadata_expands_branches() -> None:
    req_to_token = torch.arange(2 * 12, dtype=torch.int32).view(2, 12)
    out = op("build_draft_decode_metadata_cpu")(req_to_token, torch.tensor([1]), torch.tensor([3]), 2, 2, 12)
    assert out.shape == (2, 12) and out.dtype == torch.int32
    # branch k's draft slots start at seq_len + k * num_steps in the request's row
    assert out[0, :5].tolist() == [12, 13, 14, 15, 16]
    assert out[1, :5].tolist() == [12, 13, 14, 17, 18]


def test_fill_bonus_tokens_and_accept_out_cache_loc() -> None:
    accept_tokens = torch.tensor([[5, 6, 7], [8, 9, 10]], dtype=torch.int32)
    bonus = torch.empty(2, dtype=torch.int32)
    op("fill_bonus_tokens_cpu")(accept_tokens, torch.tensor([2, 3], dtype=torch.int32), bonus, 3)
    assert bonus.tolist() == [6, 10]

    accept_index = torch.tensor([[0, 2, -1], [3, -1, -1]], dtype=torch.int32)
    out_cache_loc = torch.tensor([40, 41, 42, 43, 44, 45])
    packed = torch.full((6,), -1, dtype=torch.int64)
    op("fill_accept_out_cache_loc_cpu")(accept_index, out_cache_loc, packed)
    assert packed.tolist() == [40, 42, 43, -1, -1, -1]


def test_copy_all_layer_kv_cache_moves_rows_in_every_buffer() -> None:
    k = torch.arange(6 * 4, dtype=torch.float32).view(6, 4)
    v = torch.arange(6 * 2, dtype=torch.bfloat16).view(6, 2)
    before_k, before_v = k.clone(), v.clone()
    ptrs = torch.tensor([k.data_ptr(), v.data_ptr()], dtype=torch.uint64)
    strides = torch.tensor([k.stride(0) * 4, v.stride(0) * 2])
    # rows 0 <-> 1 swap (overlapping sources and targets) and row 5 -> 3
    op("copy_all_layer_kv_cache_cpu")(ptrs, strides, torch.tensor([1, 0, 3]), torch.tensor([0, 1, 5]))
    for buf, old in ((k, before_k), (v, before_v)):
        assert torch.equal(buf[[1, 0, 3]], old[[0, 1, 5]])
        assert torch.equal(buf[[2, 4, 5]], old[[2, 4, 5]])


# ---------------------------------------------------------------- against SGLang's Triton kernels

TRITON_CHECK = """
    import json, random, torch
    from sglang.kernels.ops.speculative.spec_tree import (
        TreeMaskMode, sgl_build_tree_kernel_triton, verify_tree_greedy_triton)
    from sglang.srt.speculative.eagle_utils import organize_draft_results
    from hs_tracer_testbed.runtime.kernels import op

    def draft(bs, topk, steps, ndt, g):
        # The draft's bookkeeping as spec_utils.select_top_k_tokens builds it: per step, the scores
        # of all expanded candidates, and the flat indices of the frontier expanded next.
        scores, tokens = [], []
        parents = [torch.arange(-1, topk).expand(bs, -1)]
        for step in range(steps):
            width = topk if step == 0 else topk * topk
            scores.append(torch.rand(bs, 1 if step == 0 else topk, topk, generator=g))
            tokens.append(torch.randint(0, 50, (bs, width), generator=g))
            if step > 0:
                pick = torch.stack([torch.randperm(width, generator=g)[:topk] for _ in range(bs)])
                parents.append(pick + topk + (step - 1) * topk * topk)
        return organize_draft_results(scores, tokens, parents, ndt)

    g = torch.Generator().manual_seed(0)
    mismatches, accepted = [], []
    for case in range(40):
        bs, topk, steps = 1 + case % 3, 1 + case % 4, 1 + case % 5
        ndt = min(topk * steps, topk + (steps - 1) * topk * topk) + 1 if topk > 1 else steps + 1
        parent_list, selected, cand = draft(bs, topk, steps, ndt, g)
        seq = torch.randint(3, 9, (bs,), generator=g)
        outs = []
        for impl in ("triton", "testbed"):
            mask = torch.ones(bs * ndt * ndt, dtype=torch.bool)
            pos = torch.empty(bs * ndt, dtype=torch.long)
            ret = torch.full((3, bs, ndt), -1, dtype=torch.long)
            args = (parent_list, selected, seq, mask, pos, ret[0], ret[1], ret[2], topk, steps, ndt)
            if impl == "triton":
                sgl_build_tree_kernel_triton(*args, TreeMaskMode.QLEN_ONLY)
            else:
                op("build_tree_kernel_efficient_cpu")(*args, 1)
            cg = torch.Generator().manual_seed(case)
            candidates = torch.cat([torch.randint(0, 50, (bs, 1), generator=cg), cand], 1)
            # A target that follows the tree: at each node it predicts the token of a random child
            # (a first child or a later sibling), except at ~30% of nodes where it predicts 99.
            target = torch.full_like(candidates, 99)
            for b in range(bs):
                for node in range(ndt):
                    children, child = [], int(ret[1, b, node])
                    while child != -1:
                        children.append(child)
                        child = int(ret[2, b, child])
                    if children and torch.rand(1, generator=cg).item() > 0.3:
                        pick = children[int(torch.randint(len(children), (1,), generator=cg))]
                        target[b, node] = candidates[b, pick]
            pred = torch.zeros(bs * ndt, dtype=torch.int32)
            acc = torch.full((bs, steps + 1), -1, dtype=torch.int32)
            num = torch.empty(bs, dtype=torch.int32)
            vargs = (pred, acc, num, candidates, ret[0], ret[1], ret[2], target)
            if impl == "triton":
                verify_tree_greedy_triton(*vargs)
            else:
                op("verify_tree_greedy_cpu")(*vargs)
            outs.append([t.tolist() for t in (mask, pos, ret, pred, acc, num)])
        accepted.extend(outs[1][5])
        if outs[0] != outs[1]:
            mismatches.append({"case": case, "triton": outs[0], "testbed": outs[1]})
    print("RESULT " + json.dumps({"cases": 40, "accepted": accepted, "mismatches": mismatches[:3]}))
"""


def test_tree_kernels_match_sglang_triton_kernels() -> None:
    """Random draft trees (built with SGLang's own organize_draft_results) through SGLang's Triton
    build-tree and greedy-verify kernels in the interpreter, and through the testbed ops."""
    env = {k: v for k, v in os.environ.items() if k not in ("SGLANG_USE_CPU_ENGINE", "PYTHONPATH")}
    env["TRITON_INTERPRET"] = "1"
    script = textwrap.dedent(TRITON_CHECK)
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    result = json.loads(line[len("RESULT ") :])
    assert result["cases"] == 40
    assert max(result["accepted"]) >= 3, "the cases must include deep accepted paths"
    assert result["mismatches"] == []

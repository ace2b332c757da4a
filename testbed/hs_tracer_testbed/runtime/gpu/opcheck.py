"""Check every stand-in op on the GPU: against a reference, inside a captured CUDA graph, and under
``torch.cuda.set_sync_debug_mode("error")`` (SGLang captures these ops in its graphs, so they must
not synchronise). Prints one JSON line; run with the GPU runtime's environment
(``launcher.runtime_env()``) so SGLang's references import on CUDA::

    python -m hs_tracer_testbed.runtime.gpu.opcheck

References: SGLang's own ``forward_native`` (RMSNorm, SiluAndMul), SGLang's Triton twins
(``moe_align_small_numel``, ``moe_sum_reduce_triton``), and plain torch where SGLang has none.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

import torch

from hs_tracer_testbed.runtime.gpu import ops


def _graph_replay(fn: Callable[[], Any]) -> None:
    """Capture ``fn`` in a CUDA graph (after a warm-up on a side stream, as SGLang does) and replay it."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()


def _no_sync(fn: Callable[[], Any]) -> None:
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def check_rmsnorm() -> dict[str, Any]:
    from sglang.srt.layers.layernorm import RMSNorm

    norm = RMSNorm(7168, eps=1e-6).cuda().to(torch.bfloat16)
    norm.weight.data.normal_()
    latent = torch.randn(64, 7168 + 64, device="cuda", dtype=torch.bfloat16)
    x = latent[:, :7168]
    want = norm.forward_native(x)
    out = torch.empty_like(want)
    _no_sync(lambda: ops.rmsnorm(x, norm.weight, 1e-6, out=out))
    eager = torch.equal(out, want)
    out.zero_()
    _graph_replay(lambda: ops.rmsnorm(x, norm.weight, 1e-6, out=out))
    return {"equal": eager, "graph_equal": torch.equal(out, want)}


def check_fused_add_rmsnorm() -> dict[str, Any]:
    from sglang.srt.layers.layernorm import RMSNorm

    norm = RMSNorm(7168, eps=1e-6).cuda().to(torch.bfloat16)
    norm.weight.data.normal_()
    x0 = torch.randn(64, 7168, device="cuda", dtype=torch.bfloat16)
    r0 = torch.randn_like(x0)
    want_x, want_r = norm.forward_native(x0.clone(), r0.clone())
    x, r = x0.clone(), r0.clone()
    _no_sync(lambda: ops.fused_add_rmsnorm(x, r, norm.weight, 1e-6))
    eager = torch.equal(x, want_x) and torch.equal(r, want_r)
    x, r = x0.clone(), r0.clone()

    def step() -> None:  # in place on both: restore the inputs inside the graph, then apply
        x.copy_(x0)
        r.copy_(r0)
        ops.fused_add_rmsnorm(x, r, norm.weight, 1e-6)

    _graph_replay(step)
    return {"equal": eager, "graph_equal": torch.equal(x, want_x) and torch.equal(r, want_r)}


def check_silu_and_mul() -> dict[str, Any]:
    from sglang.srt.layers.activation import SiluAndMul

    x = torch.randn(64, 2 * 1000, device="cuda", dtype=torch.bfloat16)
    want = SiluAndMul().forward_native(x)
    out = torch.empty_like(want)
    _no_sync(lambda: ops.silu_and_mul(x, out))
    eager = torch.equal(out, want)
    out.zero_()
    _graph_replay(lambda: ops.silu_and_mul(x, out))
    return {"equal": eager, "graph_equal": torch.equal(out, want)}


def check_moe_sum_reduce() -> dict[str, Any]:
    from sglang.kernels.ops.moe.fused_moe_triton_kernels import moe_sum_reduce_triton

    x = torch.randn(128, 8, 7168, device="cuda", dtype=torch.bfloat16)
    want = torch.empty(128, 7168, device="cuda", dtype=torch.bfloat16)
    moe_sum_reduce_triton(x, want, 2.5)
    out = torch.empty_like(want)
    _no_sync(lambda: ops.moe_sum_reduce(x, out, 2.5))
    diff = (out.float() - want.float()).abs().max().item()
    out.zero_()
    _graph_replay(lambda: ops.moe_sum_reduce(x, out, 2.5))
    graph_diff = (out.float() - want.float()).abs().max().item()
    # fp32 sums in another order: equal up to one bf16 rounding step of the result
    tol = 2 ** -7 * want.float().abs().max().item()
    return {"max_abs_diff_vs_triton": diff, "graph_max_abs_diff": graph_diff, "tolerance": tol,
            "equal": diff <= tol, "graph_equal": graph_diff <= tol}


def _align_buffers(numel: int, buckets: int, block: int) -> tuple[torch.Tensor, ...]:
    cap = numel * block if numel < buckets else numel + buckets * (block - 1)
    cap = (cap + 3) // 4 * 4
    return (torch.empty(cap, dtype=torch.int32, device="cuda"),
            torch.empty(-(-cap // block), dtype=torch.int32, device="cuda"),
            torch.empty(1, dtype=torch.int32, device="cuda"),
            torch.empty(buckets + 1, dtype=torch.int32, device="cuda"))


def check_moe_align_block_size() -> dict[str, Any]:
    from sglang.kernels.ops.moe.moe_align_small_numel import moe_align_small_numel

    gen = torch.Generator(device="cuda").manual_seed(0)
    cases, bad = 0, []
    for tokens, experts, topk, block in ((1, 256, 8, 16), (4, 256, 8, 64), (8, 32, 8, 16), (2, 64, 4, 32)):
        scores = torch.rand(tokens, experts, device="cuda", generator=gen)
        topk_ids = scores.topk(topk, dim=-1).indices.to(torch.int32)
        buckets = experts + 1
        ref = _align_buffers(topk_ids.numel(), buckets, block)
        moe_align_small_numel(topk_ids, buckets, block, ref[0], ref[1], ref[2])
        got = _align_buffers(topk_ids.numel(), buckets, block)
        _no_sync(lambda t=topk_ids, g=got, b=buckets, k=block: ops.moe_align_block_size(
            t, b, k, g[0], g[1], g[2], g[3], True))
        total = int(ref[2][0])
        same = (int(got[2][0]) == total and torch.equal(got[0][:total], ref[0][:total])
                and torch.equal(got[1][: total // block], ref[1][: total // block]))
        graphed = _align_buffers(topk_ids.numel(), buckets, block)
        _graph_replay(lambda t=topk_ids, g=graphed, b=buckets, k=block: ops.moe_align_block_size(
            t, b, k, g[0], g[1], g[2], g[3], True))
        same_graph = int(graphed[2][0]) == total and torch.equal(graphed[0][:total], ref[0][:total])
        cases += 1
        if not (same and same_graph):
            bad.append([tokens, experts, topk, block])
    return {"cases": cases, "mismatches": bad, "equal": not bad, "graph_equal": not bad}


def check_weak_ref_tensor() -> dict[str, Any]:
    t = torch.randn(8, 16, device="cuda")[:, 2:10]
    w = ops.weak_ref_tensor(t)
    same = (w.data_ptr(), tuple(w.shape), w.stride()) == (t.data_ptr(), tuple(t.shape), t.stride())
    t.add_(1.0)
    return {"equal": same and torch.equal(w, t)}


CHECKS: dict[str, Callable[[], dict[str, Any]]] = {
    "rmsnorm": check_rmsnorm,
    "fused_add_rmsnorm": check_fused_add_rmsnorm,
    "silu_and_mul": check_silu_and_mul,
    "moe_sum_reduce": check_moe_sum_reduce,
    "moe_align_block_size": check_moe_align_block_size,
    "weak_ref_tensor": check_weak_ref_tensor,
}


def main() -> int:
    torch.manual_seed(0)
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "is_arch_support_pdl":
                               ops.is_arch_support_pdl()}
    for name, check in CHECKS.items():
        try:
            results[name] = check()
        except Exception as exc:  # one failing check must not hide the others
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(results))
    return 0 if all(isinstance(v, dict) and v.get("equal") for k, v in results.items()
                    if k in CHECKS) else 1


if __name__ == "__main__":
    sys.exit(main())

"""SGLang 0.5.23's deterministic extend kernel on the testbed target's shapes, on a CUDA GPU: run it
under ``compute-sanitizer`` to see whether it stays inside its memory.

``--enable-deterministic-inference`` sends every prefill, target verify and draft extend through
``extend_attention_fwd_unified``. For the tiny testbed target's absorbed MLA (Q·K over 40 = 32 latent
+ 8 rope dims, P·V over the 32 latent dims) its Triton kernel read past its shared memory on the
H200, which a serving engine reports as "an illegal memory access". The GPU runtime's patch
(``patches.even_unified_extend_tiles``) gives such shapes a V tile as wide as the Q·K tile. This
script launches the kernel once per case, as patched (the GPU runtime's environment applies it) or
with ``--unpatched`` as SGLang ships it, and compares the output with a float64 reference::

    compute-sanitizer --tool memcheck python benchmarks/gpu_extend_unified_check.py CASE [--unpatched]

(run it with ``launcher.runtime_env()``). Prints one JSON line: the case, whether every output element
was written, and the relative error against the reference.
"""

from __future__ import annotations

import argparse
import json

import torch

# (Lq, Lv, heads): the testbed target's absorbed MLA, the draft's Llama attention, an equal-tile
# control, DeepSeek-V3's MLA
CASES = {"testbed_mla": (40, 32, 4), "draft_llama": (16, 16, 4), "equal_32": (32, 32, 4),
         "deepseek_v3_mla": (576, 512, 4)}
EXTEND = (5, 17, 3)  # new tokens per request
PREFIX = (7, 0, 30)  # cached prefix tokens per request


def reference(q: torch.Tensor, kv: torch.Tensor, lv: int, rows: list[torch.Tensor], prefix: int,
              scale: float) -> torch.Tensor:
    """Causal attention of one request's new tokens over its prefix and themselves, in float64."""
    k = kv[torch.cat(rows)][:, 0].double()  # [S, Lq]
    s = (q.double() @ k.T) * scale  # [T, H, S]
    t = q.shape[0]
    mask = torch.arange(k.shape[0])[None, :] <= (prefix + torch.arange(t))[:, None]
    s = s.masked_fill(~mask.to(s.device)[:, None, :], float("-inf"))
    return torch.softmax(s, dim=-1) @ k[:, :lv]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("case", choices=sorted(CASES))
    ap.add_argument("--unpatched", action="store_true", help="the kernel as SGLang 0.5.23 ships it")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    args = ap.parse_args()
    from sglang.kernels.ops.attention import extend_attention as ea

    run = ea.extend_attention_fwd_unified
    if args.unpatched:
        run = getattr(run, "__wrapped__", run)
    lq, lv, heads = CASES[args.case]
    dtype = getattr(torch, args.dtype)
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)
    slots = 4096
    kv = torch.randn(slots, 1, lq, device=dev, dtype=dtype, generator=gen)
    total = sum(EXTEND)
    q = torch.randn(total, heads, lq, device=dev, dtype=dtype, generator=gen)
    o = torch.full((total, heads, lv), float("nan"), device=dev, dtype=dtype)
    perm = torch.randperm(slots - 1, device=dev, generator=gen)[: sum(PREFIX) + total] + 1
    prefix_rows = list(torch.split(perm[: sum(PREFIX)], list(PREFIX)))
    extend_rows = list(torch.split(perm[sum(PREFIX):], list(EXTEND)))
    i32 = {"device": dev, "dtype": torch.int32}
    qo_indptr = torch.tensor([0, *torch.tensor(EXTEND).cumsum(0).tolist()], **i32)
    prefix_indptr = torch.tensor([0, *torch.tensor(PREFIX).cumsum(0).tolist()], **i32)
    kv_indptr, kv_indices, prefix_lens = ea.build_unified_kv_indices(
        prefix_indptr, perm[: sum(PREFIX)].long(), qo_indptr[:-1].clone(), torch.tensor(EXTEND, **i32),
        perm[sum(PREFIX):].long(), len(EXTEND))
    scale = lq ** -0.5
    run(q, o, kv, kv[..., :lv], 1.0, 1.0, qo_indptr, kv_indptr, kv_indices, prefix_lens.to(torch.int32),
        max(EXTEND), sm_scale=scale)
    torch.cuda.synchronize()
    per_request = zip(torch.split(q, list(EXTEND)), prefix_rows, extend_rows, strict=True)
    ref = torch.cat([reference(qq, kv, lv, [p, e], len(p), scale) for qq, p, e in per_request])
    err = float((o.double() - ref).norm() / ref.norm())
    print(json.dumps({"case": args.case, "lq": lq, "lv": lv, "dtype": args.dtype,
                      "patched": not args.unpatched, "rel_err_vs_float64": err,
                      "all_written": bool(torch.isfinite(o).all())}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

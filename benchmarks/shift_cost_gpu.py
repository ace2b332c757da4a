"""What a train/serve layer shift costs the real pair's draft, in real SGLang on a GPU, with intervals.

Method: SmolLM2-135M-Instruct and its EAGLE-3 draft (the real-model testbed pair), served by SGLang
0.5.23 on one CUDA GPU (``--enable-deterministic-inference``, CUDA graphs, greedy chain: 3 steps,
topk 1), one engine per wiring, all started at once: plain decoding, the draft as trained, and each
shift of ``hs_tracer_testbed.miswire.layer_shifts`` (a copy of the draft whose ``config.json`` ids were
edited; a swap also permutes the ``fc`` column blocks). Every engine answers the same held-out chat
prompts of the training domain (``smollm.prompts``), each to its end-of-turn token or
``--max-new-tokens``. Accept length = 1 + SGLang's accepted drafts / verify steps, pooled over
prompts, with a 95 % bootstrap interval over prompts; each shift's change against the trained wiring
is paired by prompt (same prompts, same resampling). Lossless: each output equals plain decoding's.
The draft as trained also answers prompts of other text domains (``--domains``): what acceptance does
when the live text is not the training domain's, with nothing miswired.

The prompts are made where the recipe's Python runs (the standard library's texts are the prompts)
and passed as JSON, so the GPU machine may run another Python::

    python benchmarks/shift_cost_gpu.py --write-prompts prompts.json          # here
    python benchmarks/shift_cost_gpu.py --prompts-file prompts.json --target T --draft D \\
        --out benchmarks/results/shift_cost_smollm2_h100.json                 # on the GPU machine
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT, ROOT / "testbed", ROOT / "benchmarks"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

HELDOUT = "instruct_heldout"
OTHER_DOMAINS = ("docs_heldout", "code", "prose", "chat")


def write_prompts(path: Path, n: int, n_other: int) -> None:
    from hs_tracer_testbed import smollm

    prompts = {HELDOUT: smollm.prompts(n), **{d: smollm.prompts(n_other, domain=d) for d in OTHER_DOMAINS}}
    path.write_text(json.dumps(prompts) + "\n")


def bootstrap(rows: list[tuple[int, int]], base: list[tuple[int, int]] | None = None, rounds: int = 2000,
              seed: int = 0) -> tuple[float, float]:  # fmt: skip
    """95 % interval over prompts of 1 + correct/verify (rows: per prompt (correct, verify)); with
    ``base``, of the difference to ``base``'s accept length on the same resampled prompts."""
    rng = random.Random(seed)
    n = len(rows)

    def accept(rs: list[tuple[int, int]], pick: list[int]) -> float:
        v = sum(rs[i][1] for i in pick)
        return 1 + sum(rs[i][0] for i in pick) / v if v else 1.0

    vals = []
    for _ in range(rounds):
        pick = [rng.randrange(n) for _ in range(n)]
        vals.append(accept(rows, pick) - (accept(base, pick) if base is not None else 0.0))
    vals.sort()
    return round(vals[int(0.025 * rounds)], 4), round(vals[int(0.975 * rounds) - 1], 4)


def per_prompt(outs: list[dict[str, Any]]) -> list[tuple[int, int]]:
    metas = [o["meta_info"] for o in outs]
    return [(int(m.get("spec_num_correct_drafts") or 0), int(m.get("spec_verify_ct") or 0)) for m in metas]


def summary(rows: list[tuple[int, int]]) -> dict[str, Any]:
    verify = sum(v for _, v in rows)
    return {"mean_accept_length": round(1 + sum(c for c, _ in rows) / verify, 4) if verify else None,
            "interval_95": list(bootstrap(rows)), "verify_steps": verify}


def _same(a: list[list[int]], b: list[list[int]]) -> int:
    return sum(x == y for x, y in zip(a, b, strict=False))


def run(args: argparse.Namespace) -> dict[str, Any]:
    import gpu_sglang as G

    from hs_tracer_testbed.miswire import layer_shifts, write_ids_variant

    prompts = json.loads(args.prompts_file.read_text())
    cfg = json.loads((args.draft / "config.json").read_text())
    trained = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    num_layers = json.loads((args.target / "config.json").read_text())["num_hidden_layers"]
    shifts = layer_shifts(trained, num_layers)
    common = ("--enable-deterministic-inference", "--mem-fraction-static", "0.85",
              "--max-total-tokens", "32768", "--cuda-graph-max-bs-decode", "32",
              "--cuda-graph-max-bs-prefill", "512", "--max-running-requests", "32", "--random-seed", "0")
    work = Path(tempfile.mkdtemp(prefix="shift-cost-"))
    servers = [G.Server("plain", args.target, common)]
    for name, v in shifts.items():
        draft = write_ids_variant(args.draft, work / name, v["ids"], v["slot_order"])
        chain = (*common, *G.CHAIN, "--speculative-draft-model-path", str(draft))
        servers.append(G.Server(name, args.target, chain))
    started = time.time()
    G.start_all(servers, args.log_dir, work)
    sampling = {"temperature": 0.0, "max_new_tokens": args.max_new_tokens}
    outs: dict[str, dict[str, list[dict[str, Any]]]] = {}
    try:
        for s in servers:
            if s.error is not None:
                continue
            domains = [HELDOUT, *OTHER_DOMAINS] if s.name in ("plain", "correct") else [HELDOUT]
            outs[s.name] = {d: G.generate(s, {"prompt": prompts[d], "sampling_params": sampling}, 600)
                            for d in domains}
            print(f"[{s.name}] done", flush=True)
    finally:
        G.stop_all(servers)
    plain = {d: [o["output_ids"] for o in v] for d, v in outs.get("plain", {}).items()}
    base = per_prompt(outs["correct"][HELDOUT]) if "correct" in outs else None
    rows = []
    for name, v in shifts.items():
        if name not in outs:
            rows.append({"shift": name, "error": next(s.error for s in servers if s.name == name)})
            continue
        r = per_prompt(outs[name][HELDOUT])
        ids = [o["output_ids"] for o in outs[name][HELDOUT]]
        rows.append({"shift": name, "config_ids": v["ids"], "fc_slot_order": v["slot_order"],
                     "fed_blocks": v["fed"], **summary(r),
                     "change_vs_correct_interval_95": list(bootstrap(r, base)) if base else None,
                     "lossless_prompts": _same(ids, plain.get(HELDOUT, [])), "prompts": len(ids)})
        print(f"{name:28s} {rows[-1]['mean_accept_length']} {rows[-1]['interval_95']}", flush=True)
    domains = {d: {**summary(per_prompt(o)), "prompts": len(o),
                   "lossless_prompts": _same([x["output_ids"] for x in o], plain.get(d, []))}
               for d, o in outs.get("correct", {}).items()}
    return {"rows": rows, "domains_correct_wiring": domains, "wall_s": round(time.time() - started, 1),
            "engines": {s.name: {"startup_s": s.startup_s, "error": s.error} for s in servers}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--write-prompts", type=Path, help="write the prompts JSON here and exit")
    p.add_argument("--prompts", type=int, default=102, help="held-out chat prompts (all 102 by default)")
    p.add_argument("--other-prompts", type=int, default=24, help="prompts of each other domain")
    p.add_argument("--prompts-file", type=Path)
    p.add_argument("--target", type=Path)
    p.add_argument("--draft", type=Path)
    p.add_argument("--max-new-tokens", type=int, default=160)
    p.add_argument("--out", type=Path)
    p.add_argument("--log-dir", type=Path, default=Path(tempfile.gettempdir()))
    args = p.parse_args(argv)
    if args.write_prompts:
        write_prompts(args.write_prompts, args.prompts, args.other_prompts)
        return 0
    if not (args.prompts_file and args.target and args.draft and args.out):
        p.error("--prompts-file, --target, --draft and --out are needed to measure")
    import gpu_sglang as G
    from provenance import source_state

    result = run(args)
    draft_info = args.draft.parent / "trained.json"  # beside the draft where train_draft_dir wrote it
    out = {"benchmark": "shift_cost_gpu", "source": source_state(ROOT), "environment": G.environment(),
           "card": G.card(), "date": time.strftime("%Y-%m-%d"),
           "draft": json.loads(draft_info.read_text())["draft"] if draft_info.exists() else None,
           "method": (f"SGLang {G.SGLANG_VERSION} on one GPU, deterministic inference, greedy chain EAGLE-3 "
                      "(3 steps, topk 1), one engine per wiring; held-out chat prompts of the training "
                      f"domain, each to its end-of-turn token or {args.max_new_tokens} new tokens; accept "
                      "length = 1 + accepted drafts / verify steps pooled over prompts, 95 % bootstrap "
                      "intervals over prompts (changes paired by prompt)"),
           **result}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What a train/serve layer shift costs: accept length of the real-model pair in the real engine.

Method: SmolLM2-135M-Instruct and its EAGLE-3 draft (the real-model testbed pair), served by SGLang
0.5.23 on CPU (the testbed runtime), greedy chain speculative decoding (3 steps, topk 1), one batch of
held-out real-text prompts per engine, ignoring EOS. Each shift is a copy of the trained draft whose
``config.json`` layer ids were edited (``hs_tracer_testbed.miswire.layer_shifts``; a swap also
permutes the draft's ``fc`` column blocks, since SGLang feeds ascending layers whatever the list
order). Accept length = 1 + SGLang's accepted drafts / verify steps over all requests; every output
is also compared with plain decoding (greedy EAGLE-3 is lossless however it is wired).

    python benchmarks/shift_cost.py --out benchmarks/results/shift_cost_smollm2_cpu.json

Runs untraced (the tracer changes neither tokens nor counters); one engine per shift plus one plain.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--only", action="append", help="measure only these shifts (repeatable)")
    args = p.parse_args(argv)

    sys.path.insert(0, str(REPO))
    from benchmarks.provenance import header
    from hs_tracer_testbed import smollm
    from hs_tracer_testbed.miswire import layer_shifts, write_ids_variant
    from hs_tracer_testbed.runtime.runs import EngineConfig, run_configs

    pair = smollm.ensure_pair()
    manifest = pair.load_manifest()
    plan = manifest["layers"]
    prompts = smollm.prompts(args.prompts)
    shifts = layer_shifts(plan["draft_config_ids"], plan["num_hidden_layers"])
    names = args.only or list(shifts)
    chain = EngineConfig("chain3", 3, 1)
    started = time.time()
    (plain,) = run_configs(pair.target, None, prompts, [EngineConfig("plain")], args.max_new_tokens)
    rows = []
    with tempfile.TemporaryDirectory(prefix="shift-cost-") as tmp:
        for name in names:
            v = shifts[name]
            draft = write_ids_variant(pair.draft, Path(tmp) / name, v["ids"], v["slot_order"])
            (res,) = run_configs(pair.target, draft, prompts, [chain], args.max_new_tokens)
            rows.append({
                "shift": name, "config_ids": v["ids"], "fc_slot_order": v["slot_order"],
                "fed_blocks": v["fed"],
                "expects_blocks": v["ids"] if v["slot_order"] is not None else plan["draft_config_ids"],
                "mean_accept_length": round(res.mean_accept_length or 0.0, 4),
                "verify_steps": sum(res.verify_steps),
                "correct_drafts_histogram": res.correct_drafts_histogram,
                "lossless": res.output_ids == plain.output_ids,
            })
            print(f"{name:32s} ids {v['ids']} accept length {rows[-1]['mean_accept_length']:.3f} "
                  f"lossless {rows[-1]['lossless']}", file=sys.stderr, flush=True)
    base = next((r["mean_accept_length"] for r in rows if r["shift"] == "correct"), None)
    for r in rows:
        if base:
            r["accepted_drafts_vs_correct"] = round((r["mean_accept_length"] - 1) / (base - 1), 4)
    out = {
        "benchmark": "shift_cost",
        **header(REPO),
        "pair": {"recipe_hash": manifest["recipe_hash"], "trained_sources": plan["aux_sources"],
                 "draft_train_log_tail": manifest["draft"]["train_log_tail"]},
        "method": (f"SGLang 0.5.23 on CPU (testbed runtime), greedy chain EAGLE-3, 3 steps, topk 1, "
                   f"{len(prompts)} held-out prompts (hs_tracer_testbed.smollm.prompts), "
                   f"{args.max_new_tokens} new tokens each ignoring EOS, one engine per shift; accept "
                   "length = 1 + accepted drafts / verify steps (SGLang's counters) over all requests; "
                   "accepted_drafts_vs_correct = (accept length - 1) relative to the trained wiring's"),
        "wall_s": round(time.time() - started, 1),
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

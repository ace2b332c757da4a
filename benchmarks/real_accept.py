"""Accept length of the real pair's draft in the real engine, on held-out prompts of its training domain.

Method: SmolLM2-135M-Instruct and its EAGLE-3 draft (``smollm.ensure_pair()``: the committed draft,
trained on the target's own responses to chat prompts), served by SGLang on CPU (the testbed runtime),
greedy chain speculative decoding (3 steps, topk 1), the first ``--prompts`` of the held-out chat
prompts (``smollm.prompts``: subjects the draft never saw, the same prompts every run) in one batch,
each answered until its end-of-turn token or ``--max-new-tokens``. Accept length = 1 + SGLang's
accepted drafts / verify steps over all requests, with a bootstrap interval over prompts; every output
is compared with plain decoding (greedy EAGLE-3 is lossless). Beside it: the accept length the
draft's last training accuracies predict (``smollm.expected_accept_length``).

    python benchmarks/real_accept.py --out benchmarks/results/real_accept_smollm2_cpu.json

``--pair DIR`` measures another built pair (a ``smollm2-pair-<hash>`` directory that ``ensure_pair``
made for another recipe, e.g. a longer-trained draft) with the same method and prompts.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def bootstrap(correct: list[int], steps: list[int], rounds: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95 % interval of 1 + sum(correct) / sum(steps), resampling prompts."""
    rng = random.Random(seed)
    n = len(steps)
    vals = []
    for _ in range(rounds):
        pick = [rng.randrange(n) for _ in range(n)]
        s = sum(steps[i] for i in pick)
        vals.append(1 + sum(correct[i] for i in pick) / s if s else 1.0)
    vals.sort()
    return vals[int(0.025 * rounds)], vals[int(0.975 * rounds) - 1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--prompts", type=int, default=24)
    p.add_argument("--max-new-tokens", type=int, default=160)
    p.add_argument("--pair", type=Path, help="a built pair directory (default: the default recipe's pair)")
    args = p.parse_args(argv)

    sys.path.insert(0, str(REPO))
    from benchmarks.provenance import header
    from hs_tracer_testbed import smollm
    from hs_tracer_testbed.runtime.runs import EngineConfig, run_configs

    if args.pair is None:
        pair = smollm.ensure_pair()
    else:
        pair = smollm.PairPaths.under(args.pair, smollm.ensure_target())
    manifest = pair.load_manifest()
    if manifest["target"]["recipe_hash"] != smollm.TargetRecipe().digest():
        p.error(f"{args.pair} was built on another target than the default one")
    prompts = smollm.prompts(args.prompts)
    started = time.time()
    configs = [EngineConfig("plain"), EngineConfig("chain3", 3, 1)]
    plain, chain = run_configs(pair.target, pair.draft, prompts, configs, args.max_new_tokens,
                               ignore_eos=False)
    low, high = bootstrap(chain.correct_drafts, chain.verify_steps)
    per_prompt = [round(1 + c / s, 3) if s else None
                  for c, s in zip(chain.correct_drafts, chain.verify_steps, strict=True)]
    out = {
        "benchmark": "real_accept",
        **header(REPO),
        "pair": {"recipe_hash": manifest["recipe_hash"], "weights": manifest.get("weights"),
                 "draft_train_log_tail": manifest["draft"]["train_log_tail"],
                 "expected_accept_length": manifest["draft"].get("expected_accept_length")},
        "method": (f"SGLang on CPU (testbed runtime), greedy chain EAGLE-3, 3 steps, topk 1, the first "
                   f"{len(prompts)} held-out chat prompts (hs_tracer_testbed.smollm.prompts), each "
                   f"answered to its end-of-turn token or {args.max_new_tokens} new tokens; accept length = "
                   "1 + accepted drafts / verify steps (SGLang's counters) over all requests, 95 % "
                   "bootstrap interval over prompts; lossless = every output equal to plain decoding's"),
        "mean_accept_length": round(chain.mean_accept_length or 0.0, 4),
        "interval_95": [round(low, 4), round(high, 4)],
        "verify_steps": sum(chain.verify_steps),
        "output_tokens": sum(map(len, chain.output_ids)),
        "correct_drafts_histogram": chain.correct_drafts_histogram,
        "per_prompt_accept_length": per_prompt,
        "lossless": chain.output_ids == plain.output_ids,
        "generate_s": {"plain": round(plain.generate_s, 1), "chain3": round(chain.generate_s, 1)},
        "wall_s": round(time.time() - started, 1),
    }
    print(f"accept length {out['mean_accept_length']:.3f} [{low:.3f}, {high:.3f}] over {len(prompts)} "
          f"prompts, lossless {out['lossless']}", file=sys.stderr)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

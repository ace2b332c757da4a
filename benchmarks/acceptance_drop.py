"""Calibrate ``acceptance_drop``: false alarms on healthy runs, detection latency on broken ones.

Method: the CPU testbed's target and draft in plain torch (hs_tracer_testbed.accept.simulate, the
greedy chain SGLang runs, num_steps 3) generate per-request accept lengths for held-out prompts under
each scenario. A live window draws whole requests at random (as a live window mixes requests) until
it holds ``n`` verify steps, cut to ``n``; the rule of hs_tracer.diagnosis.acceptance judges it
against the expectation measured by `profile build` (and without one). Reported per window size: the
fraction of windows judged a collapse.

    python benchmarks/acceptance_drop.py --out benchmarks/results/acceptance_drop.json

The per-request accept lengths are kept in the results (``--runs`` re-judges them without
regenerating, e.g. after a threshold change).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import numpy as np
from provenance import source_state

SIZES = (16, 32, 64, 96, 128, 192, 256)  # below min_steps (64): the statistic alone, min_steps lowered


def per_request(target, draft, prompts, c_out_ids, new_tokens, eos) -> list[list[int]]:
    from hs_tracer_testbed.accept import simulate

    return [simulate(target, draft, [p], c_out_ids, 3, new_tokens, eos).accept_lengths for p in prompts]


def windows(requests: list[list[int]], n: int, reps: int, rng: np.random.Generator):
    from hs_tracer.diagnosis.live import acceptance_of

    for _ in range(reps):
        steps: list[int] = []
        for i in rng.permutation(len(requests)):
            steps += requests[i]
            if len(steps) >= n:
                break
        if len(steps) < n:
            raise ValueError(f"the requests hold {len(steps)} steps, a window needs {n}")
        a = np.asarray(steps[:n])
        acc = acceptance_of(a)
        # the engine drafts 3 tokens: pad the per-position rates to 3 like the live tally does
        rates = list(acc.per_position_rate) + [0.0] * (3 - len(acc.per_position_rate))
        yield type(acc)(acc.steps, acc.mean_accept_length, rates[:3])


def generate(args):
    import torch

    from hs_tracer.draft.model import Eagle3Draft
    from hs_tracer.profile import expectation
    from hs_tracer_testbed import ensure_testbed
    from hs_tracer_testbed.corpus import prompts as corpus_prompts
    from hs_tracer_testbed.miswire import regenerated_d2t
    from hs_tracer_testbed.target import encode, load_target
    from hs_tracer_testbed.tokenizer import EOS_ID

    tb = ensure_testbed()
    t0 = time.time()
    exp = expectation.measure(tb.draft, tb.target, [tb.specforge_data])
    target = load_target(tb.target)
    draft = Eagle3Draft.from_pretrained(tb.draft, target_dir=tb.target).eval()
    # healthy requests accept ~3 tokens a step, so they need twice the prompts for as many steps
    held = encode(corpus_prompts(seed=77, n=2 * args.prompts, domain="train"), add_eos=False)
    held2 = encode(corpus_prompts(seed=78, n=2 * args.prompts, domain="train"), add_eos=False)
    other = encode(corpus_prompts(seed=77, n=args.prompts, domain="other"), add_eos=False)
    good_d2t = draft.d2t.clone()
    n = args.new_tokens
    runs: dict[str, list[list[int]]] = {}
    with torch.no_grad():
        runs["healthy_heldout"] = per_request(target, draft, held, [1, 3, 4], n, EOS_ID)
        runs["healthy_heldout_2"] = per_request(target, draft, held2, [1, 3, 4], n, EOS_ID)
        runs["other_domain"] = per_request(target, draft, other, [1, 3, 4], n, EOS_ID)
        few = held[: args.prompts]
        # the testbed's ids one lower, [0, 2, 3]: no longer starting at 1, so SGLang's DeepSeek rule
        # adds nothing and captures the embedding and blocks 2 and 3 (C_out -1, 1, 2)
        runs["ids_shifted"] = per_request(target, draft, few, [-1, 1, 2], n, EOS_ID)
        draft.d2t.copy_(torch.as_tensor(regenerated_d2t(tb)))
        runs["d2t_regenerated"] = per_request(target, draft, few, [1, 3, 4], n, EOS_ID)
        draft.d2t.zero_()
        runs["d2t_missing"] = per_request(target, draft, few, [1, 3, 4], n, EOS_ID)
        draft.d2t.copy_(good_d2t)
    return runs, exp, time.time() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--runs", type=Path, help="results file whose accept lengths to re-judge")
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args()

    from dataclasses import replace

    import torch

    from hs_tracer.diagnosis.acceptance import AcceptanceThresholds, acceptance_findings, bound
    from hs_tracer.profile import expectation

    torch.set_num_threads(1)
    if args.runs is not None:
        prev = json.loads(args.runs.read_text())
        runs, exp = prev["accept_lengths"], expectation.ExpectedAcceptance.from_json(prev["expectation"])
        gen_s = prev["generate_s"]
    else:
        runs, exp, gen_s = generate(args)
    th = AcceptanceThresholds()
    rng = np.random.default_rng(0)
    results: dict[str, dict] = {}
    for name, reqs in runs.items():
        flat = [a for r in reqs for a in r]
        row = {"requests": len(reqs), "steps": len(flat),
               "mean_accept_length": round(float(np.mean(flat)), 4),
               "with_expectation": {}, "without_expectation": {}, "min_upper_over_limit": {}}
        for n in SIZES:
            if n > len(flat):
                continue
            th_n = replace(th, min_steps=min(n, th.min_steps))
            ws = list(windows(reqs, n, args.reps, rng))
            for key, e in (("with_expectation", exp), ("without_expectation", None)):
                hits = sum(bool(acceptance_findings(w, e, th=th_n)) for w in ws)
                row[key][n] = round(hits / args.reps, 4)
            # how close the windows come to the limit (> 1: not a collapse; healthy runs' margin)
            row["min_upper_over_limit"][n] = round(min(bound(w, exp, th).upper / bound(w, exp, th).limit
                                                       for w in ws), 3)
        results[name] = row
    out = {
        "what": "fraction of live windows of n verify steps judged acceptance_drop (critical); sizes below "
                "min_steps are judged with min_steps lowered to n (what the statistic alone needs)",
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "machine": f"{platform.machine()} {platform.system()}, CPU only, torch threads 1",
        "method": __doc__.split("\n\n")[1].replace("\n", " "),
        "thresholds": dict(th.__dict__),
        "expectation": exp.to_json(),
        "reps_per_cell": args.reps,
        "prompts_per_scenario": args.prompts,
        "new_tokens": args.new_tokens,
        "generate_s": round(gen_s, 1),
        "scenarios": results,
        "accept_lengths": runs,
    }
    out["source"] = source_state(Path(__file__).resolve().parents[1])  # the commit measured
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    keys = ("mean_accept_length", "with_expectation", "without_expectation")
    print(json.dumps({k: {kk: v[kk] for kk in keys}
                      for k, v in results.items()}, indent=1))


if __name__ == "__main__":
    main()

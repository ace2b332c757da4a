"""Calibration and false-alarm rate of replay's verdict rule (hs_tracer.replay.rule) on the testbed.

What is measured: the testbed draft's next-token top-1 agreement (hs_tracer.replay.runner) on its
SpecForge training dump (the first 20000 tokens, as ``hs-tracer replay`` reads it), and on live-like
captures: held-out prompts (``corpus.prompts``, other seeds than training) run through the testbed
target, bf16-rounded, each prompt's rows plus the target's greedy next token as tail (what an
hs_tracer capture holds for a prefill). Each prompt is fed to the draft wired correctly and as each
miswiring of the catalogue (``hs_tracer_testbed.miswire.fed_sources``; ``single_state`` has another
width, which replay refuses, so it is left out). A capture of n tokens is a window of whole prompts
drawn at random (seeded) until it holds n scored tokens; ``windows`` windows per size, the same
windows for every wiring.

Calibration (pool ``calibration``, train domain, prompt seed 101): ``allowance`` = the relative
agreement the correct wiring loses on all of that pool against the training data, rounded up to
0.01; ``z`` = the largest (allowed level - agreement) / spread(n) over the correct wiring's windows of
256 tokens or more (``rule.MIN_TOKENS``; smaller windows are measured, not calibrated for), rounded up
to 0.25, at least 3. Then, with those constants, on pools the calibration never
saw (``heldout``: train domain, seed 202; ``other_domain``: the corpus's other domain, seed 303):
false alarms = correct-wiring windows below training level; detection = miswired windows below it.
For comparison, ``below_bare_fraction``: the same windows under the bare rule replay used before
(training level = 0.9 x the training agreement, whatever the capture's size).

Deterministic: seeded corpus, seeded windows, single-threaded torch.
Run from the repository root:  .venv/bin/python benchmarks/replay_rule.py
"""

from __future__ import annotations

import argparse
import json
import math
import platform
from datetime import date
from pathlib import Path

import numpy as np
import torch
from provenance import source_state

from hs_tracer.draft.model import Eagle3Draft
from hs_tracer.replay import data as D
from hs_tracer.replay import rule
from hs_tracer.replay.runner import agreement
from hs_tracer_testbed import corpus, dumps, ensure_testbed
from hs_tracer_testbed.miswire import fed_sources
from hs_tracer_testbed.target import encode, load_target

RESULTS = Path(__file__).resolve().parent / "results" / "replay_rule.json"
SIZES = (128, 256, 512, 1024, 2048)
POOLS = {"calibration": ("train", 101), "heldout": ("train", 202), "other_domain": ("other", 303)}
TRAINING_TOKENS = 20000
BARE_FRACTION = 0.9  # what hs-tracer replay reads of --training-data by default


def live_pool(target, names: list[str], domain: str, seed: int, prompts: int,
              wirings: dict[str, list[str]]) -> dict[str, list[tuple[int, int]]]:
    """Per wiring, (correct, total) per prompt."""
    seqs: dict[str, list[D.Sequence]] = {w: [] for w in wirings}
    for ids in encode(corpus.prompts(seed, prompts, domain), add_eos=False):
        st = dumps.layer_states(target, torch.tensor(ids))
        layers = torch.cat([st.layers, st.final_norm[None]]).to(torch.bfloat16).float()  # [S, T, H]
        tail = int(st.logits[-1].argmax())
        for w, srcs in wirings.items():
            feats = torch.cat([layers[names.index(s)] for s in srcs], dim=-1)
            seqs[w].append(D.Sequence(feats, torch.tensor(ids), tail=tail))
    return {w: s for w, s in seqs.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=600, help="prompts per pool")
    ap.add_argument("--windows", type=int, default=400, help="windows per size")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--raw", type=Path, help="also write every (correct, total) per sequence here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    tb = ensure_testbed()
    draft = Eagle3Draft.from_pretrained(tb.draft, target_dir=tb.target).eval()
    target = load_target(tb.target)
    n = len(target.model.layers)
    names = ["embedding", *(f"block:{j}" for j in range(n)), "final_norm"]
    trained = tb.load_manifest()["layers"]["aux_sources"]
    wirings = {k: v for k, v in fed_sources(trained).items() if len(v) == len(trained)}
    k, h = len(trained), draft.config.target_hidden_size or draft.config.hidden_size
    train = agreement(draft, D.load_training(tb.specforge_data, k, h, TRAINING_TOKENS), tuple(range(k)))
    ident = tuple(range(k))
    pools = {}
    for pool, (domain, seed) in POOLS.items():
        seqs = live_pool(target, names, domain, seed, args.prompts, wirings)
        pools[pool] = {w: agreement(draft, s, ident).by_sequence for w, s in seqs.items()}

    if args.raw:
        args.raw.write_text(json.dumps({"training": train.by_sequence, "pools": pools}))
    p_train = train.rate
    spreads = {s: rule.spread(train.by_sequence, s) for s in SIZES}
    cal = np.asarray(pools["calibration"]["correct"])
    cal_rate = cal[:, 0].sum() / cal[:, 1].sum()
    allowance = max(0.0, math.ceil(100 * (1 - cal_rate / p_train)) / 100)
    deficit = {}
    for s in SIZES:
        rates = rule.window_rates(pools["calibration"]["correct"], s, args.windows, seed=s)
        deficit[s] = float(((p_train * (1 - allowance) - rates) / spreads[s]).max())
    worst = max(v for s, v in deficit.items() if s >= rule.MIN_TOKENS)
    z = max(3.0, math.ceil(4 * worst) / 4)

    table: dict[str, dict[str, dict[str, object]]] = {}
    for pool in ("heldout", "other_domain"):
        table[pool] = {}
        for w, by_seq in pools[pool].items():
            counts = np.asarray(by_seq)
            whole = float(counts[:, 0].sum() / counts[:, 1].sum())
            row: dict[str, object] = {"agreement_all": round(whole, 4)}
            for s in SIZES:
                level = rule.Level(p_train, s, spreads[s], allowance, z)
                rates = rule.window_rates(by_seq, s, args.windows, seed=s)
                bare = float((rates < BARE_FRACTION * p_train).mean())
                row[str(s)] = {"below_level": round(float((rates < level.value).mean()), 4),
                               "below_bare_fraction": round(bare, 4),
                               "mean": round(float(rates.mean()), 4), "min": round(float(rates.min()), 4),
                               "max": round(float(rates.max()), 4)}
            table[pool][w] = row
    out = {
        "benchmark": "replay_rule",
        "date": date.today().isoformat(),
        "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}, CPU only",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "method": __doc__,
        "testbed_recipe_hash": tb.load_manifest()["recipe_hash"],
        "prompts_per_pool": args.prompts,
        "windows_per_size": args.windows,
        "training": {"tokens": train.total, "agreement": round(p_train, 4)},
        "spread_by_size": {str(s): round(v, 4) for s, v in spreads.items()},
        "level_by_size": {str(s): round(rule.Level(p_train, s, spreads[s], allowance, z).value, 4)
                          for s in SIZES},
        "calibration": {"pool_agreement": round(float(cal_rate), 4), "min_tokens": rule.MIN_TOKENS,
                        "allowance": allowance,
                        "largest_deficit_in_spreads": round(worst, 3), "z": z,
                        "largest_deficit_by_size": {str(s): round(v, 3) for s, v in deficit.items()}},
        "rates": table,
    }
    out["source"] = source_state(Path(__file__).resolve().parents[1])  # the commit measured
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({k: out[k] for k in ("training", "spread_by_size", "level_by_size", "calibration")},
                     indent=2))
    for pool, rows in table.items():
        for w, row in rows.items():
            print(pool, w, row["agreement_all"], [row[str(s)]["below_level"] for s in SIZES])


if __name__ == "__main__":
    main()

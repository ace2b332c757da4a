"""Same-token identity on a real pretrained model: how far a slot's rows are from their true source, and
from the nearest other, when the target is recomputed on the same tokens.

What is measured: the real SmolLM2-135M target (30 layers, hidden 576) on four text domains (training
docs, standard-library code, licence prose, chat prompts; 4 documents of up to 128 tokens each, position
0 left out). For every source a slot can carry, the rows as a dump or capture holds them are compared
with the fp32 recomputation that ``diagnose --target`` / ``profile build --target`` make
(:func:`hs_tracer.diagnosis.same_token.relative_errors`):

* ``stored``: the fp32 states rounded to bf16 (what SpecForge dumps and bf16 captures store);
* ``bf16_compute``: the states of the same model run in bf16 (what an engine serving in bf16 feeds),
  for the pre-norm sources transformers' ``hidden_states`` holds;
* ``nearest_other``: the smallest error of any other candidate source to the stored rows: the margin
  the tolerance (6 % for bf16 rows) sits inside.

Run from the repository root:  .venv/bin/python benchmarks/same_token_real.py
"""

from __future__ import annotations

import json
import platform
from datetime import date
from pathlib import Path

import torch
from provenance import source_state

from hs_tracer.diagnosis.same_token import relative_errors, tolerance_for
from hs_tracer.profile.target_forward import load_target
from hs_tracer.sources import EMBEDDING, FINAL_NORM

RESULTS = Path(__file__).resolve().parent / "results" / "same_token_real.json"
DOMAINS = ("docs", "code", "prose", "chat")
SOURCES = (EMBEDDING, "block:0", "block:1", "block:2", "block:13", "block:14", "block:15", "block:25",
           "block:26", "block:27", "block:28", "block:29", FINAL_NORM)
DOCS, TOKENS = 4, 128


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hs_tracer_testbed import realtext, smollm

    target_dir = smollm.ensure_target()
    target = load_target(target_dir)
    bf16 = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.bfloat16).eval()
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    n = target.num_layers
    out: dict = {"tolerance_bf16": tolerance_for(torch.bfloat16, torch.float32), "domains": {}}
    for domain in DOMAINS:
        seqs = smollm.encode(tokenizer, realtext.documents(domain)[:DOCS], TOKENS)
        exact: dict[str, list[torch.Tensor]] = {s: [] for s in target.sources}
        served: dict[str, list[torch.Tensor]] = {}
        for ids in seqs:
            for name, rows in target.states(ids).items():
                exact[name].append(rows[1:])
            with torch.no_grad():
                hs = bf16(torch.tensor([ids]), output_hidden_states=True).hidden_states
            for i in range(n):  # hidden_states[i] is C_in id i: embedding, then block:i-1 (pre-norm)
                name = EMBEDDING if i == 0 else f"block:{i - 1}"
                served.setdefault(name, []).append(hs[i][0, 1:].float())
        cands = {k: torch.cat(v) for k, v in exact.items()}
        rows = {}
        for source in SOURCES:
            stored = cands[source].to(torch.bfloat16)
            errs = relative_errors(stored, cands)
            other = min((e, s) for s, e in errs.items() if s != source)
            computed = (relative_errors(torch.cat(served[source]), {source: cands[source]})[source]
                        if source in served else None)
            rows[source] = {"stored": round(errs[source], 5),
                            "bf16_compute": None if computed is None else round(computed, 4),
                            "nearest_other": other[1], "nearest_other_error": round(other[0], 3)}
        out["domains"][domain] = {"tokens": int(cands[EMBEDDING].shape[0]), "sources": rows}
        print(domain, json.dumps(rows))
    out.update({"date": date.today().isoformat(), "machine": platform.machine(),
                "model": "SmolLM2-135M-Instruct (hs_tracer_testbed.smollm)",
                "source": source_state(Path(__file__).resolve().parents[1])})  # the commit measured
    RESULTS.write_text(json.dumps(out, indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()

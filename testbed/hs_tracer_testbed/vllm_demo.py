"""``hs-tracer demo --engine vllm``: real vLLM on CPU with tracing on, then its diagnosis.

With the vLLM testbed pair (hs_tracer_testbed.llama_pair) it serves the configured draft and then a
copy whose config.json lost its layer ids (vLLM falls back to its default layers), each on its own
engine (hs_tracer_testbed.vllm_runs), and prints what hs_tracer diagnosed inside vLLM, in the same
form as the SGLang demo (hs_tracer_testbed.demo).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from hs_tracer.errors import InputError
from hs_tracer_testbed import demo
from hs_tracer_testbed.demo import DEMO_ENV, Run


def run(target: Path | None = None, draft: Path | None = None, *, profile: Path | None = None,
        miswired: bool = True, num_prompts: int = 16, max_new_tokens: int = 32,
        log: Path | None = None) -> list[Run]:
    from transformers import AutoTokenizer

    from hs_tracer_testbed import llama_pair, vllm_runs
    from hs_tracer_testbed.corpus import prompts as corpus_prompts

    if target is None:
        pair = llama_pair.ensure_llama_pair()
        target, draft = pair.target, draft or pair.draft
        profile = profile or llama_pair.profile(pair)
    assert draft is not None
    tok = AutoTokenizer.from_pretrained(str(target))
    texts = corpus_prompts(seed=1234, n=num_prompts)
    ids = [tok(t)["input_ids"] for t in texts]
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="hs-tracer-demo-vllm-") as tmp:
        plan = [("as configured", draft)]
        if miswired:
            copy = llama_pair.write_ids_missing(draft, Path(tmp) / "ids_missing")
            plan.append(("miswired: ids_missing", copy))
        for i, (name, run_draft) in enumerate(plan, 1):
            print(f"[{i}/{len(plan)}] vLLM with EAGLE-3 on CPU, tracing on: {name} ({len(texts)} prompts, "
                  "a minute or two)", file=sys.stderr, flush=True)
            env = {**DEMO_ENV, **({"HS_TRACER_PROFILE": str(profile)} if profile else {})}
            out = vllm_runs.run({"target": str(target), "draft": str(run_draft), "env": env,
                                 "workloads": [{"name": "demo", "prompts": ids,
                                                "max_new_tokens": max_new_tokens}]})
            if log is not None:
                with open(log, "a") as f:
                    f.write(out["log"])
            output_ids = out["workloads"]["demo"]["output_ids"]
            runs.append(Run(name, Path(target), Path(run_draft), texts,
                            [tok.decode(o) for o in output_ids], output_ids, out.get("reports", [])))
    return runs


def cli(args: Any) -> int:
    """``hs-tracer demo --engine vllm``: the configured draft, then a copy without
    its layer ids (with the testbed pair)."""
    if args.scenarios:
        raise InputError("--scenario names SGLang's miswirings; with --engine vllm the demo runs the draft "
                         "without its layer ids")
    if importlib.util.find_spec("vllm") is None:
        raise InputError("--engine vllm needs vLLM installed: `make demo ENGINE=vllm` builds its venv")
    log = None
    if not args.verbose:
        fd, name = tempfile.mkstemp(prefix="hs-tracer-demo-vllm-", suffix=".log")
        os.close(fd)
        log = Path(name)
        print(f"vLLM's own output goes to {log} (--verbose shows it here instead)", file=sys.stderr)
    miswired = args.target is None
    runs = run(args.target, args.draft, profile=args.profile, miswired=miswired,
               num_prompts=args.prompts, max_new_tokens=args.max_new_tokens, log=log)
    if args.json:
        out = [r.to_json() for r in runs]
        print(json.dumps(out[0] if len(out) == 1 else out, indent=2))
    else:
        print(demo.human(runs, expect_miswired=miswired, verbose=args.verbose))
    return demo.exit_code(runs, expect_miswired=miswired)

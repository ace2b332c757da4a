"""Calibrate ``acceptance_drop`` on the real pair: false alarms per text domain, detection per fault.

Method: SmolLM2-135M-Instruct and its committed EAGLE-3 draft (``smollm.ensure_pair()``) served by
real SGLang on CPU (the testbed runtime), greedy chain (3 steps, topk 1), tracing on with the pair's
reference profile and every verify step captured. One engine per scenario, each answering its prompts
in one batch to the end-of-turn token or ``--max-new-tokens``:

* the draft as trained on held-out chat prompts of its training domain and on four other text domains
  (held-out Python reference text, standard-library source, licence prose, chat without a system
  prompt): what acceptance does with nothing wrong;
* on the held-out chat prompts, every train/serve layer shift of ``miswire.layer_shifts`` (config ids
  edited; a swap permutes the ``fc`` column blocks) and the draft without its ``d2t`` (a fault
  downstream of the features).

Per scenario the raw evidence is kept: SGLang's per-request histogram of accepted drafts, the
tracer's own settled report, and the drift score of every slot over the whole capture (the
statistics of the draft's input against the profile, ``diagnose_detailed``). Judging (``--runs``
re-judges a results file without engines, e.g. after a rule change): a live window draws whole
requests at random and takes their steps in random order until it holds ``n`` verify steps (a
cumulative tally sees mostly few requests at low load: the correlated case); each window is judged
by :func:`hs_tracer.diagnosis.acceptance.acceptance_findings` against the profile's expected
acceptance, with what the scenario's features say (slots measured as trained or not, and whether
the features drifted from the training data).

    python benchmarks/acceptance_real.py --out benchmarks/results/acceptance_real_smollm2_cpu.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
for _path in (REPO, REPO / "testbed", REPO / "benchmarks"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

HELDOUT = "instruct_heldout"
DOMAINS = {HELDOUT: 102, "docs_heldout": 37, "code": 48, "prose": 48, "chat": 48}
SIZES = (64, 128, 256, 512, 1024)
ENV = {"HS_TRACER": "1", "HS_TRACER_WINDOW_TOKENS": "512", "HS_TRACER_CAPTURE_RATE": "1"}


def scenarios(draft: Path, target: Path, work: Path) -> list[tuple[str, str, Path]]:
    """(name, domain, draft dir) of every engine to run."""
    from hs_tracer_testbed.miswire import layer_shifts, write_ids_variant, write_vocab_variant

    cfg = json.loads((draft / "config.json").read_text())
    trained = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    layers = json.loads((target / "config.json").read_text())["num_hidden_layers"]
    out = [(f"correct@{d}", d, draft) for d in DOMAINS]
    for name, v in layer_shifts(trained, layers).items():
        if name != "correct":
            out.append((name, HELDOUT, write_ids_variant(draft, work / name, v["ids"], v["slot_order"])))
    out.append(("d2t_missing", HELDOUT, write_vocab_variant(draft, work / "d2t_missing", None)))
    return out


def drift_of(capture: Path, profile: Any) -> dict[str, Any]:
    """Each slot's drift score over the whole capture (and the tokens it holds)."""
    from hs_tracer.diagnosis.identity import diagnose_detailed
    from hs_tracer.diagnosis.live import read_live

    live = read_live(capture, profile.hidden_size)
    d = diagnose_detailed(live.stats, profile, tokens=live.tokens)
    return {"tokens": live.tokens, "drift_score": [round(float(m.drift_score), 3) for m in d.matches],
            "status": d.report.status}


def run_engines(args: argparse.Namespace) -> dict[str, Any]:
    from hs_tracer.integrations.sglang.versions import installed_meta_counters
    from hs_tracer.profile.model import Profile
    from hs_tracer_testbed import smollm
    from hs_tracer_testbed.demo import real_pair_profile, settled_reports
    from hs_tracer_testbed.runtime.launcher import engine

    pair = smollm.ensure_pair()
    profile_path = real_pair_profile(pair)
    profile = Profile.load(profile_path)
    counters = installed_meta_counters()
    work = Path(tempfile.mkdtemp(prefix="acceptance-real-"))
    sampling = {"temperature": 0.0, "max_new_tokens": args.max_new_tokens}
    runs: dict[str, Any] = {}
    try:
        plan = scenarios(pair.draft, pair.target, work)
        for i, (name, domain, draft) in enumerate(plan, 1):
            if args.only and name not in args.only:
                continue
            prompts = smollm.prompts(DOMAINS[domain], domain=domain)
            reports, capture = work / f"{name}.reports", work / f"{name}.capture"
            reports.mkdir()
            env = {**ENV, "HS_TRACER_PROFILE": str(profile_path), "HS_TRACER_REPORT_DIR": str(reports),
                   "HS_TRACER_CAPTURE_DIR": str(capture)}
            t0 = time.time()
            with engine(pair.target, draft, env=env) as eng:
                outs = eng.generate(prompts, sampling)
                steps = sum(int(o["meta_info"].get("spec_verify_ct") or 0) for o in outs)
                report = settled_reports(reports, steps)
            hist = [list(o["meta_info"].get(counters.accept_histogram) or []) for o in outs]
            runs[name] = {"domain": domain, "prompts": len(prompts), "requests": hist,
                          "report": (report[0].get("diagnosis") if report else None),
                          "features": drift_of(capture, profile), "wall_s": round(time.time() - t0, 1)}
            r = runs[name]
            print(f"[{i}/{len(plan)}] {name}: accept {accept_length(hist):.3f}, tracer "
                  f"{(r['report'] or {}).get('status')}, drift {r['features']['drift_score']} "
                  f"({r['wall_s']} s)", file=sys.stderr, flush=True)
            shutil.rmtree(capture, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    exp = profile.expected_acceptance
    return {"runs": runs, "expectation": exp.to_json() if exp is not None else None,
            "profile": {"path": profile_path.name, "tokens": profile.tokens}}


def accept_length(requests: list[list[int]]) -> float:
    """1 + accepted drafts / verify steps, pooled over requests (histogram index = drafts accepted)."""
    steps = sum(sum(h) for h in requests)
    return 1.0 + sum(i * c for h in requests for i, c in enumerate(h)) / max(steps, 1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--max-new-tokens", type=int, default=160)
    p.add_argument("--only", action="append", help="run only this scenario (repeatable)")
    p.add_argument("--runs", type=Path, help="a results file whose raw evidence to re-judge")
    p.add_argument("--reps", type=int, default=200)
    args = p.parse_args(argv)
    if args.runs is not None:
        raw = json.loads(args.runs.read_text())
    else:
        t0 = time.time()
        raw = run_engines(args)
        raw["engines_s"] = round(time.time() - t0, 1)
        from provenance import header

        raw.update(header(REPO))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(raw, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

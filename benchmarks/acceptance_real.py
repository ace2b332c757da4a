"""Calibrate ``acceptance_drop`` on the real pair: false alarms per text domain, detection per fault.

Method: SmolLM2-135M-Instruct and its committed EAGLE-3 draft (``smollm.ensure_pair()``) served by
real SGLang on CPU (the testbed runtime), greedy chain (3 steps, topk 1), tracing on with the pair's
reference profile (its expected acceptance measured on held-out records). One engine per scenario,
each answering its prompts in one batch to the end-of-turn token or ``--max-new-tokens``:

* the draft as trained on held-out chat prompts of its training domain and on four other text domains
  (held-out Python reference text, standard-library source, licence prose, chat without a system
  prompt): what acceptance does with nothing wrong;
* on 48 of the held-out chat prompts, every train/serve layer shift of ``miswire.layer_shifts``
  (config ids edited; a swap permutes the ``fc`` column blocks) and the draft without its ``d2t`` (a
  fault downstream of the features).

Per scenario the raw evidence is kept: SGLang's per-request histogram of accepted drafts and the
tracer's own settled report (every slot named by same-token measurement, with its drift score: how
far the statistics of the draft's input sit from the training data's). Judging (``--runs``
re-judges a results file without engines, e.g. after a rule change): a window is the tally after
``n`` request-steps of requests drawn at random, one at a time (sequential traffic: one request's
steps fill a small window, the correlated worst case) or eight at a time (each verify step adds a
step of every running request); each window is judged by
:func:`hs_tracer.diagnosis.acceptance.acceptance_findings` against the profile's expected
acceptance, with what the scenario's tracer report says of the features (every slot measured as its
trained source or not).

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

import numpy as np

REPO = Path(__file__).resolve().parents[1]
for _path in (REPO, REPO / "testbed", REPO / "benchmarks"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

HELDOUT = "instruct_heldout"
DOMAINS = {HELDOUT: 102, "docs_heldout": 37, "code": 48, "prose": 48, "chat": 48}  # prompts per domain
FAULT_PROMPTS = 48  # held-out prompts per miswired engine
SIZES = (64, 128, 256, 512, 1024)  # verify steps (request-steps) in the tally
CONCURRENCY = (1, 8)  # requests running at once: sequential traffic, and a small batch
ENV = {"HS_TRACER": "1", "HS_TRACER_WINDOW_TOKENS": "512"}


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


def run_engines(args: argparse.Namespace, save: Any) -> dict[str, Any]:
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
            prompts = smollm.prompts(DOMAINS[domain] if name.startswith("correct@") else FAULT_PROMPTS,
                                     domain=domain)
            reports = work / f"{name}.reports"
            reports.mkdir()
            env = {**ENV, "HS_TRACER_PROFILE": str(profile_path), "HS_TRACER_REPORT_DIR": str(reports)}
            t0 = time.time()
            with engine(pair.target, draft, env=env) as eng:
                outs = eng.generate(prompts, sampling)
                steps = sum(int(o["meta_info"].get("spec_verify_ct") or 0) for o in outs)
                report = settled_reports(reports, steps)
            hist = [list(o["meta_info"].get(counters.accept_histogram) or []) for o in outs]
            runs[name] = {"domain": domain, "prompts": len(prompts), "requests": hist,
                          "report": (report[0].get("diagnosis") if report else None),
                          "wall_s": round(time.time() - t0, 1)}
            r = runs[name]
            print(f"[{i}/{len(plan)}] {name}: accept {accept_length(hist):.3f}, tracer "
                  f"{(r['report'] or {}).get('status')}, drift {evidence(r)[1]} ({r['wall_s']} s)",
                  file=sys.stderr, flush=True)
            save({"runs": runs})  # a long run keeps what it has
    finally:
        shutil.rmtree(work, ignore_errors=True)
    exp = profile.expected_acceptance
    return {"runs": runs, "expectation": exp.to_json() if exp is not None else None,
            "profile": {"path": profile_path.name, "tokens": profile.tokens}}


def accept_length(requests: list[list[int]]) -> float:
    """1 + accepted drafts / verify steps, pooled over requests (histogram index = drafts accepted)."""
    steps = sum(sum(h) for h in requests)
    return 1.0 + sum(i * c for h in requests for i, c in enumerate(h)) / max(steps, 1)


def windows(requests: list[list[int]], n: int, reps: int, rng: np.random.Generator, concurrent: int = 1,
            positions: int = 3):  # fmt: skip
    """``reps`` windows of ``n`` verify steps as a cumulative tally sees them: requests in random
    order, ``concurrent`` at a time, each verify step adding one step of every running request (a
    request's steps, from its histogram, in random order); None if the requests hold fewer steps."""
    from hs_tracer.diagnosis.live import acceptance_of
    from hs_tracer.findings import Acceptance

    per_request = [np.repeat(np.arange(len(h)), h) + 1 for h in requests]  # accept lengths
    if sum(map(len, per_request)) < n:
        return None
    out = []
    for _ in range(reps):
        queue = [rng.permutation(per_request[i]).tolist() for i in rng.permutation(len(per_request))]
        running: list[list[int]] = []
        steps: list[int] = []
        while len(steps) < n and (queue or running):
            while queue and len(running) < concurrent:
                running.append(queue.pop())
            steps += [r.pop() for r in running]
            running = [r for r in running if r]
        acc = acceptance_of(np.asarray(steps[:n]))
        rates = (list(acc.per_position_rate) + [0.0] * positions)[:positions]
        out.append(Acceptance(acc.steps, acc.mean_accept_length, rates))
    return out


def evidence(run: dict[str, Any]) -> tuple[bool | None, list[float | None]]:
    """What the tracer's own report says of the features: every slot fed its trained source (True),
    some slot not (False); each slot's drift score."""
    slots = (run.get("report") or {}).get("slots") or []
    if not slots:
        return None, []
    match = all(s["observed_source"] == s["expected_source"] for s in slots)
    return match, [s.get("drift") for s in slots]


def judge(raw: dict[str, Any], reps: int, expectation_json: dict[str, Any] | None) -> dict[str, Any]:
    """Per scenario, window size and load: the share of windows judged ``acceptance_drop``, and how
    live acceptance compares with the expectation (5th, 50th, 95th percentile of live / expected)."""
    from hs_tracer.diagnosis.acceptance import AcceptanceThresholds, acceptance_findings
    from hs_tracer.profile.expectation import ExpectedAcceptance

    exp = ExpectedAcceptance.from_json(expectation_json) if expectation_json else None
    th = AcceptanceThresholds()
    rng = np.random.default_rng(0)
    out: dict[str, Any] = {}
    for name, run in raw["runs"].items():
        match, drift = evidence(run)
        report = run.get("report") or {}
        row: dict[str, Any] = {
            "domain": run["domain"], "prompts": run["prompts"],
            "verify_steps": int(sum(sum(h) for h in run["requests"])),
            "mean_accept_length": round(accept_length(run["requests"]), 4),
            "interval_95": bootstrap(run["requests"], rng),
            "tracer_status": report.get("status"),
            "tracer_findings": sorted({f["code"] for f in report.get("findings", [])
                                       if f["severity"] != "info"}),
            "features_match": match, "drift": drift, "windows": {}}
        for n in SIZES:
            cells = {}
            for concurrent in CONCURRENCY:
                ws = windows(run["requests"], n, reps, rng, concurrent)
                if ws is None:
                    continue
                verdicts = [acceptance_findings(w, exp, features_match=match, th=th) for w in ws]
                ratio = np.array([w.mean_accept_length for w in ws]) / (exp.accept_length(3) if exp else 1.0)
                spread = np.quantile(ratio, [0.05, 0.5, 0.95])
                cells[concurrent] = {"acceptance_drop": share(verdicts),
                                     "live_over_expected_p05_p50_p95": [round(float(q), 3) for q in spread]}
            if cells:
                row["windows"][n] = cells
        out[name] = row
    return out


def share(verdicts: list[list[Any]]) -> float:
    """The fraction of windows judged ``acceptance_drop``."""
    from hs_tracer.findings import Code

    hits = sum(any(f.code is Code.ACCEPTANCE_DROP for f in fs) for fs in verdicts)
    return round(hits / max(len(verdicts), 1), 4)


def bootstrap(requests: list[list[int]], rng: np.random.Generator, rounds: int = 2000) -> list[float]:
    """95 % interval of the pooled accept length, resampling requests."""
    steps = np.array([sum(h) for h in requests], dtype=float)
    accepted = np.array([sum(i * c for i, c in enumerate(h)) for h in requests], dtype=float)
    picks = rng.integers(0, len(requests), size=(rounds, len(requests)))
    vals = 1 + accepted[picks].sum(1) / np.maximum(steps[picks].sum(1), 1)
    return [round(float(v), 4) for v in np.quantile(vals, [0.025, 0.975])]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--max-new-tokens", type=int, default=160)
    p.add_argument("--only", action="append", help="run only this scenario (repeatable)")
    p.add_argument("--runs", type=Path, help="a results file whose raw evidence to re-judge")
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--profile", type=Path, help="judge against this profile's expected acceptance")
    args = p.parse_args(argv)
    if args.runs is not None:
        raw = json.loads(args.runs.read_text())
    else:
        t0 = time.time()
        partial = args.out.with_suffix(".partial.json")
        raw = run_engines(args, lambda d: partial.write_text(json.dumps(d) + "\n"))
        raw["engines_s"] = round(time.time() - t0, 1)
        from provenance import header

        raw.update(header(REPO))
    expected = raw.get("expectation")
    if args.profile is not None:
        from hs_tracer.profile.model import Profile

        exp = Profile.load(args.profile).expected_acceptance
        expected = exp.to_json() if exp is not None else None
    from hs_tracer.diagnosis.acceptance import AcceptanceThresholds

    raw["judged"] = {"expectation": expected, "thresholds": dict(AcceptanceThresholds().__dict__),
                     "reps_per_cell": args.reps, "scenarios": judge(raw, args.reps, expected)}
    raw["method"] = __doc__.split("\n\n")[1].replace("\n", " ")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(raw, indent=1) + "\n")
    for name, r in raw["judged"]["scenarios"].items():
        cells = " ".join(f"{n}:" + "/".join(f"{c['acceptance_drop']:.3f}" for c in by.values())
                         for n, by in r["windows"].items())
        print(f"{name:28s} {r['mean_accept_length']:.3f} {r['interval_95']} {r['tracer_status']} "
              f"drift {r['drift']}  flagged (1/8 at once) {cells}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

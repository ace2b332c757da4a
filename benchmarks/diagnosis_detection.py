"""Detection latency and false-alarm rate of slot identity (hs_tracer.diagnosis) on the testbed.

What is measured: the reference profile is built from the testbed's SpecForge training dump of its
trained 8-layer DeepSeek-V3 target (with and without the all-layer atlas). Live windows are drawn from
fresh held-out documents run through the target (bf16-rounded; same corpus as training, another seed)
and from documents of the corpus's other domain, and fed wired correctly or as each miswiring of
hs_tracer_testbed.miswire.fed_sources. For every window size, `reps` random windows (whole documents
drawn at random, cut to size) are judged with the default thresholds:

* false alarm: a correctly wired window whose status is not ``ok`` (and separately: ``miswired``);
* detection: a miswired window with status ``miswired``; named: every slot's observed source equal to
  the source really fed;
* detection latency: the smallest window size (tokens) with detection and naming rates >= 95 %.

Plus the cost of one ``diagnose`` call at DeepSeek-V3/Kimi shapes (K=3, H=7168, 63 candidates; the
statistics there are random - only the time is meaningful).

Run from the repository root:  .venv/bin/python benchmarks/diagnosis_detection.py [--reps N]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from dataclasses import asdict
from datetime import date
from pathlib import Path

import numpy as np
from provenance import source_state

from hs_tracer.diagnosis.identity import diagnose
from hs_tracer.diagnosis.matcher import Thresholds
from hs_tracer.fingerprint.stats import ChannelStats
from hs_tracer.profile import build
from hs_tracer.profile.model import NamedStats, Profile
from hs_tracer_testbed.evaluate import detection_rates, pool_from_testbed
from hs_tracer_testbed.miswire import fed_sources as scenarios

RESULTS = Path(__file__).resolve().parent / "results" / "diagnosis_detection.json"
SIZES = (64, 128, 256, 512, 1024, 2048)


def latency(rates: dict[int, dict[str, float]]) -> int | None:
    for size in sorted(rates):
        if rates[size]["miswired"] >= 0.95 and rates[size]["named"] >= 0.95:
            return size
    return None


def cost_at_scale(repeats: int = 20) -> dict[str, float]:
    rng = np.random.default_rng(0)
    k, h, c, m = 3, 7168, 63, 256

    def stats(rows: int, n: float) -> ChannelStats:
        mean = rng.normal(size=(rows, h))
        var = rng.uniform(0.5, 2.0, size=(rows, h))
        return ChannelStats(np.full((rows, h), n), mean * n, (var + mean**2) * n)

    names = ["embedding"] + [f"block:{j}" for j in range(61)] + ["final_norm"]
    meta = {
        "sources": ["block:1", "block:29", "block:57"],
        "num_slots": k,
        "hidden_size": h,
        "tokens": 10**6,
        "piece_tokens": 64,
        "max_pieces": m,
    }
    pieces = {
        "keys": np.arange(m),
        "tokens": np.full(m, 64),
        "sum": rng.normal(size=(m, k, h)).astype(np.float32),
        "sumsq": rng.uniform(64, 128, size=(m, k, h)).astype(np.float32),
    }
    profile = Profile(meta, stats(k, 1e6), pieces, atlas=NamedStats(names, stats(c, 1e5)))
    live = stats(k, 1024.0)
    t0 = time.perf_counter()
    diagnose(live, profile, tokens=1024)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(repeats):
        diagnose(live, profile, tokens=1024)
    return {
        "first_call_s_incl_calibration": round(first, 3),
        "per_call_ms": round(1000 * (time.perf_counter() - t0) / repeats, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--docs", type=int, default=400)
    ap.add_argument(
        "--min-tokens",
        type=int,
        default=None,
        help="override Thresholds.min_tokens (to see what the statistics alone need)",
    )
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)))
    ap.add_argument("--atlas-only", action="store_true")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    sizes = [int(v) for v in args.sizes.split(",")]
    thresholds = Thresholds() if args.min_tokens is None else Thresholds(min_tokens=args.min_tokens)

    from hs_tracer_testbed.build import ensure_testbed

    tb = ensure_testbed(progress=False)
    target = build.read_target(tb.target)
    dump = build.open_dump(tb.specforge_data, ids=build.ids_from_draft(tb.draft), target=target)
    atlas = build.open_dump(tb.atlas_data, target=target, all_layers=True)
    profiles = {
        "atlas": build.build_profile([dump], atlas=atlas, progress=False),
        "no_atlas": build.build_profile([dump], progress=False),
    }
    if args.atlas_only:
        del profiles["no_atlas"]
    pools = {
        "heldout_same_domain": pool_from_testbed(tb.target, args.docs, "train", seed=4242),
        "other_domain": pool_from_testbed(tb.target, args.docs, "other", seed=4243),
    }
    out: dict = {
        "benchmark": "diagnosis_detection",
        "date": date.today().isoformat(),
        "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}, CPU only",
        "python": platform.python_version(),
        "method": __doc__,
        "testbed_recipe_hash": tb.load_manifest()["recipe_hash"],
        "profile_tokens": profiles["atlas"].tokens,
        "reps_per_cell": args.reps,
        "thresholds": asdict(thresholds),
        "results": {},
    }
    for pname, profile in profiles.items():
        for dname, pool in pools.items():
            cell: dict = {}
            for sname, live in scenarios(profile.sources).items():
                rates = detection_rates(profile, pool, live, sizes, args.reps, seed=1, thresholds=thresholds)
                cell[sname] = {"rates": {str(k): v for k, v in rates.items()}}
                if sname == "correct":
                    cell[sname]["false_alarm_not_ok"] = {
                        str(k): round(1 - v["ok"], 4) for k, v in rates.items()
                    }
                    cell[sname]["false_alarm_miswired"] = {str(k): v["miswired"] for k, v in rates.items()}
                else:
                    cell[sname]["latency_tokens"] = latency(rates)
                print(
                    pname,
                    dname,
                    sname,
                    {k: (v["ok"], v["miswired"], v["named"]) for k, v in rates.items()},
                    flush=True,
                )
            out["results"][f"{pname}/{dname}"] = cell
    out["cost_at_deepseek_v3_shapes"] = cost_at_scale()
    out["source"] = source_state(Path(__file__).resolve().parents[1])  # the commit measured
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

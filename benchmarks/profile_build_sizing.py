"""How much training data a reference profile needs: verdicts from profiles of 1 %, 10 %, 100 % of it.

What is measured: on the testbed (8-layer DeepSeek-V3 target, hidden 64, its EAGLE-3 draft), profiles
are built from the first shard of the SpecForge training dump and of the all-layer atlas dump with
``--shard 0/100`` (1 % of the files), ``0/10`` (10 %) and unsharded (100 %). Each profile then judges
the same live windows as benchmarks/diagnosis_detection.py: fresh held-out documents through the
target (same domain, another seed; and the corpus's other domain), fed correctly or as each miswiring
of hs_tracer_testbed.miswire.fed_sources, ``reps`` random windows per window size, default
thresholds. Reported per profile: tokens and calibration pieces it holds; false alarms (correct
windows not ``ok`` / ``miswired``); detection (``miswired``) and naming rates per miswiring; and the
profile's own sampling error: ``D`` (the divergence diagnosis uses) between each trained slot of the
partial profile and the same slot of the full one, next to the smallest ``D`` between two different
sources of the full profile (what must not be confused).

Run from the repository root:  .venv/bin/python benchmarks/profile_build_sizing.py [--reps N]
"""

from __future__ import annotations

import argparse
import json
import platform
from datetime import datetime, timezone
from pathlib import Path

from provenance import source_state

from hs_tracer.diagnosis.matcher import divergence, moments
from hs_tracer.profile import build
from hs_tracer.profile.model import Profile
from hs_tracer_testbed.evaluate import detection_rates, pool_from_testbed
from hs_tracer_testbed.miswire import fed_sources

RESULTS = Path(__file__).resolve().parent / "results" / "profile_build_sizing.json"
FRACTIONS = {"1%": (0, 100), "10%": (0, 10), "100%": None}
SIZES = (256, 1024, 2048)


def _d(a_stats, b_stats, floor_rel: float = 1e-4) -> float:
    am, av = moments(a_stats)
    bm, bv = moments(b_stats)
    floor = floor_rel * bv.mean(axis=1)
    return float(divergence(am, av, bm, bv, floor)[0, 0])


def sampling_error(part: Profile, full: Profile) -> dict[str, float]:
    """Per trained slot, D(partial slot, full slot); and the nearest pair of distinct full sources."""
    own = {s: _d(part.slots.slot(k), full.slots.slot(k)) for k, s in enumerate(full.sources)}
    rows = full.atlas
    assert rows is not None
    nearest = min(
        _d(rows.stats.slot(i), rows.stats.slot(j))
        for i in range(len(rows.names))
        for j in range(len(rows.names))
        if i != j
    )
    return {"D_partial_vs_full_by_slot": own, "D_nearest_distinct_sources_full": nearest}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--docs", type=int, default=300)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()

    from hs_tracer_testbed.build import ensure_testbed

    tb = ensure_testbed(progress=False)
    target = build.read_target(tb.target)
    dump = build.open_dump(tb.specforge_data, ids=build.ids_from_draft(tb.draft), target=target)
    atlas = build.open_dump(tb.atlas_data, target=target, all_layers=True)
    profiles = {
        name: build.build_profile([dump], atlas=atlas, shard=shard, progress=False)
        for name, shard in FRACTIONS.items()
    }
    full = profiles["100%"]
    pools = {
        "heldout_same_domain": pool_from_testbed(tb.target, args.docs, "train", seed=4242),
        "other_domain": pool_from_testbed(tb.target, args.docs, "other", seed=4243),
    }
    out: dict = {
        "benchmark": "profile_build_sizing",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, CPU only",
        "python": platform.python_version(),
        "method": __doc__,
        "testbed_recipe_hash": tb.load_manifest()["recipe_hash"],
        "reps_per_cell": args.reps,
        "window_sizes": list(SIZES),
        "profiles": {},
    }
    for name, profile in profiles.items():
        cell: dict = {
            "tokens": profile.tokens,
            "records": profile.meta["records"],
            "atlas_tokens": profile.meta["atlas"]["tokens"],
            "calibration_pieces": len(profile.pieces["keys"]),
            **sampling_error(profile, full),
            "verdicts": {},
        }
        for pname, pool in pools.items():
            per: dict = {}
            for sname, live in fed_sources(profile.sources).items():
                rates = detection_rates(profile, pool, live, SIZES, args.reps, seed=1)
                if sname == "correct":
                    per[sname] = {
                        "false_alarm_not_ok": {str(k): round(1 - v["ok"], 4) for k, v in rates.items()},
                        "false_alarm_miswired": {str(k): v["miswired"] for k, v in rates.items()},
                    }
                else:
                    per[sname] = {
                        "detected": {str(k): v["miswired"] for k, v in rates.items()},
                        "named": {str(k): v["named"] for k, v in rates.items()},
                    }
                print(name, pname, sname, per[sname], flush=True)
            cell["verdicts"][pname] = per
        out["profiles"][name] = cell
    out["source"] = source_state(Path(__file__).resolve().parents[1])  # the commit measured
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""``hs-tracer diagnose LIVE --profile P``: which source each slot of LIVE carries vs the training data.

LIVE is an hs_tracer capture directory or any dump a profile reader accepts (SpecForge, speculators),
so the same command answers "is this dataset wired like the one the draft was trained on?". An
hs_tracer capture also holds the engine's record of what it fed (the manifest's ``sources``).
``--target`` measures instead of inferring: the target is recomputed on LIVE's own tokens and each
slot's rows are compared with every source of the same tokens, which names the layer each slot holds.
Exit status (docs/interfaces.md): 0 healthy, 1 critical findings, 2 usage or input errors.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# hs_tracer.profile.token_rows's defaults (importing it here would load torch for every command)
SEQUENCES = 8
TOKENS = 512


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "diagnose",
        help="compare captured (or any dumped) draft-input features with a reference profile",
        description="Match every slot of LIVE against the profile's sources (and its layer atlas): slot "
        "source mismatches, unknown sources, drift, width and non-finite problems. docs/diagnosis.md "
        "explains the statistic and the thresholds.",
    )
    p.add_argument(
        "live", type=Path, metavar="LIVE", help="hs_tracer capture dir, SpecForge or speculators dir"
    )
    p.add_argument("--profile", type=Path, required=True, help="reference profile (hs-tracer profile build)")
    p.add_argument("--json", action="store_true", help="print the report as JSON (docs/interfaces.md)")
    p.add_argument("--verbose", action="store_true",
                   help="list the findings under each root cause (the JSON always has them)")
    p.add_argument("--target", type=Path, help="the target model dir (config.json + safetensors): recompute "
                   "it on LIVE's tokens and measure which source each slot's rows equal")
    p.add_argument("--sequences", type=int, default=SEQUENCES,
                   help=f"with --target: whole sequences recomputed at most (default {SEQUENCES})")
    p.add_argument("--tokens", type=int, default=TOKENS,
                   help=f"with --target: rows compared at most (default {TOKENS})")
    p.add_argument("--no-progress", action="store_true", help="no progress bar while recomputing the target")
    p.add_argument("--min-tokens", type=int, default=None, help="tokens needed before deciding (default 256)")
    p.add_argument("--match-safety", type=float, default=None, help="t_match multiplier (default 1.5)")
    p.add_argument("--rho-min", type=float, default=None, help="minimum decisive ratio (default 1.25)")
    p.add_argument("--drift-factor", type=float, default=None, help="feature_drift level (default 4)")
    p.add_argument("--unknown-factor", type=float, default=None, help="'unknown' level (default 10)")
    p.set_defaults(func=run)


# Tuning flags: (lowest allowed value, why). A factor below 1 would call correct windows wrong.
_LIMITS = {
    "min_tokens": (1, "a window needs at least one token"),
    "match_safety": (1e-9, "a positive multiplier"),
    "rho_min": (1.0, "a ratio of at least 1"),
    "drift_factor": (1.0, "a factor of at least 1"),
    "unknown_factor": (1.0, "a factor of at least 1"),
}


def thresholds_from(args: argparse.Namespace):
    import math
    from dataclasses import replace

    from hs_tracer.diagnosis.matcher import Thresholds
    from hs_tracer.errors import InputError

    for name, (low, what) in _LIMITS.items():
        value = getattr(args, name)
        if value is not None and not (math.isfinite(value) and value >= low):
            raise InputError(f"--{name.replace('_', '-')} {value}", f"needs {what}",
                             "leave it out to use the calibrated default")

    changes = {
        k: v
        for k, v in (
            ("min_tokens", args.min_tokens),
            ("match_safety", args.match_safety),
            ("rho_min", args.rho_min),
            ("drift_factor", args.drift_factor),
            ("unknown_factor", args.unknown_factor),
        )
        if v is not None
    }
    return replace(Thresholds(), **changes)


def measure_live(args: argparse.Namespace, hidden: int, skip_first: int):
    """With ``--target``: which source each slot of LIVE holds, measured on its own tokens (None
    without ``--target``, or when the rows do not split into slots of the profile's hidden size)."""
    from hs_tracer.diagnosis.live import live_sample
    from hs_tracer.diagnosis.recompute import measure
    from hs_tracer.errors import InputError
    from hs_tracer.profile.target_forward import load_target

    if args.target is None:
        return None
    for flag, value in (("--sequences", args.sequences), ("--tokens", args.tokens)):
        if value < 1:
            raise InputError(f"{flag} {value}", "needs at least 1", "leave it out for the default")
    found = live_sample(args.live, hidden, skip_first, sequences=args.sequences, tokens=args.tokens)
    if found is None:
        return None
    target = load_target(args.target)
    return measure(target, found[0], found[1], progress=False if args.no_progress else None)


def run(args: argparse.Namespace) -> int:
    from hs_tracer.diagnosis.identity import diagnose_detailed
    from hs_tracer.diagnosis.live import read_live
    from hs_tracer.diagnosis.recompute import STATISTICAL
    from hs_tracer.inputs.capture import check_live
    from hs_tracer.inputs.model_config import check_target
    from hs_tracer.inputs.profile import load_profile

    thresholds = thresholds_from(args)
    profile = load_profile(args.profile)
    check_live(args.live, profile, args.profile)
    if args.target is not None:
        check_target(args.target)
    skip_first = int(profile.meta.get("skip_first_positions", 1))
    live = read_live(args.live, profile.hidden_size, skip_first)
    measurement = measure_live(args, profile.hidden_size, skip_first)
    result = diagnose_detailed(
        live.stats,
        profile,
        tokens=live.tokens,
        nonfinite=live.nonfinite,
        width=live.width,
        thresholds=thresholds,
    )
    from hs_tracer.diagnosis.verdict import live_report, recorded_wiring
    from hs_tracer.profile import capture_format

    recorded = (capture_format.read_manifest(args.live).sources
                if capture_format.is_capture_dir(args.live) else None)
    static, record_matches = recorded_wiring(recorded, profile)
    report = live_report(static, result.report, live.acceptance, profile,
                         engine_layers_checked=record_matches,
                         measured=measurement.slots if measurement is not None else None)
    if args.json:
        doc = report.to_json()
        doc["measured"] = measurement.to_json() if measurement is not None else None
        print(json.dumps(doc, indent=2))
    else:
        print(f"live: {args.live} ({live.producer}), {live.tokens} tokens, width {live.width}")
        if result.calibration is not None:
            c = result.calibration
            print(
                f"reference: {args.profile} ({profile.meta['producer']}, {profile.tokens} tokens"
                f"{', with atlas' if profile.atlas is not None else ', no atlas'}); thresholds calibrated at "
                f"{c.window_tokens} tokens: same-source distance up to {c.t_match:.3g}, ambiguity ratio "
                f"{c.rho:.2f}"
            )
        if measurement is not None:
            print(measurement.summary())
        else:
            print(STATISTICAL if args.target is None else
                  f"not measured: the rows ({live.width} wide) do not split into slots of the profile's "
                  f"hidden size {profile.hidden_size}; the width finding says why")
        print(report.human(verbose=args.verbose))
    return report.exit_code

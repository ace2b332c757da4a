"""``hs-tracer diagnose LIVE --profile P``: which source each slot of LIVE carries vs the training data.

LIVE is an hs_tracer capture directory or any dump a profile reader accepts (SpecForge, speculators),
so the same command answers "is this dataset wired like the one the draft was trained on?". An
hs_tracer capture also holds the engine's record of what it fed (the manifest's ``sources``): it
decides what the window's statistics cannot, as it does in a running engine.
Exit status (docs/interfaces.md): 0 healthy, 1 critical findings, 2 usage or input errors.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


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


def run(args: argparse.Namespace) -> int:
    from hs_tracer.diagnosis.identity import diagnose_detailed
    from hs_tracer.diagnosis.live import read_live
    from hs_tracer.inputs.capture import check_live
    from hs_tracer.inputs.profile import load_profile

    thresholds = thresholds_from(args)
    profile = load_profile(args.profile)
    check_live(args.live, profile, args.profile)
    live = read_live(args.live, profile.hidden_size, int(profile.meta.get("skip_first_positions", 1)))
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
                         engine_layers_checked=record_matches)
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
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
        print(report.human())
    return report.exit_code

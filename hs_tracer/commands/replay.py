"""``hs-tracer replay CAPTURE_DIR --draft DIR``: run the draft offline on captured live features.

The standalone drafter test: next-token top-1 agreement of the draft on the features it gets live
vs on its training features, the rewirings of the live features that restore training level, and
the fix in canonical sources and ``eagle_config`` ids. Exit status (docs/interfaces.md): 0 healthy (or not
decidable), 1 miswired, 2 usage or input errors.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "replay",
        help="run the draft offline on captured live features vs its training features",
        description="Load the draft with plain torch, run it on an hs_tracer capture (HS_TRACER_CAPTURE_DIR) "
                    "and on its training data, score next-token top-1 agreement, try slot permutations, "
                    "one-slot shifts and the rewiring the profile's source verdicts suggest, and print the "
                    "wiring that restores training-level agreement.",
    )
    p.add_argument("capture", type=Path, metavar="CAPTURE_DIR", help="hs_tracer capture directory")
    p.add_argument("--draft", type=Path, required=True, help="the draft directory that was served")
    p.add_argument("--target", type=Path, default=None,
                   help="target model dir for the token embedding (default: the path in the capture)")
    p.add_argument("--training-data", type=Path, default=None, metavar="DIR",
                   help="the draft's training dump (SpecForge or speculators layout): sets training level")
    p.add_argument("--profile", type=Path, default=None,
                   help="reference profile: what each captured slot carries, what the draft was trained on")
    p.add_argument("--max-tokens", type=int, default=20000, help="tokens read from each source")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: 1 for small drafts, torch's default otherwise)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from hs_tracer.errors import InputError
    from hs_tracer.inputs.capture import check_capture, check_live
    from hs_tracer.inputs.model_config import check_draft, check_target
    from hs_tracer.inputs.profile import check_fits, load_profile
    from hs_tracer.profile.capture_format import is_capture_dir
    from hs_tracer.replay.analysis import human, replay, to_json_text

    if args.max_tokens <= 0 or (args.threads is not None and args.threads <= 0):
        raise InputError("--max-tokens and --threads take positive numbers")
    if not is_capture_dir(args.capture):
        raise InputError(f"{args.capture} is not an hs_tracer capture (no manifest.json); capture one with "
                         "HS_TRACER_CAPTURE_DIR on the server")
    manifest = check_capture(args.capture, "CAPTURE_DIR")
    check_draft(args.draft, runnable=True)
    if args.target is not None:
        check_target(args.target)
    if args.training_data is not None and not args.training_data.is_dir():
        raise InputError(f"--training-data {args.training_data}", "not a directory",
                         "pass the draft's SpecForge or speculators training dump")
    if args.profile is not None:
        profile = load_profile(args.profile)
        check_fits(profile, f"CAPTURE_DIR {args.capture}", args.profile, hidden_size=manifest.hidden_size,
                   num_layers=manifest.num_layers)
        if args.training_data is not None:
            check_live(args.training_data, profile, args.profile, "--training-data")
    result = replay(args.capture, args.draft, target_dir=args.target, training=args.training_data,
                    profile_path=args.profile, max_tokens=args.max_tokens, threads=args.threads)
    print(to_json_text(result) if args.json else human(result))
    return result.exit_code

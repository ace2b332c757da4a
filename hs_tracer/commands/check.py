"""``hs-tracer check``: what can be seen wrong with a draft before it is served (docs/preflight.md)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hs_tracer import engines


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "check",
        help="preflight: check an EAGLE-3 draft against its target and SGLang serving args",
        description="Static checks of a draft checkpoint, the target config and the serving args, as "
                    "SGLang will load and wire them (the layer-id rules of --sglang-version). Exit 0 "
                    "healthy, 1 critical findings, 2 input errors.",
    )
    p.add_argument("--draft", type=Path, required=True, help="draft directory (config.json + weights)")
    p.add_argument("--target", type=Path, required=True, help="target model directory or its config.json")
    p.add_argument("--profile", type=Path, help="reference profile of the draft's training data "
                   "(compares the engine's sources with the training provenance)")
    p.add_argument("--engine", default=engines.DEFAULT, metavar="ENGINE[==V]",
                   help=f"serving engine, one of {', '.join(engines.names())}; ==V checks against release V "
                        "(sglang==V is --sglang-version V; default the installed release, else the newest "
                        "hs_tracer knows)")
    p.add_argument("--sglang-version", metavar="V", default=None,
                   help="the SGLang release whose layer-id rules say what the draft is fed (default: the "
                        "installed release, else the newest hs_tracer knows)")
    p.add_argument("--server-args", default=None, metavar="ARGS",
                   help="the server's command line or its speculative flags, e.g. "
                        "\"--speculative-algorithm EAGLE3 --speculative-num-steps 3 ...\"")
    p.add_argument("--sglang-resolve", action="store_true",
                   help="resolve the speculative args with the installed SGLang's own pipeline (CPU, "
                        "~30 s) instead of hs_tracer's mirror of it")
    p.add_argument("--json", action="store_true",
                   help="print the report as JSON (docs/interfaces.md; plus a 'preflight' key)")
    p.add_argument("--verbose", action="store_true",
                   help="also list the findings under each root cause, and show the engine's own layer "
                        "numbering (layers_to_capture) and the profile's raw ids beside the canonical "
                        "sources")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    eng, pinned = engines.parse(args.engine)
    result = eng.preflight(args, pinned)
    if args.json:
        out = result.report.to_json()
        out["preflight"] = result.summary
        print(json.dumps(out, indent=2))
    else:
        print(eng.human(result, verbose=args.verbose))
    return result.report.exit_code

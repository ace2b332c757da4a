"""``hs-tracer demo``: real SGLang (EAGLE-3) on CPU with tracing on, and the live diagnosis."""

from __future__ import annotations

import argparse
import pkgutil
import sys
from pathlib import Path

from hs_tracer import engines
from hs_tracer.errors import InputError


def add_parser(sub: argparse._SubParsersAction) -> None:
    from hs_tracer.commands import testbed_installed

    scenarios, defaults = None, []  # without the testbed installed, `run` says how to get it
    if testbed_installed():
        from hs_tracer_testbed.miswire import DEFAULT_SCENARIOS, SCENARIOS

        scenarios, defaults = sorted(SCENARIOS), DEFAULT_SCENARIOS
    p = sub.add_parser(
        "demo", help="run real SGLang with EAGLE-3 on CPU, traced, and print the live diagnosis",
        description="Starts sgl.Engine on the CPU with HS_TRACER=1, sends a workload and prints what "
        "hs_tracer diagnosed inside the scheduler. Without --target it uses the testbed (a tiny trained "
        "DeepSeek-V3 target and its EAGLE-3 draft, built on first use) and also runs a miswired copy of "
        "the draft. Exit status: 0 when the configured draft is healthy and every deliberately miswired "
        "copy was caught (their critical findings are the expected answer), 1 otherwise, 2 for bad input.")
    p.add_argument("--engine", choices=engines.names(), default=engines.DEFAULT,
                   help=f"serving engine (default {engines.DEFAULT}). vllm: real vLLM on CPU (its own venv, "
                   "`make demo ENGINE=vllm`) with the vLLM testbed pair, the configured draft and a copy "
                   "without its layer ids")
    p.add_argument("--real", action="store_true",
                   help="use the real-model pair instead of the tiny testbed: SmolLM2-135M-Instruct "
                        "(Llama, 30 layers) and its EAGLE-3 draft trained here, on held-out real text "
                        "(built on first use: several minutes; later runs reuse it)")
    p.add_argument("--target", type=Path, help="target model dir (default: the testbed's)")
    p.add_argument("--draft", type=Path, help="EAGLE-3 draft dir (default: the testbed's)")
    p.add_argument("--profile", type=Path, help="reference profile (default: built from the testbed data)")
    p.add_argument("--scenario", action="append", choices=scenarios, dest="scenarios",
                   help=f"also run a miswired copy of the draft (repeatable; default with the testbed: "
                   f"{', '.join(defaults)})")
    p.add_argument("--prompts", type=int, default=16, help="number of prompts (default 16)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--json", action="store_true",
                   help="print the diagnoses as JSON (the report keys of docs/interfaces.md)")
    p.add_argument("--verbose", action="store_true",
                   help="show SGLang's own output (by default it goes to a log file named first), the "
                        "findings under each root cause and SGLang's own layer numbering "
                        "(layers_to_capture) beside the canonical sources")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from hs_tracer.commands import TESTBED_MISSING, testbed_installed

    if not testbed_installed():
        raise InputError(TESTBED_MISSING)
    from hs_tracer.inputs.env import require_valid_for
    from hs_tracer.inputs.model_config import check_draft, check_target
    from hs_tracer.inputs.profile import load_profile
    from hs_tracer_testbed import demo

    # The settings the engines will run with, checked here: the plugin would say what is wrong only in
    # SGLang's log, after a minute, with tracing off. The caller's own are checked too, and named
    # where the demo replaces them.
    overrides = {**demo.DEMO_ENV, **({"HS_TRACER_PROFILE": str(args.profile)} if args.profile else {})}
    replaced = {"HS_TRACER_REPORT_DIR": "a temporary folder per engine"}
    if args.profile is None and args.target is None:
        replaced["HS_TRACER_PROFILE"] = "the profile of its own pair's training data"
    _cfg, notes = require_valid_for("hs-tracer demo", overrides, replaced)
    for note in notes:
        print(note, file=sys.stderr)

    if args.target is not None:
        check_target(args.target)
    if args.draft is not None:
        check_draft(args.draft)
    if args.profile is not None:
        load_profile(args.profile)
    if args.prompts < 1 or args.max_new_tokens < 1:
        raise InputError("--prompts and --max-new-tokens take positive numbers")
    if args.target is not None and args.draft is None:
        raise InputError("--target needs --draft (the demo traces EAGLE-3 speculative decoding)")
    harness = demo.HARNESSES.get(args.engine)
    if harness is None:
        raise InputError(f"--engine {args.engine}: the testbed has no demo for this engine")
    return pkgutil.resolve_name(harness)(args)

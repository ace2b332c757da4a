"""``hs-tracer demo``: real SGLang on CPU with the testbed models and tracing on."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="run real SGLang on CPU with tracing on and print what hs_tracer saw")
    p.add_argument("--target", type=Path, help="target model dir (default: the testbed's tiny DeepSeek-V3)")
    p.add_argument("--draft", type=Path, help="EAGLE-3 draft dir (default: the testbed's draft)")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from hs_tracer import demo
    from hs_tracer.cli import UsageError

    for name in ("target", "draft"):
        path = getattr(args, name)
        if path is not None and not (path / "config.json").is_file():
            raise UsageError(f"--{name} {path}: no config.json there; pass a Hugging Face model directory")
    result = demo.run(args.target, args.draft, max_new_tokens=args.max_new_tokens)
    print(json.dumps(result.to_json(), indent=2) if args.json else demo.human(result))
    return 0

"""``hs-tracer``: one entry point, one module per sub-command under :mod:`hs_tracer.commands`.

Each command module defines ``add_parser(subparsers)`` and sets ``func`` on its parser; the module
must import only the standard library at top level so ``hs-tracer --help`` stays instant. Exit
status (DESIGN §5.3): 0 healthy, 1 critical findings, 2 usage or input errors.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Order here is the order in --help.
COMMANDS = ("demo", "profile", "diagnose", "check", "replay", "testbed", "dashboards")


class UsageError(Exception):
    """A problem with the user's input: printed as one line with the fix, exit status 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hs-tracer",
        description="Trace and diagnose the hidden-state features SGLang feeds an EAGLE-3 draft model.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"hs_tracer.commands.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"hs_tracer.commands.{name}":
                raise
            continue  # command not shipped in this build
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except UsageError as exc:
        print(f"hs-tracer {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

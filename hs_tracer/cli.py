"""``hs-tracer``: one entry point, one module per sub-command under :mod:`hs_tracer.commands`.

Each command module defines ``add_parser(subparsers)`` and sets ``func`` on its parser; the module
must import only the standard library at top level so ``hs-tracer --help`` stays instant. Exit
status (docs/interfaces.md): 0 healthy, 1 critical findings, 2 usage or input errors. Only
:class:`~hs_tracer.errors.InputError` (and a path the system refuses) counts as bad input; any other
exception is a defect of hs_tracer, reported as an internal error with exit status 1.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib
import os
import sys
import traceback
from typing import NoReturn

from hs_tracer.errors import InputError

# Order here is the order in --help.
COMMANDS = ("demo", "profile", "diagnose", "check", "replay", "testbed", "dashboards")

# Where a user reports an internal error.
BUG_REPORT = "a bug in hs_tracer, not in your input: please report it with the traceback --debug prints"


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors on one line (the usage is one ``--help`` away)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="hs-tracer",
        description="Trace and diagnose the hidden-state features SGLang feeds an EAGLE-3 draft model.",
    )
    parser.add_argument("--debug", action="store_true",
                        help="show the Python traceback behind an error message")
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
    except InputError as exc:
        return _fail(args, str(exc), exc)
    except OSError as exc:
        if isinstance(exc, BrokenPipeError) or exc.errno == errno.EPIPE:
            return _closed_pipe()
        # A path the user gave cannot be read or written (permissions, too long, a full disk).
        where = f"{exc.filename}: " if exc.filename else ""
        return _fail(args, f"{where}{exc.strerror or exc}; check the path and its permissions", exc)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # a defect of hs_tracer, not of the input: say so, and how to report it
        return _fail(args, f"internal error ({type(exc).__name__}: {exc}); {BUG_REPORT}", exc, status=1)


def _fail(args: argparse.Namespace, message: str, exc: BaseException, status: int = 2) -> int:
    if args.debug:
        traceback.print_exception(exc)
    with contextlib.suppress(OSError):
        print(f"hs-tracer {args.command}: error: {' '.join(message.split())}", file=sys.stderr)
    return status


def _closed_pipe() -> int:
    """The reader of our output went away (``| head``): stop quietly, as command-line tools do."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())  # so the interpreter's final flush does not fail again
    return 141  # 128 + SIGPIPE, what a shell reports for a tool killed by the closed pipe


if __name__ == "__main__":
    sys.exit(main())

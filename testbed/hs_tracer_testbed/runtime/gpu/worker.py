"""One ``sgl.Engine`` driven over stdin/stdout by :class:`.launcher.EngineWorker`.

Arguments are SGLang's own command-line arguments (``prepare_server_args``). Requests arrive as JSON
lines on stdin (``{"op": "generate", "kwargs": {...}}`` or ``{"op": "quit"}``); each answer is one
line on a private copy of stdout, prefixed with ``launcher.REPLY``. Everything else this process and
SGLang's children print goes to stderr (the caller's log), so it cannot be mistaken for an answer.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from typing import Any, TextIO

from hs_tracer_testbed.runtime.gpu.launcher import REPLY


def _answer(out: TextIO, **reply: Any) -> None:
    out.write(REPLY + json.dumps(reply, default=str) + "\n")
    out.flush()


def main(argv: list[str]) -> int:
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # SGLang and its children print to fd 1: send that to the log
    sys.stdout = sys.stderr
    from sglang.srt.entrypoints.engine import Engine
    from sglang.srt.server_args import prepare_server_args

    engine = Engine(server_args=prepare_server_args(argv))
    _answer(out, result="ready")
    try:
        for line in sys.stdin:
            msg = json.loads(line)
            if msg.get("op") == "quit":
                break
            try:
                _answer(out, result=engine.generate(**msg["kwargs"]))
            except Exception as exc:
                _answer(out, error=f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-2000:]}")
    finally:
        engine.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

"""The CPU testbed's forkserver (hs_tracer_testbed.runtime.forkserver): what a child forked from it
differs in from a spawned one is undone. The engine tests run every engine's processes through it."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
from multiprocessing import context
from pathlib import Path

import pytest

from hs_tracer_testbed.runtime import forkserver

TESTBED = str(Path(__file__).resolve().parents[1] / "testbed")


def _report(queue: multiprocessing.Queue) -> None:
    queue.put((os.environ.get("FORKSERVER_TEST_VALUE"), signal.getsignal(signal.SIGQUIT) == signal.SIG_DFL))


def test_a_forked_child_gets_the_launchers_environment_at_its_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(context.ForkServerProcess, "_Popen", staticmethod(forkserver._popen))
    ctx = multiprocessing.get_context("forkserver")
    queue = ctx.Queue()
    seen = []
    for value in ("first", "second"):  # the second child comes from the server the first one started
        monkeypatch.setenv("FORKSERVER_TEST_VALUE", value)
        proc = ctx.Process(target=_report, args=(queue,))
        proc.start()
        seen.append(queue.get(timeout=60))
        proc.join(timeout=60)
    assert seen == [("first", True), ("second", True)]


def test_the_server_passes_sigquit_on_to_its_parent() -> None:
    child = ("import os, signal, time; import hs_tracer_testbed.runtime.forkserver_signals; "
             "os.kill(os.getpid(), signal.SIGQUIT); time.sleep(1)")
    parent = ("import signal, subprocess, sys; got = []; "
              "signal.signal(signal.SIGQUIT, lambda *a: got.append(1)); "
              f"subprocess.run([sys.executable, '-c', {child!r}], check=True); print(len(got))")
    path = os.pathsep.join([TESTBED, os.environ.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", parent], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": path})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "1"

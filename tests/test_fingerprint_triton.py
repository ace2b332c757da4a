"""Runs the Triton-interpreter cases (tests/triton_interpreter_cases.py) in a fresh interpreter.

TRITON_INTERPRET=1 must be set before Triton is first imported, and the main test process imports
Triton earlier, through SGLang; engine subprocesses must not inherit the flag. So these cases get a
process of their own.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

CASES = Path(__file__).with_name("triton_interpreter_cases.py")


def test_kernel_in_the_triton_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", str(CASES), "-q", "-p", "no:cacheprovider"],
                          env=env, capture_output=True, text=True, timeout=900,
                          cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout

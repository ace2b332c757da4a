"""The real draft-training tools, run on the CPU against the real SmolLM2 target.

Why: hs_tracer reads what SpecForge and speculators write; the testbed's own writers of their
layouts (:mod:`hs_tracer_testbed.dumps`) are only as right as the reading of their sources. Here the
tools themselves capture, train and export a tiny draft, each in its own virtualenv (their pins clash
with the project's), with the CPU glue each needs kept in its module beside a check of whether a
release still needs it.

Shared here: the layer virtualenvs and the glue records.
"""

from __future__ import annotations

import hashlib
import importlib
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


@dataclass(frozen=True)
class Glue:
    """One CPU change to a tool: what it replaces (``module:attribute``, or a note when it is an
    argument or a file, not a patch) and a probe saying whether the installed release still needs it."""

    name: str
    target: str
    needed: Callable[[], bool]

    def status(self) -> str:
        """``needed``, ``not needed`` (the release no longer calls what it replaces) or ``breaks: ...``
        (what it replaces is gone, so the glue must change)."""
        if ":" in self.target:
            module, attr = self.target.split(":")
            try:
                if not hasattr(importlib.import_module(module), attr):
                    return f"breaks: {self.target} is gone"
            except ImportError as exc:
                return f"breaks: {exc}"
        return "needed" if self.needed() else "not needed"


def layer_venv(name: str, requirements: Path, base_python: str | None = None) -> Path:
    """``REPO/name``: a virtualenv layered over ``base_python``'s (default: this interpreter's)
    site-packages with the pins of ``requirements`` installed ``--no-deps`` on top; rebuilt when the
    pins change. Returns its python."""
    from hs_tracer_testbed.build import _locked

    venv = REPO / name
    python = venv / "bin" / "python"
    base = base_python or sys.executable
    stamp_text = hashlib.sha256(requirements.read_bytes() + base.encode()).hexdigest()
    stamp = venv / ".installed"
    if stamp.exists() and stamp.read_text() == stamp_text:
        return python
    with _locked(REPO / f"{name}.lock"):  # beside the venv, ignored with it
        if stamp.exists() and stamp.read_text() == stamp_text:
            return python
        if not python.exists():
            subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
        ask = "import sysconfig; print(sysconfig.get_path('purelib'))"
        base_lib, own_lib = (
            subprocess.run([py, "-c", ask], check=True, capture_output=True, text=True).stdout.strip()
            for py in (base, str(python))
        )
        pth = f"import site; site.addsitedir({base_lib!r})\n"
        Path(own_lib, "zz_hs_tracer_base_layer.pth").write_text(pth)
        subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                        "--no-deps", "--no-compile", "-r", str(requirements)], check=True)
        stamp.write_text(stamp_text)
    return python


def tool_env(threads: int = 1) -> dict[str, str]:
    """The environment of a tool process: the repo and testbed importable, one thread."""
    import os

    env = dict(os.environ)
    env["PYTHONPATH"] = f"{REPO}:{REPO / 'testbed'}"
    env["OMP_NUM_THREADS"] = str(threads)
    return env


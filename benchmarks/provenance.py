"""The source a benchmark ran: its commit and whether the tree had uncommitted changes.

A result file is only evidence for the code that produced it. ``source_state`` asks git, unless the
caller names the commit in ``BENCH_SOURCE_COMMIT`` (and ``BENCH_SOURCE_DIRTY=0/1``), read on
the machine that has the repository: a working tree copied to a remote machine may arrive without
its ``.git`` or with an older one. (Not an ``HS_TRACER_`` name: hs_tracer refuses settings it does not
know, and engines inherit the benchmark's environment.) Nothing is guessed: an unknown commit is
``None``.
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

COMMIT_ENV = "BENCH_SOURCE_COMMIT"
DIRTY_ENV = "BENCH_SOURCE_DIRTY"


def _git(root: Path, *args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def source_state(root: Path, env: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """``{"commit", "dirty", "from"}`` for the checkout at ``root``: what the caller declared in the
    environment (a copied tree can carry a stale ``.git``: its files are the caller's, its HEAD is
    not), else git's, else unknown (``None``)."""
    if env.get(COMMIT_ENV):
        dirty = env.get(DIRTY_ENV)
        return {"commit": env[COMMIT_ENV], "dirty": None if dirty is None else dirty == "1",
                "from": COMMIT_ENV}
    commit = _git(root, "rev-parse", "HEAD")
    if commit is not None:
        status = _git(root, "status", "--porcelain", "--untracked-files=no")
        return {"commit": commit.strip(), "dirty": None if status is None else bool(status.strip()),
                "from": "git"}
    return {"commit": None, "dirty": None, "from": None}


def header(root: Path) -> dict[str, Any]:
    """The provenance keys a CPU benchmark's result starts with: source, UTC date, machine."""
    return {
        "source": source_state(root),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "cpus": os.cpu_count(), "python": platform.python_version()},
    }

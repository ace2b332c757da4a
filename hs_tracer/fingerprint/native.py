"""The probe's one C helper (``graph_replay.c``), compiled on first use, as Triton compiles its own
launchers: with the C compiler and Python headers of the machine, into a per-user cache.

Why C at all: the probe replays a one-kernel graph every decode step on SGLang's scheduler thread,
and through ctypes and torch's binding the capture check and the launch cost the scheduler thread
~1.8 µs more than one C call making both (benchmarks/graph_launch_gpu.py on an H200 host; 0.4-0.8 µs
of the launch hook in benchmarks/hook_overhead.py). Why compiled here and not shipped: the extension has
to match the serving interpreter, and the machines that run the probe already compile C for Triton.

:func:`load` never raises: without a compiler or headers, or if the build fails, it returns None
and the probe launches through ctypes instead (one log line says why).
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from types import ModuleType

logger = logging.getLogger("hs_tracer")

SOURCE = Path(__file__).with_name("graph_replay.c")
MODULE = "hs_tracer_graph_replay"
_loaded: dict[Path, ModuleType | None] = {}


def cache_dir() -> Path:
    """Where built extensions are kept: ``$XDG_CACHE_HOME/hs_tracer`` (``~/.cache/hs_tracer``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hs_tracer"


def built_path(directory: Path) -> Path:
    """The extension's file for this source and interpreter (a new name whenever either changes, so
    a cached file is never rebuilt in place)."""
    digest = hashlib.sha256(SOURCE.read_bytes() + sys.version.encode()).hexdigest()[:16]
    return directory / f"{MODULE}-{digest}{sysconfig.get_config_var('EXT_SUFFIX') or '.so'}"


def load(directory: Path | None = None) -> ModuleType | None:
    """The compiled helper (built into ``directory``, default :func:`cache_dir`, if not there yet),
    or None where it cannot be built."""
    target = built_path(directory or cache_dir())
    if target not in _loaded:
        _loaded[target] = _load(target)
    return _loaded[target]


def _load(target: Path) -> ModuleType | None:
    try:
        if not target.exists():
            _build(target)
        spec = importlib.util.spec_from_file_location(
            MODULE, target, loader=importlib.machinery.ExtensionFileLoader(MODULE, str(target)))
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    except (OSError, ImportError, subprocess.SubprocessError, AssertionError) as exc:
        logger.info("hs_tracer: the C graph-replay helper is not available (%s); the probe launches "
                    "through ctypes (~1 µs more per step)", exc)
        return None


def _build(target: Path) -> None:
    """Compile into a fresh temporary file beside ``target``, then rename it into place (atomic: a
    concurrent build of another process leaves one complete file)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise OSError("no C compiler (cc or gcc) on PATH")
    include = sysconfig.get_paths()["include"]
    if not Path(include, "Python.h").exists():
        raise OSError(f"no Python headers in {include} (install the python3-dev package)")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{MODULE}-", suffix=".so")
    os.close(fd)
    try:
        done = subprocess.run([cc, "-O2", "-shared", "-fPIC", f"-I{include}", str(SOURCE), "-o", tmp],
                              capture_output=True, text=True, timeout=120)
        if done.returncode:
            why = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
            raise OSError(f"{cc} failed: {why}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)  # our own temporary file: the build failed before the rename

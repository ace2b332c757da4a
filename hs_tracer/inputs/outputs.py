"""Outputs: checked before any work, never over an input (written by :mod:`hs_tracer.atomic_file`).

The tool never writes over one of its own inputs and never replaces a directory.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from hs_tracer.errors import InputError


def _same(a: Path, b: Path) -> bool:
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def check_output(path: Path, flag: str, inputs: Iterable[Path] = ()) -> Path:
    """Refuse an output path that cannot be written or that would replace an input. Returns it."""
    path = Path(path)
    where = f"{flag} {path}"
    parent = path.parent if str(path.parent) else Path(".")
    try:
        name_max = os.pathconf(parent if parent.is_dir() else ".", "PC_NAME_MAX")
    except (OSError, ValueError):
        name_max = 255
    if len(os.fsencode(path.name)) > name_max:
        raise InputError(where, f"file name is longer than {name_max} bytes", "choose a shorter name")
    if not parent.is_dir():
        raise InputError(where, f"directory {parent} does not exist", "create it first or pick another path")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise InputError(where, f"directory {parent} is not writable", "pick a directory you can write to")
    if path.is_dir():
        raise InputError(where, "is a directory", "name the file to write, e.g. DIR/profile.safetensors")
    if path.is_symlink() or (path.exists() and not path.is_file()):
        raise InputError(where, "exists and is not a regular file", "pick another path")
    for inp in inputs:
        inp = Path(inp)
        if _same(path, inp) or path.resolve() == inp.resolve():
            raise InputError(where, f"is also an input ({inp})",
                             "write the result to a new file; an input is never overwritten")
        if inp.is_dir() and path.exists() and path.resolve().is_relative_to(inp.resolve()):
            raise InputError(where, f"is a file inside the input directory {inp}",
                             "write the result outside the input")
    return path

"""Small checks shared by the input modules."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hs_tracer.errors import InputError
from hs_tracer.preflight.safetensors_header import SafetensorsError, TensorEntry, read_header


def is_int(v: Any, minimum: int | None = None) -> bool:
    return type(v) is int and (minimum is None or v >= minimum)


def str_list(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(s, str) for s in v)


def safetensors_table(path: Path, what: str, fix: str) -> dict[str, TensorEntry]:
    """The checked tensor table of a safetensors file, or an input error naming it."""
    try:
        tensors, _ = read_header(path)
    except SafetensorsError as exc:
        raise InputError(what, str(exc).removeprefix(f"{path}: "), fix) from None
    except OSError as exc:
        raise InputError(what, f"cannot read it ({exc.strerror or exc})", fix) from None
    return tensors

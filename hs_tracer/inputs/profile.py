"""Reference profiles (``--profile``, ``HS_TRACER_PROFILE``, ``profile merge`` inputs).

The file is checked as safetensors first (offsets, sizes), then its provenance and every tensor's
shape against ``num_slots`` x ``hidden_size``, so diagnosis never meets a profile it cannot use.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from hs_tracer.errors import InputError
from hs_tracer.inputs._common import is_int, safetensors_table, str_list
from hs_tracer.profile.model import OTHER_MODEL_FIX, other_model

if TYPE_CHECKING:
    from hs_tracer.profile.model import Profile

REBUILD = "rebuild it with `hs-tracer profile build`"


def load_profile(path: str | Path, flag: str = "--profile") -> Profile:
    """The profile at ``path``, fully checked; :class:`InputError` naming ``flag`` and the file otherwise."""
    from hs_tracer.profile.model import Profile, ProfileError

    path = Path(path)
    what = f"{flag} {path}" if flag else str(path)
    if not path.is_file():
        raise InputError(what, "no such file" if not path.exists() else "not a regular file",
                         "build a profile with `hs-tracer profile build`")
    safetensors_table(path, what, f"not a valid profile file; {REBUILD}")
    try:
        profile = Profile.load(path)
    except ProfileError as exc:
        raise InputError(what, str(exc).removeprefix(f"{path}: "), REBUILD) from None
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        problem = f"unreadable profile metadata ({type(exc).__name__}: {exc})"
        raise InputError(what, problem, REBUILD) from None
    problem = _problem(profile)
    if problem:
        raise InputError(what, problem, REBUILD)
    return profile


def _problem(p: Profile) -> str | None:
    """What is inconsistent in a loaded profile, or None."""
    m = p.meta
    if not isinstance(m, dict):
        return "provenance is not a JSON object"
    for key in ("num_slots", "hidden_size"):
        if not is_int(m.get(key), 1):
            return f"{key} is {m.get(key)!r}, not a positive integer"
    for key in ("tokens", "records"):
        if not is_int(m.get(key), 0):
            return f"{key} is {m.get(key)!r}, not a non-negative integer"
    if not is_int(m.get("piece_tokens"), 1) or not is_int(m.get("max_pieces"), 0):
        return "piece_tokens/max_pieces are missing or not integers"
    if not is_int(m.get("skip_first_positions", 1), 0):
        return "skip_first_positions is not a non-negative integer"
    if not isinstance(m.get("producer"), str):
        return "producer is missing"
    k, h = m["num_slots"], m["hidden_size"]
    if not str_list(m.get("sources")) or len(m["sources"]) != k:
        return f"sources {m.get('sources')!r} is not a list of {k} source names"
    if m.get("num_layers") is not None and not is_int(m.get("num_layers"), 1):
        return f"num_layers is {m.get('num_layers')!r}, not a positive integer"
    if p.slots is None:
        return "holds no slots.* statistics"
    groups = [("slots", p.slots, k)]
    for name, named in (("extras", p.extras), ("atlas", p.atlas)):
        if named is not None:
            if not str_list(named.names):
                return f"{name} source names are not a list of strings"
            groups.append((name, named.stats, len(named.names)))
    for name, stats, rows in groups:
        for field in ("count", "sum", "sumsq"):
            arr = getattr(stats, field)
            if not isinstance(arr, np.ndarray) or arr.shape != (rows, h) or arr.dtype.kind != "f":
                return (f"{name}.{field} has shape {getattr(arr, 'shape', None)}, expected "
                        f"[{rows}, {h}] floats")
            if not np.isfinite(arr).all():
                return f"{name}.{field} holds non-finite values"
        if (stats.count < 0).any() or (stats.sumsq < 0).any():
            return f"{name} holds negative counts or sums of squares"
    atlas = m.get("atlas")
    if atlas is not None and not (isinstance(atlas, dict) and is_int(atlas.get("tokens"), 0)):
        return "atlas provenance lacks its token count"
    pieces = p.pieces
    if set(pieces) != {"keys", "tokens", "sum", "sumsq"}:
        return f"calibration pieces hold {sorted(pieces)}, expected keys, tokens, sum, sumsq"
    n = pieces["keys"].shape[0] if pieces["keys"].ndim == 1 else -1
    if n < 0 or pieces["tokens"].shape != (n,) or any(pieces[f].shape != (n, k, h) for f in ("sum", "sumsq")):
        return f"calibration pieces are not [M] keys/tokens and [M, {k}, {h}] sums"
    if pieces["keys"].dtype.kind not in "iu" or pieces["tokens"].dtype.kind not in "iu" \
            or (pieces["tokens"] < 0).any():
        return "calibration piece keys/tokens are not non-negative integers"
    if not all(np.isfinite(pieces[f]).all() for f in ("sum", "sumsq")):
        return "calibration pieces hold non-finite values"
    try:
        json.dumps(m)
    except (TypeError, ValueError):
        return "provenance is not plain JSON"
    return None


def check_fits(profile: Profile, what: str, profile_path: Path | str, *, hidden_size: int | None,
               num_layers: int | None = None, draft_vocab: int | None = None) -> None:
    """:func:`other_model` as an input error naming ``what`` (the target, the capture) and the profile."""
    problem = other_model(profile.meta, hidden_size=hidden_size, num_layers=num_layers,
                          draft_vocab=draft_vocab)
    if problem:
        raise InputError(f"{what} and the profile {profile_path}", problem, OTHER_MODEL_FIX)


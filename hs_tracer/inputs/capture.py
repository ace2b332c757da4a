"""hs_tracer capture directories (``diagnose``, ``replay``, ``profile build`` inputs).

The manifest is checked field by field, every shard path must be a plain file inside the capture
directory (no ``..``, absolute paths or symlinks), and every shard's safetensors table is checked
against its manifest entry before any tensor is read, so a damaged capture is an input error naming
the file rather than a wrong verdict or a traceback.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from hs_tracer.errors import InputError
from hs_tracer.inputs._common import is_int, safetensors_table, str_list
from hs_tracer.profile import capture_format as cf

if TYPE_CHECKING:
    from hs_tracer.profile.model import Profile

RECAPTURE = "capture again with HS_TRACER_CAPTURE_DIR pointing at an empty directory"
_FLOATS = {"F16", "BF16", "F32", "F64"}
_INTS = {"I64", "I32"}


def check_capture(path: str | Path, what: str = "capture") -> cf.CaptureManifest:
    """The checked manifest of the capture at ``path``."""
    path = Path(path)
    where = f"{what} {path}"
    try:
        manifest = cf.read_manifest(path)
    except ValueError as exc:
        raise InputError(where, str(exc), RECAPTURE) from None
    problem = _manifest_problem(manifest)
    if problem:
        raise InputError(f"{where}/{cf.MANIFEST}", problem, RECAPTURE)
    width = None
    for entry in manifest.shards:
        try:
            file = cf.shard_file(path, entry)
        except ValueError as exc:
            raise InputError(where, str(exc), RECAPTURE) from None
        if not file.is_file():
            raise InputError(file, "listed in the manifest but missing", RECAPTURE)
        table = safetensors_table(file, str(file), RECAPTURE)
        width = _shard_problem(file, table, entry, width)
    return manifest


def _manifest_problem(m: cf.CaptureManifest) -> str | None:
    if m.num_slots < 1 or m.hidden_size < 1:
        return f"num_slots {m.num_slots} and hidden_size {m.hidden_size} must be positive"
    if m.sources is not None and (not str_list(m.sources) or len(m.sources) != m.num_slots):
        return f"sources {m.sources!r} is not a list of {m.num_slots} source names"
    if m.layers_to_capture is not None and not (
            isinstance(m.layers_to_capture, list) and all(is_int(v) for v in m.layers_to_capture)):
        return f"layers_to_capture {m.layers_to_capture!r} is not a list of integers"
    if m.num_layers is not None and not is_int(m.num_layers, 1):
        return f"num_layers {m.num_layers!r} is not a positive integer"
    for key in ("target_arch", "model", "target_path", "engine", "engine_version", "rows"):
        if getattr(m, key) is not None and not isinstance(getattr(m, key), str):
            return f"{key} {getattr(m, key)!r} is not a string"
    if m.sample_rate is not None and not (isinstance(m.sample_rate, (int, float))
                                          and 0 <= m.sample_rate <= 1):
        return f"sample_rate {m.sample_rate!r} is not a fraction"
    if m.next_shard is not None and not is_int(m.next_shard, 0):
        return f"next_shard {m.next_shard!r} is not a non-negative integer"
    names = [s["file"] for s in m.shards]
    if len(set(names)) != len(names):
        return "a shard file is listed twice"
    for s in m.shards:
        if not is_int(s.get("tokens", 0), 0):
            return f"shard {s['file']} has token count {s.get('tokens')!r}"
    w = m.wiring
    if w is not None:
        if not isinstance(w, dict):
            return "wiring is not a JSON object"
        # One capture holds one wiring: the record of how the engine was wired must match the manifest.
        for key, value in (("sources", m.sources), ("hidden_size", m.hidden_size),
                           ("layers_to_capture", m.layers_to_capture), ("num_layers", m.num_layers)):
            if key in w and value is not None and w[key] != value:
                return f"wiring {key} {w[key]!r} disagrees with the manifest's {value!r} (mixed wirings)"
    return None


def _shard_problem(file: Path, table: dict[str, Any], entry: dict[str, Any], width: int | None) -> int:
    feats = table.get("features")
    if feats is None or len(feats.shape) != 2 or feats.dtype not in _FLOATS:
        raise InputError(file, "no 2-D float 'features' tensor", RECAPTURE)
    n, w = feats.shape
    if "tokens" in entry and entry["tokens"] != n:
        raise InputError(file, f"holds {n} rows, the manifest says {entry['tokens']}", RECAPTURE)
    if width is not None and n and w != width:
        raise InputError(file, f"features are {w} wide, earlier shards {width}: one capture directory "
                         "holds one wiring", RECAPTURE)
    for key in ("input_ids", "positions"):
        t = table.get(key)
        if t is not None and (t.shape != (n,) or t.dtype not in _INTS):
            raise InputError(file, f"'{key}' is not [{n}] integers", RECAPTURE)
    for key, t in table.items():
        if key not in ("features", "input_ids", "positions") and (len(t.shape) != 1 or t.dtype not in _INTS):
            raise InputError(file, f"'{key}' is not a 1-D integer tensor", RECAPTURE)
    ext = table.get("extend_lens")
    if ext is not None and n and ext.numel == 0:
        raise InputError(file, "extend_lens is empty but the shard has rows", RECAPTURE)
    return w if n else (width if width is not None else w)


def check_live(path: str | Path, profile: Profile, profile_path: Path, what: str = "LIVE") -> None:
    """A capture or training dump to judge against ``profile``: readable, and of the profile's model."""
    from hs_tracer.inputs.profile import check_fits
    from hs_tracer.profile import readers

    path = Path(path)
    where = f"{what} {path}"
    if not path.exists():
        raise InputError(where, "no such file or directory", "pass a capture, SpecForge or speculators dir")
    num_layers = None
    if cf.is_capture_dir(path):
        manifest = check_capture(path, what)
        hidden: int | None = manifest.hidden_size
        num_layers = manifest.num_layers
    else:
        try:
            hidden = readers.detect(path).layout().hidden_size
        except (readers.LayoutError, ValueError, OSError) as exc:
            raise InputError(where, str(exc), "pass a capture, SpecForge or speculators dir") from None
    check_fits(profile, where, profile_path, hidden_size=hidden, num_layers=num_layers)

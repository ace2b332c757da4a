"""Target configs and draft checkpoints (``check``, ``replay``, ``profile build``, ``demo``).

``config.json`` must be a JSON object whose known keys have the types Hugging Face and SGLang
expect (a string where a number belongs is an input error here, not a traceback later), and every
safetensors weight file of a draft must pass the format checks (a download cut short is caught).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hs_tracer.errors import InputError
from hs_tracer.inputs._common import is_int, safetensors_table, str_list

_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "architectures": (lambda v: str_list(v) and len(v) > 0, "a non-empty list of class names"),
    "hidden_size": (lambda v: is_int(v, 1), "a positive integer"),
    "num_hidden_layers": (lambda v: is_int(v, 1), "a positive integer"),
    "num_attention_heads": (lambda v: is_int(v, 1), "a positive integer"),
    "num_key_value_heads": (lambda v: is_int(v, 1), "a positive integer"),
    "intermediate_size": (lambda v: is_int(v, 1), "a positive integer"),
    "vocab_size": (lambda v: is_int(v, 1), "a positive integer"),
    "draft_vocab_size": (lambda v: is_int(v, 1), "a positive integer"),
    "target_hidden_size": (lambda v: is_int(v, 1), "a positive integer"),
    "eagle_aux_hidden_state_layer_ids": (
        lambda v: isinstance(v, list) and all(is_int(i) for i in v), "a list of integers"),
    "eagle_config": (lambda v: isinstance(v, dict), "a JSON object"),
    "text_config": (lambda v: isinstance(v, dict), "a JSON object"),
    "transformer_layer_config": (lambda v: isinstance(v, dict), "a JSON object"),
    "head_dim": (lambda v: is_int(v, 1), "a positive integer"),
    "num_aux_hidden_states": (lambda v: is_int(v, 1), "a positive integer"),
    "rms_norm_eps": (lambda v: _number(v) and v > 0, "a positive number"),
    "rope_theta": (lambda v: _number(v) and v > 0, "a positive number"),
    "rope_parameters": (lambda v: isinstance(v, dict), "a JSON object"),
    "rope_scaling": (lambda v: isinstance(v, dict), "a JSON object"),
    "use_aux_hidden_state": (lambda v: isinstance(v, bool), "true or false"),
    "norm_output": (lambda v: isinstance(v, bool), "true or false"),
    "torch_dtype": (lambda v: isinstance(v, str), "a string"),
    "model_type": (lambda v: isinstance(v, str), "a string"),
}
_NESTED = ("text_config", "eagle_config", "transformer_layer_config")
# What the plain-torch draft (replay) needs stated, beyond what SGLang's defaults fill in.
_DRAFT_DIMS = ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _config_file(path: Path, what: str, kind: str) -> Path:
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise InputError(what, f"no {kind} config.json there",
                         "pass the Hugging Face model directory (config.json + weights) or its config.json")
    return path


def read_config(path: str | Path, flag: str, kind: str) -> dict[str, Any]:
    """``config.json`` of a model directory (or the file itself), checked for JSON and key types."""
    path = Path(path)
    what = f"{flag} {path}"
    file = _config_file(path, what, kind)
    where = f"{flag} {file}" if file != path else what
    try:
        raw = json.loads(file.read_bytes())
    except (ValueError, UnicodeDecodeError) as exc:
        raise InputError(where, f"not valid JSON ({exc})", f"restore the {kind}'s config.json") from None
    if not isinstance(raw, dict):
        raise InputError(where, "does not hold a JSON object", f"restore the {kind}'s config.json")
    for scope, obj in (("", raw), *((f"{k}.", raw.get(k)) for k in _NESTED)):
        if not isinstance(obj, dict):
            continue
        for key, (ok, expected) in _RULES.items():
            if key in obj and obj[key] is not None and not ok(obj[key]):
                raise InputError(where, f"{scope}{key} is {obj[key]!r}, expected {expected}",
                                 f"fix the {kind}'s config.json")
    return raw


def check_target(path: str | Path, flag: str = "--target") -> dict[str, Any]:
    """The target's config: its depth and width must be stated (top level or ``text_config``)."""
    raw = read_config(path, flag, "target")
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    if not (is_int(text.get("num_hidden_layers"), 1) and is_int(text.get("hidden_size"), 1)):
        raise InputError(f"{flag} {path}", "config.json states no num_hidden_layers / hidden_size",
                         "pass the target model's directory, not the draft's or a tokenizer's")
    return raw


def check_draft(path: str | Path, flag: str = "--draft", runnable: bool = False) -> dict[str, Any]:
    """The draft checkpoint directory: config.json checked, every safetensors weight file checked;
    ``runnable``: the draft will be run (replay), so its dimensions must be stated."""
    path = Path(path)
    if not path.is_dir():
        raise InputError(f"{flag} {path}", "not a directory", "pass the draft's checkpoint directory")
    raw = read_config(path, flag, "draft")
    if runnable:
        missing = [k for k in _DRAFT_DIMS if k not in raw]
        if missing:
            raise InputError(f"{flag} {path}", f"config.json lacks {', '.join(missing)}",
                             "pass an EAGLE-3 draft exported by SpecForge/SGLang (LlamaForCausalLMEagle3)")
    for file in sorted(path.glob("*.safetensors")):
        safetensors_table(file, f"{flag} {file}", "re-download or re-export the draft weights")
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            data = json.loads(index.read_bytes())
            ok = isinstance(data, dict) and isinstance(data.get("weight_map"), dict)
        except (ValueError, UnicodeDecodeError):
            ok = False
        if not ok:
            raise InputError(f"{flag} {index}", "not a safetensors index (no weight_map object)",
                             "re-download or re-export the draft")
    return raw

"""The draft's normalisation flags as its config writes them (nested in ``eagle_config`` or at the top
level): what a profile records as trained and what the diagnosis compares with what SGLang serves."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

FLAGS = ("norm_before_fc", "fc_norm", "norm_output", "norm_before_residual")


def written_flags(cfg: Mapping[str, Any]) -> dict[str, bool]:
    """Each flag as the config states it, wherever the writer put it (nested or top level)."""
    nested = cfg.get("eagle_config") if isinstance(cfg.get("eagle_config"), dict) else {}
    out = {}
    for flag in FLAGS:
        names = (flag, "use_aux_norm") if flag == "fc_norm" else (flag,)
        out[flag] = any(bool(nested.get(n)) or bool(cfg.get(n)) for n in names)
    return out

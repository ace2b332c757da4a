"""Real EAGLE-3 misconfigurations, made the way they happen: by editing the draft's config.json.

Each scenario copies a draft directory and changes only its ``config.json``; the weights are
shared by symlink. SGLang then silently feeds the draft other features, which is what hs_tracer
must catch. Used by the demo and the end-to-end tests (docs/testbed.md lists them).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

Edit = Callable[[dict[str, Any]], None]


def _aux_off(cfg: dict[str, Any]) -> None:
    """``use_aux_hidden_state: false``: SGLang captures nothing, the draft gets one H-wide state and
    silently skips its fc."""
    cfg["eagle_config"]["use_aux_hidden_state"] = False


def _ids_top_level(cfg: dict[str, Any]) -> None:
    """Layer ids at the top level (speculators/vLLM style): SGLang reads only ``eagle_config`` and
    silently falls back to its default layers."""
    cfg["eagle_aux_hidden_state_layer_ids"] = cfg["eagle_config"].pop("eagle_aux_hidden_state_layer_ids")


def _ids_shifted(cfg: dict[str, Any]) -> None:
    """Every id one lower, e.g. after converting between the C_in and C_out conventions the wrong
    way: with the first id no longer 1, SGLang's DeepSeek rule stops adding 1, so every slot moves
    two blocks earlier, and an id of 0 puts the embedding in slot 0."""
    ids = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [i - 1 for i in ids]


SCENARIOS: dict[str, Edit] = {
    "aux_off": _aux_off,
    "ids_top_level": _ids_top_level,
    "ids_shifted": _ids_shifted,
}


def describe(name: str) -> str:
    doc = SCENARIOS[name].__doc__ or ""
    return " ".join(doc.split())


def write_variant(draft: Path, out: Path, scenario: str) -> Path:
    """Copy ``draft`` to ``out`` with the scenario's config edit; weight files are symlinked."""
    if scenario not in SCENARIOS:
        raise ValueError(f"unknown scenario {scenario!r}; choose one of {', '.join(SCENARIOS)}")
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for item in draft.iterdir():
        if item.name != "config.json":
            (out / item.name).symlink_to(item.resolve())
    cfg = json.loads((draft / "config.json").read_text())
    SCENARIOS[scenario](cfg)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out

"""Real EAGLE-3 misconfigurations, made the way they happen: by editing the draft's config.json, or
its vocabulary map.

A config scenario copies a draft directory and changes only its ``config.json``; the weights are
shared by symlink. SGLang then silently feeds the draft other features (or applies other norms),
which is what hs_tracer must catch. A vocabulary scenario rewrites ``model.safetensors`` with
another ``d2t`` (or none): the features stay right and only the tokens go wrong. Used by the demo
and the end-to-end tests (docs/testbed.md lists them).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hs_tracer.sources import EMBEDDING, FINAL_NORM, Source

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


DEFAULT_SCENARIOS = ["ids_shifted"]  # what `hs-tracer demo` runs beside the configured draft

SCENARIOS: dict[str, Edit] = {
    "aux_off": _aux_off,
    "ids_top_level": _ids_top_level,
    "ids_shifted": _ids_shifted,
}

# Vocabulary scenarios: a new d2t (or None: drop d2t/t2d) for the draft's checkpoint.
VOCAB_SCENARIOS: dict[str, str] = {
    "d2t_regenerated": "d2t rebuilt from another corpus's token frequencies (as after fine-tuning on new "
                       "data): valid diffs in range, but no longer the tokens the lm_head rows were "
                       "trained for",
    "d2t_missing": "no d2t in the checkpoint: SGLang maps draft id i to target id i",
}


def fed_sources(trained: Sequence[str]) -> dict[str, list[str]]:
    """The miswiring catalogue as what each miswiring feeds the draft, slot by slot (canonical
    sources), for a draft trained on ``trained``; ``correct`` is the right wiring. The config edits
    above produce some of these in a real engine; the detection evaluation replays all of them."""
    t = list(trained)

    def earlier(s: str) -> str:
        return str(Source.block_output(int(Source.parse(s).depth) - 1))

    return {
        "correct": t,
        "one_slot_one_layer_early": [earlier(t[0]), *t[1:]],
        "all_slots_one_layer_early": [earlier(s) for s in t],
        "all_slots_one_layer_late": [str(Source.block_output(int(Source.parse(s).depth) + 1)) for s in t],
        "embedding_in_slot_0": [EMBEDDING, *t[:-1]],
        "slots_reversed": t[::-1],
        "single_state": [FINAL_NORM],
    }


def describe(name: str) -> str:
    if name in VOCAB_SCENARIOS:
        return VOCAB_SCENARIOS[name]
    doc = SCENARIOS[name].__doc__ or ""
    return " ".join(doc.split())


def regenerated_d2t(tb: Any, docs: int = 400) -> Any:
    """The testbed draft's d2t as SpecForge would regenerate it from the other domain's documents."""
    import json as _json

    from hs_tracer_testbed import corpus, dumps
    from hs_tracer_testbed.target import encode

    cfg = _json.loads((Path(tb.draft) / "config.json").read_text())
    toks = encode(corpus.documents(4321, docs, "other"))
    return dumps.vocab_mapping(toks, cfg["vocab_size"], cfg["draft_vocab_size"])["d2t"]


def write_vocab_variant(draft: Path, out: Path, d2t: Any | None) -> Path:
    """Copy ``draft`` to ``out`` with ``d2t`` replaced (None: d2t and t2d removed)."""
    import torch
    from safetensors.torch import load_file, save_file

    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for item in draft.iterdir():
        if item.suffix != ".safetensors":
            (out / item.name).symlink_to(item.resolve())
    for f in sorted(draft.glob("*.safetensors")):
        weights = load_file(str(f))
        if "d2t" in weights:
            if d2t is None:
                weights.pop("d2t")
                weights.pop("t2d", None)
            else:
                weights["d2t"] = torch.as_tensor(d2t, dtype=torch.long)
                t2d = torch.zeros_like(weights["t2d"]) if "t2d" in weights else None
                if t2d is not None:
                    t2d[weights["d2t"] + torch.arange(weights["d2t"].shape[0])] = True
                    weights["t2d"] = t2d
        save_file(weights, str(out / f.name), metadata={"format": "pt"})
    return out


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


def layer_shifts(trained: Sequence[int], num_layers: int) -> dict[str, dict[str, Any]]:
    """Train/serve layer shifts of a Llama-family pair (SGLang's rule: +1 to every draft-config id,
    so a config's C_out ids are exactly the blocks fed), each as the ``config.json`` ids that make a
    real engine feed it: ``ids`` for the draft config, ``slot_order`` (None: trained order) when the
    draft's ``fc`` must be permuted to express it, and ``fed`` the blocks the draft is then fed.

    SGLang always feeds the captured layers in ascending order, so a swap cannot come from the ids
    alone: it is the draft trained on an unsorted list (SpecForge's HF backend concatenates in list
    order) served by SGLang (loop order), made here by permuting the trained ``fc`` column blocks."""
    t = list(trained)
    last = num_layers - 1
    out: dict[str, dict[str, Any]] = {
        "correct": {"ids": t},
        "all_slots_one_layer_late": {"ids": [i + 1 for i in t]},
        "all_slots_one_layer_early": {"ids": [i - 1 for i in t]},
        "deep_slots_one_layer_late": {"ids": [t[0], *(i + 1 for i in t[1:])]},
        "deep_slots_one_layer_early": {"ids": [t[0], *(i - 1 for i in t[1:])]},
        "last_slot_two_layers_late": {"ids": [*t[:-1], t[-1] + 2]},
        "embedding_in_slot_0": {"ids": [-1, *t[:-1]]},
        "slots_1_and_2_swapped": {"ids": [t[0], t[2], t[1]], "slot_order": [0, 2, 1]},
    }
    for v in out.values():
        if not all(-1 <= i <= last for i in v["ids"]):
            raise ValueError(f"layer ids {v['ids']} outside the target's {num_layers} layers")
        v.setdefault("slot_order", None)
        v["fed"] = sorted(v["ids"])  # SGLang feeds ascending loop order
    return out


def write_ids_variant(
    draft: Path, out: Path, ids: Sequence[int], slot_order: Sequence[int] | None = None
) -> Path:
    """Copy ``draft`` to ``out`` with ``eagle_aux_hidden_state_layer_ids = ids``; with ``slot_order``
    the ``fc`` weight's column blocks are permuted too (slot ``k`` of the copy is slot
    ``slot_order[k]`` of the original), other files symlinked."""
    import torch
    from safetensors.torch import load_file, save_file

    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for item in draft.iterdir():
        if item.name != "config.json" and not (slot_order is not None and item.suffix == ".safetensors"):
            (out / item.name).symlink_to(item.resolve())
    cfg = json.loads((draft / "config.json").read_text())
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = list(ids)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    if slot_order is not None:
        for f in sorted(draft.glob("*.safetensors")):
            weights = load_file(str(f))
            if "fc.weight" in weights:
                blocks = weights["fc.weight"].chunk(len(slot_order), dim=1)
                weights["fc.weight"] = torch.cat([blocks[k] for k in slot_order], dim=1).contiguous()
            save_file(weights, str(out / f.name), metadata={"format": "pt"})
    return out

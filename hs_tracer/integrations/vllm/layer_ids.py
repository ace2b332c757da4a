"""vLLM's layer-id rules: which keys of an EAGLE-3 draft's config.json vLLM reads the layer ids from, its
default, what each id means and how many states the draft's ``fc`` is built for, per range of
releases whose source was read (docs/versions.md). A release outside them is refused, not guessed.
Ids are converted to canonical sources through :mod:`hs_tracer.sources` (vLLM counts in C_in)."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hs_tracer.errors import InputError
from hs_tracer.sources import c_in_source, check_num_layers


@dataclass(frozen=True)
class VLLMLayerIdRules:
    """How a range of vLLM releases picks the target layers an EAGLE-3 draft is fed.

    Read from the release's ``GPUModelRunner._get_eagle3_aux_layers_from_config`` (which keys, in
    which order), ``SupportsEagle3.get_eagle3_default_aux_hidden_state_layers`` (the default) and the
    models' ``EagleModelMixin._maybe_add_hidden_state`` calls (what an id means): id ``0`` is the
    embedding output (the input of layer 0), id ``k`` the output of layer ``k`` counted from 1 (the
    input of layer ``k``), id ``N`` the output of the last layer before the final norm; each id is
    captured once, in layer order whatever the list order, and ids outside ``0..N`` never.
    """

    first: str
    last: str

    @property
    def releases(self) -> str:
        return self.first if self.first == self.last else f"{self.first}-{self.last}"

    def covers(self, version: str) -> bool:
        return _vllm_key(self.first) <= _vllm_key(version) <= _vllm_key(self.last)


def _vllm_key(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split("."))


VLLM_LAYER_ID_RULES: tuple[VLLMLayerIdRules, ...] = (VLLMLayerIdRules("0.31.0", "0.32.0"),)
NEWEST_VLLM = VLLM_LAYER_ID_RULES[-1].last

# Where vLLM found the ids it used (VLLMCapture.key).
VLLM_TOP_LEVEL = "eagle_aux_hidden_state_layer_ids"
VLLM_NESTED = "eagle_config.eagle_aux_hidden_state_layer_ids"
VLLM_DFLASH = "dflash_config.target_layer_ids"
VLLM_DEFAULT = "default"
_VLLM_RELEASE_RE = re.compile(r"^\d+\.\d+\.\d+$")


def vllm_layer_id_rules(vllm_version: str | None = None) -> VLLMLayerIdRules:
    """The rules of ``vllm_version`` (None: the newest release hs_tracer knows)."""
    if vllm_version is None:
        return VLLM_LAYER_ID_RULES[-1]
    release = re.sub(r"(\+.*|\.post\d+)$", "", vllm_version.strip())
    for rules in VLLM_LAYER_ID_RULES:
        if _VLLM_RELEASE_RE.match(release) and rules.covers(release):
            return rules
    known = ", ".join(r.releases for r in VLLM_LAYER_ID_RULES)
    raise InputError(f"vLLM {vllm_version} is not supported: hs_tracer knows the layer-id rules of vLLM "
                     f"{known}")


def vllm_default_ids(num_layers: int) -> list[int]:
    """vLLM's fallback when the draft names no ids: ``(2, N//2, N-3)`` in its own convention."""
    check_num_layers(num_layers)
    return [2, num_layers // 2, num_layers - 3]


def vllm_configured_ids(draft_config: Mapping[str, Any]) -> tuple[list[int] | None, str]:
    """The ids vLLM takes from a draft config and the key it took them from (``VLLM_DEFAULT`` and
    None when it finds none and falls back to :func:`vllm_default_ids`).

    The order of its lookup: the top-level key if it is set (non-empty); else ``dflash_config``'s
    ``target_layer_ids`` each plus one (DFlash counts from the other end of a layer), and then, when
    an ``eagle_config`` dict exists, its ids, even when it has none: an ``eagle_config`` without ids
    discards the DFlash ids. Only a non-empty list or tuple counts.
    """
    ids: Any = draft_config.get(VLLM_TOP_LEVEL)
    key = VLLM_TOP_LEVEL
    if not ids:
        dflash, eagle = draft_config.get("dflash_config"), draft_config.get("eagle_config")
        if dflash and isinstance(dflash, Mapping):
            ids, key = [int(i) + 1 for i in (dflash.get("target_layer_ids") or [])], VLLM_DFLASH
        if eagle and isinstance(eagle, Mapping):
            ids, key = eagle.get("eagle_aux_hidden_state_layer_ids"), VLLM_NESTED
    if ids and isinstance(ids, (list, tuple)):
        return [int(i) for i in ids], key
    return None, VLLM_DEFAULT


@dataclass(frozen=True)
class VLLMCapture:
    """What a vLLM target captures for an EAGLE-3 draft: the ids it resolved (``layer_ids``, from
    ``key``), the ids it really captures (ascending, each once, inside ``0..N``) and their sources in
    slot order; ``unreachable`` ids are never captured, ``duplicates`` once."""

    layer_ids: list[int]
    key: str
    captured: list[int]
    sources: list[str]
    unreachable: list[int] = field(default_factory=list)
    duplicates: list[int] = field(default_factory=list)


def vllm_capture(layer_ids: Sequence[int], num_layers: int, key: str = VLLM_TOP_LEVEL, *,
                 vllm_version: str | None = None) -> VLLMCapture:
    """vLLM's resolved aux layer ids -> what the target hands the draft (class docstring)."""
    vllm_layer_id_rules(vllm_version)  # refuses releases whose rules are unknown
    check_num_layers(num_layers)
    ids = [int(v) for v in layer_ids]
    duplicates = sorted({v for v in ids if ids.count(v) > 1})
    captured = sorted({v for v in ids if 0 <= v <= num_layers})
    unreachable = [v for v in ids if not 0 <= v <= num_layers]
    return VLLMCapture(ids, key, captured, [str(c_in_source(v, num_layers)) for v in captured],
                       unreachable, duplicates)


def vllm_sources(draft_config: Mapping[str, Any], num_layers: int, *,
                 vllm_version: str | None = None) -> VLLMCapture:
    """A draft config -> what vLLM ``vllm_version`` feeds the draft (lookup, default, capture)."""
    ids, key = vllm_configured_ids(draft_config)
    if ids is None:
        ids = vllm_default_ids(num_layers)
    return vllm_capture(ids, num_layers, key, vllm_version=vllm_version)


# vLLM's EAGLE-3 draft classes by the architecture name it gives a draft (``Eagle3`` + the config's
# name unless that starts or ends with ``Eagle3`` already) -> the one class of those that counts the
# top-level ids when it sizes its ``fc`` (Qwen3's); every other class serves as the Llama one does.
_VLLM_QWEN3_DRAFTS = frozenset({"Eagle3Qwen3ForCausalLM", "PeagleQwen3ForCausalLM"})


def vllm_draft_architecture(draft_config: Mapping[str, Any]) -> str:
    """The architecture vLLM serves an EAGLE-3 draft config as (``method: eagle3``)."""
    archs = draft_config.get("architectures") or ["LlamaForCausalLM"]
    arch = str(archs[0])
    return arch if arch.startswith("Eagle3") or arch.endswith("Eagle3") else f"Eagle3{arch}"


def vllm_draft_aux_states(draft_config: Mapping[str, Any]) -> int | None:
    """How many target states vLLM's EAGLE-3 draft class builds its ``fc`` for (its input is that
    many times the target's hidden size): ``num_aux_hidden_states`` if set (Qwen3's class reads
    ``num_aux_layers`` first), else the length of the ids (the nested ``eagle_config`` ones; Qwen3's
    class looks at the top-level ones first), else 3. None when the draft uses no aux states
    (``eagle_config.use_aux_hidden_state: false``)."""
    eagle = draft_config.get("eagle_config") or {}
    eagle = eagle if isinstance(eagle, Mapping) else {}
    if eagle.get("use_aux_hidden_state", True) is False:
        return None
    qwen3 = vllm_draft_architecture(draft_config) in _VLLM_QWEN3_DRAFTS
    n = draft_config.get("num_aux_layers") if qwen3 else None
    if n is None:
        n = draft_config.get("num_aux_hidden_states")
    if n is None:
        ids = (draft_config.get(VLLM_TOP_LEVEL) if qwen3 else None) or eagle.get(
            "eagle_aux_hidden_state_layer_ids")
        n = len(ids) if ids else 3
    return int(n)

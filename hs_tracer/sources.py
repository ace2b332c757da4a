"""Canonical feature sources and every layer-id convention in use: the one home for "which layer is id k".

A slot of an EAGLE-3 draft input carries one residual-stream state of the target. hs_tracer names it
canonically (docs/glossary.md):

* ``embedding``  - output of the token embedding (the input of decoder layer 0);
* ``block:<j>``  - residual stream after decoder block ``j`` (0-indexed), before the final norm;
* ``final_norm`` - after the final norm (what the LM head reads).

Tools spell the same tensor differently. Two base conventions exist:

* **C_in**  - id ``k`` is the *input* of decoder layer ``k`` = output of block ``k-1``; ``0`` is the
  embedding and ``N`` the output of the last block (pre-norm). SGLang's internal ``layers_to_capture``,
  vLLM, speculators and the original EAGLE code use it.
* **C_out** - id ``j`` is the *output* of block ``j``; ``-1`` would be the embedding. SpecForge draft
  configs and SpecForge data use it.

SGLang reads a draft config's ``eagle_aux_hidden_state_layer_ids`` through a per-model-family rule
(``set_eagle3_layers_to_capture``) that turns them into ``layers_to_capture`` (C_in); the rule differs
between families (:class:`Family`), which is why the same draft config means different features on a
Llama and on a DeepSeek target. Everything in hs_tracer converts through this module.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import total_ordering
from typing import Any

from hs_tracer.errors import InputError
from hs_tracer.sglang_releases import layer_id_rules

EMBEDDING = "embedding"
FINAL_NORM = "final_norm"
UNKNOWN = "unknown"  # an observed source that nothing in the profile matches

_BLOCK_RE = re.compile(r"^block:(\d+)$")


@total_ordering
@dataclass(frozen=True)
class Source:
    """One canonical source. Ordered by depth: embedding < block:0 < block:1 < ... < final_norm."""

    kind: str  # "embedding" | "block" | "final_norm"
    block: int | None = None

    def __post_init__(self) -> None:
        if self.kind == "block":
            if self.block is None or self.block < 0:
                raise InputError(f"block index must be >= 0, got {self.block!r}")
        elif self.kind in (EMBEDDING, FINAL_NORM):
            if self.block is not None:
                raise InputError(f"{self.kind} takes no block index")
        else:
            raise InputError(f"unknown source kind {self.kind!r}; use embedding, block or final_norm")

    @classmethod
    def parse(cls, text: str) -> Source:
        """Parse ``embedding``, ``block:<j>`` or ``final_norm``."""
        text = text.strip()
        if text in (EMBEDDING, FINAL_NORM):
            return cls(text)
        m = _BLOCK_RE.match(text)
        if m is None:
            raise InputError(
                f"not a canonical source: {text!r} (expected embedding, block:<j> or final_norm)"
            )
        return cls("block", int(m.group(1)))

    @classmethod
    def embedding(cls) -> Source:
        return cls(EMBEDDING)

    @classmethod
    def final_norm(cls) -> Source:
        return cls(FINAL_NORM)

    @classmethod
    def block_output(cls, j: int) -> Source:
        """Output of block ``j`` in C_out terms: ``j = -1`` is the embedding."""
        if j == -1:
            return cls(EMBEDDING)
        if j < -1:
            raise InputError(f"block output index must be >= -1, got {j}")
        return cls("block", j)

    @property
    def depth(self) -> float:
        """Position in the residual stream: embedding -1, block j -> j, final_norm +inf."""
        if self.kind == EMBEDDING:
            return -1
        if self.kind == FINAL_NORM:
            return float("inf")
        assert self.block is not None
        return self.block

    def __lt__(self, other: object) -> bool:
        if not isinstance(other, Source):
            return NotImplemented
        return self.depth < other.depth

    def __str__(self) -> str:
        return f"block:{self.block}" if self.kind == "block" else self.kind


def parse_source(text: str) -> Source:
    return Source.parse(text)


def source_sort_key(text: str) -> float:
    """Sort key for canonical source strings by depth (``unknown`` last)."""
    return float("inf") if text == UNKNOWN else Source.parse(text).depth


def all_sources(num_layers: int, *, final_norm: bool = True) -> list[str]:
    """Every candidate source of an ``num_layers``-block target, shallow to deep."""
    out = [EMBEDDING] + [f"block:{j}" for j in range(num_layers)]
    return [*out, FINAL_NORM] if final_norm else out


class Convention(str, enum.Enum):
    """How a list of layer ids is meant. Values are the names the CLI accepts (``--convention``)."""

    SGLANG_CAPTURE = "sglang_capture"  # SGLang's internal layers_to_capture (C_in)
    SGLANG_DRAFT_CONFIG = "sglang_draft_config"  # draft-config ids as SGLang reads them (family, release)
    SPECFORGE = "specforge"  # SpecForge configs/data: output of block j (C_out)
    SPECULATORS = "speculators"  # speculators: input of layer k (C_in)
    VLLM = "vllm"  # vLLM eagle_aux_hidden_state_layer_ids: input of layer k (C_in)
    EAGLE = "eagle"  # original EAGLE code: input of layer k (C_in)
    HF_HIDDEN_STATES = "hf_hidden_states"  # index into HF outputs.hidden_states: 0 embedding, N final_norm

    @classmethod
    def parse(cls, text: str | Convention) -> Convention:
        if isinstance(text, Convention):
            return text
        try:
            return cls(text.strip().lower().replace("-", "_"))
        except ValueError:
            names = ", ".join(c.value for c in cls)
            raise InputError(f"unknown layer-id convention {text!r}; use one of: {names}") from None


C_IN_CONVENTIONS = frozenset(
    {Convention.SGLANG_CAPTURE, Convention.SPECULATORS, Convention.VLLM, Convention.EAGLE}
)


class Family(str, enum.Enum):
    """SGLang ``set_eagle3_layers_to_capture`` rules (draft-config ids -> ``layers_to_capture``); the
    DeepSeek and gpt-oss rules depend on the release (its family's ``layer_id_rules`` in
    :mod:`hs_tracer.sglang_releases`), the others do not."""

    LLAMA = "llama"  # Llama, Qwen2/3(-MoE/-Next/-VL), GLM4-MoE, Gemma, MiniMax-M2/M3, ...: always +1
    DEEPSEEK = "deepseek"  # DeepSeek-V2/V3/V3.2, Kimi-K2/K2.5, GLM-MoE-DSA, GLM4-MoE-Lite: +1 iff ids[0]==1
    GPT_OSS = "gpt_oss"  # ids kept as-is when max(ids) == N (N = final boundary), else +1
    PLUS_ONE_ALWAYS = "plus_one_always"  # MiniMax-M3-VL: +1 also on the default triple

    @classmethod
    def parse(cls, text: str | Family) -> Family:
        if isinstance(text, Family):
            return text
        try:
            return cls(text.strip().lower().replace("-", "_"))
        except ValueError:
            names = ", ".join(f.value for f in cls)
            raise InputError(f"unknown model family {text!r}; use one of: {names}") from None


# Architectures (HF config ``architectures[0]``) whose SGLang class uses a non-Llama rule (read from
# the newest supported release).
# Kimi-K2.5 / Kimi-VL wrappers delegate to their DeepseekV3 language model; MistralLarge3 and
# GlmMoeDsa subclass DeepseekV2ForCausalLM; Glm4MoeLite copies its rule.
_FAMILY_BY_ARCH: dict[str, Family] = {
    "DeepseekV2ForCausalLM": Family.DEEPSEEK,
    "DeepseekV3ForCausalLM": Family.DEEPSEEK,
    "DeepseekV32ForCausalLM": Family.DEEPSEEK,
    "DeepseekV3ForCausalLMNextN": Family.DEEPSEEK,
    "KimiK25ForConditionalGeneration": Family.DEEPSEEK,
    "KimiK2ForCausalLM": Family.DEEPSEEK,
    "GlmMoeDsaForCausalLM": Family.DEEPSEEK,
    "Glm4MoeLiteForCausalLM": Family.DEEPSEEK,
    "MistralLarge3ForCausalLM": Family.DEEPSEEK,
    "GptOssForCausalLM": Family.GPT_OSS,
    "MiniMaxM3SparseForConditionalGeneration": Family.PLUS_ONE_ALWAYS,
}


def family_of(architecture: str | None) -> Family:
    """SGLang's layer-id rule for a target architecture (``architectures[0]`` of its config).

    Every SGLang model not listed above that implements ``set_eagle3_layers_to_capture`` adds 1, so
    that is the answer for unknown names too.
    """
    if not architecture:
        return Family.LLAMA
    return _FAMILY_BY_ARCH.get(architecture, Family.LLAMA)


def text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's part of a target config: wrappers (Kimi-K2.5, Gemma3/4-MM, Llama4, VL models)
    nest it under ``text_config``/``language_config``, and SGLang counts layers there."""
    for key in ("text_config", "language_config"):
        sub = config.get(key)
        if isinstance(sub, Mapping) and "num_hidden_layers" in sub:
            return sub
    return config


def _check_num_layers(num_layers: int) -> None:
    if num_layers < 1:
        raise InputError(f"num_layers must be >= 1, got {num_layers}")


def default_ids(convention: Convention | str, num_layers: int) -> list[int]:
    """The ids each tool uses when none are configured. All select blocks 1, N//2-1, N-4 (except the
    HF index, which is written the C_in way, and MiniMax-M3-VL which shifts its own default)."""
    convention = Convention.parse(convention)
    _check_num_layers(num_layers)
    n = num_layers
    if convention in (Convention.SPECFORGE, Convention.SGLANG_DRAFT_CONFIG):
        return [1, n // 2 - 1, n - 4]
    return [2, n // 2, n - 3]


def sglang_layers_to_capture(
    draft_ids: Sequence[int] | None, family: Family | str, num_layers: int, *,
    sglang_version: str | None = None,
) -> list[int]:
    """What SGLang's ``set_eagle3_layers_to_capture(draft_ids)`` stores as ``layers_to_capture`` on
    ``sglang_version`` (None: the newest release hs_tracer knows).

    ``draft_ids`` is the draft config's ``eagle_config.eagle_aux_hidden_state_layer_ids`` (None when
    absent or unreadable: SGLang then uses its default).
    """
    family = Family.parse(family)
    rules = layer_id_rules(sglang_version)
    _check_num_layers(num_layers)
    n = num_layers
    if draft_ids is None:
        base = [2, n // 2, n - 3]
        return [v + 1 for v in base] if family is Family.PLUS_ONE_ALWAYS else base
    ids = [int(v) for v in draft_ids]
    if family is Family.DEEPSEEK and rules.deepseek_first_id_rule:
        return [v + 1 for v in ids] if ids and ids[0] == 1 else list(ids)
    if family is Family.GPT_OSS and rules.gpt_oss_final_boundary:
        return list(ids) if ids and max(ids) == n else [v + 1 for v in ids]
    return [v + 1 for v in ids]


@dataclass(frozen=True)
class SGLangCapture:
    """What an SGLang target really captures for one ``layers_to_capture`` list.

    ``sources`` is in slot order: the model loop appends in ascending layer order whatever the list
    order, each layer once. ``unreachable`` ids are never visited by the loop (so silently not
    captured); ``duplicates`` are captured once. On the DeepSeek family of releases with the packer
    (its family's ``deepseek_packer``) it expects ``len(layers_to_capture)`` captures and raises
    at the first forward when fewer arrive; older releases feed the fewer states. On the DeepSeek
    family of releases whose loop captures before each layer (``deepseek_layer_0_raises``) a captured
    layer 0 (the embedding) raises a TypeError at the first forward: ``raises_at_layer_0``.
    """

    layers_to_capture: list[int]
    sources: list[str]
    unreachable: list[int] = field(default_factory=list)
    duplicates: list[int] = field(default_factory=list)
    fails_at_forward: bool = False
    raises_at_layer_0: bool = False


def sglang_capture(layers_to_capture: Sequence[int], num_layers: int, family: Family | str, *,
                   sglang_version: str | None = None) -> SGLangCapture:
    """Resolve SGLang's internal ``layers_to_capture`` to the sources the draft is fed, in slot order."""
    family = Family.parse(family)
    rules = layer_id_rules(sglang_version)
    _check_num_layers(num_layers)
    ltc = [int(v) for v in layers_to_capture]
    # the model loop visits 0..N-1; gpt-oss also captures id N at its final norm (pre-norm residual)
    # on releases with the final-boundary rule
    top = num_layers if family is Family.GPT_OSS and rules.gpt_oss_final_boundary else num_layers - 1
    seen: set[int] = set()
    duplicates: list[int] = []
    for v in ltc:
        if v in seen and v not in duplicates:
            duplicates.append(v)
        seen.add(v)
    reachable = sorted(v for v in seen if 0 <= v <= top)
    unreachable = [v for v in ltc if not 0 <= v <= top]
    sources = [str(_c_in_source(v, num_layers)) for v in reachable]
    fails = family is Family.DEEPSEEK and rules.deepseek_packer and len(reachable) != len(ltc)
    layer_0 = family is Family.DEEPSEEK and rules.deepseek_layer_0_raises and 0 in seen
    return SGLangCapture(ltc, sources, unreachable, duplicates, fails, layer_0)


def sglang_sources(draft_ids: Sequence[int] | None, family: Family | str, num_layers: int, *,
                   sglang_version: str | None = None) -> SGLangCapture:
    """Draft-config ids -> what SGLang ``sglang_version`` feeds the draft (family rule, then the
    capture loop; None: the newest release hs_tracer knows)."""
    ltc = sglang_layers_to_capture(draft_ids, family, num_layers, sglang_version=sglang_version)
    return sglang_capture(ltc, num_layers, family, sglang_version=sglang_version)


def _c_in_source(k: int, num_layers: int) -> Source:
    if not 0 <= k <= num_layers:
        raise InputError(
            f"layer id {k} is outside 0..{num_layers} for a {num_layers}-layer target in the C_in convention "
            "(input of layer k; 0 = embedding, N = output of the last block)"
        )
    return Source.block_output(k - 1)


def id_to_source(layer_id: int, convention: Convention | str, num_layers: int) -> Source:
    """One id of a list written in ``convention`` -> its canonical source (no engine rule applied).

    ``sglang_draft_config`` needs the model family; use :func:`to_sources` or :func:`sglang_sources`.
    """
    convention = Convention.parse(convention)
    _check_num_layers(num_layers)
    k = int(layer_id)
    if convention in C_IN_CONVENTIONS:
        return _c_in_source(k, num_layers)
    if convention is Convention.SPECFORGE:
        if not -1 <= k < num_layers:
            raise InputError(
                f"layer id {k} is outside -1..{num_layers - 1} for a {num_layers}-layer target in the "
                "SpecForge convention (output of block j; -1 = embedding)"
            )
        return Source.block_output(k)
    if convention is Convention.HF_HIDDEN_STATES:
        if k == num_layers:
            return Source.final_norm()
        return _c_in_source(k, num_layers)
    raise InputError(
        "the sglang_draft_config convention depends on the model family: use to_sources(..., family=)"
    )


def to_sources(
    ids: Sequence[int] | None,
    convention: Convention | str,
    num_layers: int,
    *,
    family: Family | str | None = None,
    sglang_version: str | None = None,
) -> list[str]:
    """Layer ids written in ``convention`` -> canonical sources, one per slot.

    For ``sglang_draft_config`` and ``sglang_capture`` the result is what SGLang ``sglang_version``
    (None: the newest release hs_tracer knows) feeds (ascending,
    each layer once, unreachable ids dropped); ``family`` is required for ``sglang_draft_config``
    and defaults to the Llama rule for ``sglang_capture``. For the others, one source per id in list
    order. ``ids=None`` means the tool's default (:func:`default_ids`).
    """
    convention = Convention.parse(convention)
    if convention is Convention.SGLANG_DRAFT_CONFIG:
        if family is None:
            raise InputError(
                "sglang_draft_config ids depend on the target family: pass family= (see family_of)"
            )
        return sglang_sources(ids, family, num_layers, sglang_version=sglang_version).sources
    if ids is None:
        ids = default_ids(convention, num_layers)
    if convention is Convention.SGLANG_CAPTURE:
        return sglang_capture(ids, num_layers, family or Family.LLAMA, sglang_version=sglang_version).sources
    return [str(id_to_source(k, convention, num_layers)) for k in ids]


def from_sources(sources: Iterable[str | Source], convention: Convention | str, num_layers: int) -> list[int]:
    """Canonical sources -> ids in a base convention (C_in tools, SpecForge, HF index)."""
    convention = Convention.parse(convention)
    _check_num_layers(num_layers)
    out = []
    for s in sources:
        src = s if isinstance(s, Source) else Source.parse(s)
        if src.kind == FINAL_NORM:
            if convention is not Convention.HF_HIDDEN_STATES:
                raise InputError(f"final_norm has no id in the {convention.value} convention")
            out.append(num_layers)
            continue
        j = int(src.depth)  # output of block j, -1 = embedding
        if j >= num_layers:
            raise InputError(f"{src} does not exist in a {num_layers}-layer target")
        if convention is Convention.SPECFORGE:
            out.append(j)
        elif convention in C_IN_CONVENTIONS or convention is Convention.HF_HIDDEN_STATES:
            if convention is Convention.HF_HIDDEN_STATES and j == num_layers - 1:
                raise InputError(
                    f"{src} (pre-norm) is not in HF hidden_states (index N is after the final norm)"
                )
            out.append(j + 1)
        else:
            raise InputError(
                "sglang_draft_config ids depend on the family; convert to sglang_capture instead"
            )
    return out


# ---- vLLM ------------------------------------------------------------------------------------------
# What vLLM reads from an EAGLE-3 draft's config.json and what its target then captures, per range of
# releases whose source was read (docs/versions.md). A release outside them is refused, not guessed.


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
    _check_num_layers(num_layers)
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
    _check_num_layers(num_layers)
    ids = [int(v) for v in layer_ids]
    duplicates = sorted({v for v in ids if ids.count(v) > 1})
    captured = sorted({v for v in ids if 0 <= v <= num_layers})
    unreachable = [v for v in ids if not 0 <= v <= num_layers]
    return VLLMCapture(ids, key, captured, [str(_c_in_source(v, num_layers)) for v in captured],
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

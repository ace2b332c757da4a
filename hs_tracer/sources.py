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

from hs_tracer import engines
from hs_tracer.errors import InputError

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
    DeepSeek and gpt-oss rules depend on the release (the engine's ``layer_id_rules``, read from its
    adapter through :mod:`hs_tracer.engines`), the others do not."""

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


def check_num_layers(num_layers: int) -> None:
    if num_layers < 1:
        raise InputError(f"num_layers must be >= 1, got {num_layers}")


def default_ids(convention: Convention | str, num_layers: int) -> list[int]:
    """The ids each tool uses when none are configured. All select blocks 1, N//2-1, N-4 (except the
    HF index, which is written the C_in way, and MiniMax-M3-VL which shifts its own default)."""
    convention = Convention.parse(convention)
    check_num_layers(num_layers)
    n = num_layers
    if convention in (Convention.SPECFORGE, Convention.SGLANG_DRAFT_CONFIG):
        return [1, n // 2 - 1, n - 4]
    return [2, n // 2, n - 3]


def _layer_id_rules(engine: str, engine_version: str | None) -> Any:
    """The release-dependent layer-id rules of ``engine`` at ``engine_version``, from its adapter."""
    return engines.get(engine).layer_id_rules(engine_version)


def sglang_layers_to_capture(
    draft_ids: Sequence[int] | None, family: Family | str, num_layers: int, *,
    engine: str = engines.DEFAULT, engine_version: str | None = None,
) -> list[int]:
    """What SGLang's ``set_eagle3_layers_to_capture(draft_ids)`` stores as ``layers_to_capture`` on
    release ``engine_version`` (None: the newest release hs_tracer knows).

    ``draft_ids`` is the draft config's ``eagle_config.eagle_aux_hidden_state_layer_ids`` (None when
    absent or unreadable: SGLang then uses its default).
    """
    family = Family.parse(family)
    rules = _layer_id_rules(engine, engine_version)
    check_num_layers(num_layers)
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
                   engine: str = engines.DEFAULT, engine_version: str | None = None) -> SGLangCapture:
    """Resolve SGLang's internal ``layers_to_capture`` to the sources the draft is fed, in slot order."""
    family = Family.parse(family)
    rules = _layer_id_rules(engine, engine_version)
    check_num_layers(num_layers)
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
    sources = [str(c_in_source(v, num_layers)) for v in reachable]
    fails = family is Family.DEEPSEEK and rules.deepseek_packer and len(reachable) != len(ltc)
    layer_0 = family is Family.DEEPSEEK and rules.deepseek_layer_0_raises and 0 in seen
    return SGLangCapture(ltc, sources, unreachable, duplicates, fails, layer_0)


def sglang_sources(draft_ids: Sequence[int] | None, family: Family | str, num_layers: int, *,
                   engine: str = engines.DEFAULT, engine_version: str | None = None) -> SGLangCapture:
    """Draft-config ids -> what SGLang release ``engine_version`` feeds the draft (family rule, then
    the capture loop; None: the newest release hs_tracer knows)."""
    pin = {"engine": engine, "engine_version": engine_version}
    ltc = sglang_layers_to_capture(draft_ids, family, num_layers, **pin)
    return sglang_capture(ltc, num_layers, family, **pin)


def c_in_source(k: int, num_layers: int) -> Source:
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
    check_num_layers(num_layers)
    k = int(layer_id)
    if convention in C_IN_CONVENTIONS:
        return c_in_source(k, num_layers)
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
        return c_in_source(k, num_layers)
    raise InputError(
        "the sglang_draft_config convention depends on the model family: use to_sources(..., family=)"
    )


def to_sources(
    ids: Sequence[int] | None,
    convention: Convention | str,
    num_layers: int,
    *,
    family: Family | str | None = None,
    engine: str = engines.DEFAULT,
    engine_version: str | None = None,
) -> list[str]:
    """Layer ids written in ``convention`` -> canonical sources, one per slot.

    For ``sglang_draft_config`` and ``sglang_capture`` the result is what SGLang release
    ``engine_version`` (None: the newest release hs_tracer knows) feeds (ascending,
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
        return sglang_sources(ids, family, num_layers, engine=engine, engine_version=engine_version).sources
    if ids is None:
        ids = default_ids(convention, num_layers)
    if convention is Convention.SGLANG_CAPTURE:
        return sglang_capture(ids, num_layers, family or Family.LLAMA, engine=engine,
                              engine_version=engine_version).sources
    return [str(id_to_source(k, convention, num_layers)) for k in ids]


def from_sources(sources: Iterable[str | Source], convention: Convention | str, num_layers: int) -> list[int]:
    """Canonical sources -> ids in a base convention (C_in tools, SpecForge, HF index)."""
    convention = Convention.parse(convention)
    check_num_layers(num_layers)
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

"""Draft and target configs as the newest supported SGLang release reads them, and which tool wrote the draft.

Three draft formats are in the wild:
SpecForge/SGLang (``LlamaForCausalLMEagle3``, ids nested in ``eagle_config``), speculators
(``speculators_model_type: eagle3``, model dims in ``transformer_layer_config``, ids at top level)
and original EAGLE (``architectures: ["LlamaForCausalLM"]``). Only the first loads in SGLang.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hs_tracer.errors import InputError
from hs_tracer.sources import text_config

# Draft architectures the newest supported SGLang release registers for EAGLE-3 (models/llama_eagle3.py and
# models/kimi_k25_eagle3.py EntryClass); tests check this against the installed package.
SGLANG_EAGLE3_DRAFT_ARCHS = frozenset({"LlamaForCausalLMEagle3", "Eagle3DeepseekV2ForCausalLM"})
# EAGLE-1/2 draft classes: they load, but take one H-wide state (models/*_eagle.py EntryClass).
SGLANG_EAGLE_DRAFT_ARCHS = frozenset({
    "LlamaForCausalLMEagle", "Qwen2ForCausalLMEagle", "MistralForCausalLMEagle",
    "MistralLarge3ForCausalLMEagle",
})
SPECULATORS_ARCHS = frozenset({"Eagle3Speculator", "Eagle3DraftModel"})


class ConfigError(InputError):
    """A config file is missing or unreadable; the message says how to fix it."""


class DraftFormat(str, enum.Enum):
    SGLANG = "specforge/sglang"
    SPECULATORS = "speculators"
    EAGLE = "original EAGLE"
    EAGLE1 = "EAGLE-1/2 draft"
    UNKNOWN = "unknown"


def _int_list(value: Any) -> list[int] | None:
    if value is None:
        return None
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool)
                                                for v in value):
        return [int(v) for v in value]
    raise ConfigError(f"eagle_aux_hidden_state_layer_ids must be a list of integers, got {value!r}")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise ConfigError(f"{path} not found") from exc
    except ValueError as exc:
        raise ConfigError(f"{path} is not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path} does not hold a JSON object")
    return data


def config_path(path: str | Path) -> Path:
    """``DIR`` -> ``DIR/config.json``; a file path is used as is."""
    path = Path(path)
    return path / "config.json" if path.is_dir() else path


@dataclass
class DraftConfig:
    """What the draft's config.json says, with the fields SGLang reads pulled out."""

    path: Path
    raw: dict[str, Any]
    format: DraftFormat
    architectures: list[str]
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int | None
    draft_vocab_size: int | None
    has_draft_vocab_size: bool  # LlamaForCausalLMEagle3 reads config.draft_vocab_size unguarded
    tie_word_embeddings: bool
    has_target_hidden_size: bool   # SGLang tests hasattr(config, "target_hidden_size")
    target_hidden_size: int | None
    eagle_config: Any               # raw value: dict, None, or something SGLang cannot .get()
    nested_layer_ids: list[int] | None
    top_level_layer_ids: list[int] | None
    num_aux_hidden_states: int | None
    fc_bias: bool

    @property
    def arch(self) -> str:
        return self.architectures[0] if self.architectures else ""

    def flag(self, name: str) -> Any:
        """A norm flag wherever a writer put it: nested ``eagle_config`` first, then top level."""
        if isinstance(self.eagle_config, dict) and name in self.eagle_config:
            return self.eagle_config[name]
        return self.raw.get(name)


def detect_format(raw: dict[str, Any]) -> DraftFormat:
    archs = raw.get("architectures") or []
    if raw.get("speculators_model_type") or set(archs) & SPECULATORS_ARCHS \
            or "transformer_layer_config" in raw:
        return DraftFormat.SPECULATORS
    if set(archs) & SGLANG_EAGLE3_DRAFT_ARCHS:
        return DraftFormat.SGLANG
    if set(archs) & SGLANG_EAGLE_DRAFT_ARCHS:
        return DraftFormat.EAGLE1
    if archs and archs[0] == "LlamaForCausalLM" and "draft_vocab_size" in raw:
        return DraftFormat.EAGLE
    return DraftFormat.UNKNOWN


def read_draft_config(path: str | Path) -> DraftConfig:
    cfg_path = config_path(path)
    raw = _read_json(cfg_path)
    fmt = detect_format(raw)
    # speculators keeps the decoder dims in a nested HF config; everyone else at top level.
    dims = raw.get("transformer_layer_config") if fmt is DraftFormat.SPECULATORS else raw
    if not isinstance(dims, dict):
        raise ConfigError(f"{cfg_path}: speculators config without a transformer_layer_config object")
    try:
        hidden = int(dims["hidden_size"])
        heads = int(dims["num_attention_heads"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"{cfg_path}: hidden_size / num_attention_heads missing or not integers") from exc
    eagle_config = raw.get("eagle_config")
    nested = _int_list(eagle_config.get("eagle_aux_hidden_state_layer_ids")) \
        if isinstance(eagle_config, dict) else None
    vocab = raw.get("vocab_size", dims.get("vocab_size"))
    if fmt is DraftFormat.SPECULATORS:
        vocab = dims.get("vocab_size", raw.get("target_vocab_size"))
    num_aux = raw.get("num_aux_hidden_states")
    return DraftConfig(
        path=cfg_path,
        raw=raw,
        format=fmt,
        architectures=list(raw.get("architectures") or []),
        hidden_size=hidden,
        num_hidden_layers=int(dims.get("num_hidden_layers", 1)),
        num_attention_heads=heads,
        num_key_value_heads=int(dims.get("num_key_value_heads") or heads),
        head_dim=int(dims.get("head_dim") or hidden // heads),
        intermediate_size=int(dims.get("intermediate_size", 0)),
        vocab_size=int(vocab) if vocab is not None else None,
        draft_vocab_size=int(raw["draft_vocab_size"]) if raw.get("draft_vocab_size") is not None else None,
        has_draft_vocab_size="draft_vocab_size" in raw,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", dims.get("tie_word_embeddings", False))),
        has_target_hidden_size="target_hidden_size" in raw,
        target_hidden_size=int(raw["target_hidden_size"]) if raw.get("target_hidden_size") is not None
        else None,
        eagle_config=eagle_config,
        nested_layer_ids=nested,
        top_level_layer_ids=_int_list(raw.get("eagle_aux_hidden_state_layer_ids")),
        num_aux_hidden_states=int(num_aux) if num_aux is not None else None,
        fc_bias=bool(raw.get("bias", False)),
    )


@dataclass
class TargetConfig:
    """The target's text model: architecture (decides SGLang's layer-id rule), depth, width, vocab."""

    path: Path
    raw: dict[str, Any]
    architectures: list[str]
    model_type: str
    num_hidden_layers: int
    hidden_size: int
    vocab_size: int | None

    @property
    def arch(self) -> str:
        return self.architectures[0] if self.architectures else ""


def read_target_config(path: str | Path) -> TargetConfig:
    cfg_path = config_path(path)
    raw = _read_json(cfg_path)
    # Multimodal wrappers (Kimi-K2.5, Qwen-VL) keep the language model in text_config, as SGLang's
    # hf_text_config does.
    text = text_config(raw)
    try:
        layers = int(text["num_hidden_layers"])
        hidden = int(text["hidden_size"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"{cfg_path}: num_hidden_layers / hidden_size missing; is this the target's "
                          "config.json?") from exc
    vocab = text.get("vocab_size", raw.get("vocab_size"))
    return TargetConfig(
        path=cfg_path,
        raw=raw,
        architectures=list(raw.get("architectures") or []),
        model_type=str(raw.get("model_type", "")),
        num_hidden_layers=layers,
        hidden_size=hidden,
        vocab_size=int(vocab) if vocab is not None else None,
    )

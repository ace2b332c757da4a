"""The parameters SGLang's EAGLE-3 draft classes have (its newest supported release), and where each
checkpoint key goes.

``LlamaForCausalLMEagle3`` (sglang/srt/models/llama_eagle3.py): ``LlamaModel.__init__`` (fc width =
target hidden x num aux, optional ``input_norm`` / ``fc_norm``, decoder layer 0 with a 2H-wide qkv)
and ``load_weights``: the legacy renames (``midlayer`` -> ``layers.0``, ``aux_norm_*`` -> ``fc_norm.*``)
applied as substring replacements, any name containing ``d2t``/``t2d`` consumed, q/k/v and gate/up
stacked into ``qkv_proj``/``gate_up_proj``, a name tried as is and then with a ``model.`` prefix,
anything else dropped without a word.

``Eagle3DeepseekV2ForCausalLM`` (sglang/srt/models/kimi_k25_eagle3.py, the Kimi MLA draft):
``^layers.0.`` -> ``midlayer.``, a ``model.`` prefix for all but ``lm_head``, gate/up stacked,
``q_a_proj`` + ``kv_a_proj_with_mqa`` fused into ``fused_qkv_a_proj_with_mqa`` (2H wide) only when
both arrive, ``d2t``/``t2d`` by exact name or ``.d2t`` suffix, anything else dropped with a log line.

tests/test_check_sglang_real.py checks both mirrors against the real classes built on CPU.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from hs_tracer.preflight.config import DraftConfig

LEGACY_NAME_MAP = {
    "midlayer": "layers.0",
    "aux_norm_low": "fc_norm.0",
    "aux_norm_mid": "fc_norm.1",
    "aux_norm_high": "fc_norm.2",
}
STACKED = (
    (".qkv_proj", ".q_proj", "q"),
    (".qkv_proj", ".k_proj", "k"),
    (".qkv_proj", ".v_proj", "v"),
    (".gate_up_proj", ".gate_proj", 0),
    (".gate_up_proj", ".up_proj", 1),
)


@dataclass(frozen=True)
class Param:
    """One parameter of the SGLang draft module; ``shards`` maps shard id -> expected shard shape."""

    name: str
    shape: tuple[int, ...]
    shards: dict[object, tuple[int, ...]] | None = None


@dataclass(frozen=True)
class KeyTarget:
    """Where one checkpoint key ends up: ``param`` (+ ``shard``), ``d2t``, ``t2d`` or ``dropped``."""

    kind: str
    param: str | None = None
    shard: object = None


MLA_ARCH = "Eagle3DeepseekV2ForCausalLM"
_MLA_DIMS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def is_mla(draft: DraftConfig) -> bool:
    return draft.arch == MLA_ARCH


def num_aux_states(draft: DraftConfig) -> int:
    """How many aux states the draft's fc takes.

    Llama: ``num_aux_hidden_states``, else len(nested ids), else 3. MLA
    (``_get_eagle_aux_layer_count``): len(nested ids), else len(top-level ids), else 3.
    """
    if is_mla(draft):
        ids = draft.nested_layer_ids or draft.top_level_layer_ids
        return len(ids) if ids else 3
    if draft.num_aux_hidden_states is not None:
        return draft.num_aux_hidden_states
    return len(draft.nested_layer_ids) if draft.nested_layer_ids else 3


def fc_input_hidden(draft: DraftConfig) -> int | None:
    """Width of one aux state at the fc. Llama: ``target_hidden_size`` whenever the key exists (a null
    crashes SGLang); MLA: ``target_hidden_size or hidden_size``."""
    if is_mla(draft):
        return draft.target_hidden_size or draft.hidden_size
    return draft.target_hidden_size if draft.has_target_hidden_size else draft.hidden_size


def mla_dims_missing(draft: DraftConfig) -> list[str]:
    """MLA dims the config must state for the mirror (SGLang would use DeepseekV3Config defaults)."""
    return [k for k in _MLA_DIMS if not isinstance(draft.raw.get(k), int)]


def uses_fc_norm(draft: DraftConfig) -> bool:
    return bool(draft.raw.get("fc_norm") or draft.raw.get("use_aux_norm", False))


def uses_norm_before_fc(draft: DraftConfig) -> bool:
    return bool(draft.flag("norm_before_fc"))


def sglang_params(draft: DraftConfig) -> dict[str, Param]:
    """Every parameter the SGLang draft class registers for this config, with its full shape."""
    if is_mla(draft):
        return _mla_params(draft)
    h = draft.hidden_size
    h_in = fc_input_hidden(draft) or h
    k = num_aux_states(draft)
    q = draft.num_attention_heads * draft.head_dim
    kv = draft.num_key_value_heads * draft.head_dim
    inter = draft.intermediate_size
    attn_bias = bool(draft.raw.get("attention_bias", False) or draft.raw.get("bias", False))
    params = [Param("model.embed_tokens.weight", (draft.vocab_size or 0, h)),
              Param("model.fc.weight", (h, h_in * k))]
    if draft.fc_bias:
        params.append(Param("model.fc.bias", (h,)))
    if uses_norm_before_fc(draft):
        params.append(Param("model.input_norm.weight", (h_in * k,)))
    if uses_fc_norm(draft):
        params.extend(Param(f"model.fc_norm.{i}.weight", (h_in,)) for i in range(k))
    for i in range(draft.num_hidden_layers):
        width = 2 * h if i == 0 else h
        p = f"model.layers.{i}"
        params += [
            Param(f"{p}.self_attn.qkv_proj.weight", (q + 2 * kv, width),
                  {"q": (q, width), "k": (kv, width), "v": (kv, width)}),
            Param(f"{p}.self_attn.o_proj.weight", (h, q)),
            Param(f"{p}.mlp.gate_up_proj.weight", (2 * inter, h), {0: (inter, h), 1: (inter, h)}),
            Param(f"{p}.mlp.down_proj.weight", (h, inter)),
            Param(f"{p}.input_layernorm.weight", (h,)),
            Param(f"{p}.post_attention_layernorm.weight", (h,)),
            Param(f"{p}.hidden_norm.weight", (h,)),
        ]
        if attn_bias:
            params.append(Param(f"{p}.self_attn.o_proj.bias", (h,)))
    params.append(Param("model.norm.weight", (h,)))
    if not draft.tie_word_embeddings:  # tied: lm_head *is* embed_tokens (one named parameter)
        params.append(Param("lm_head.weight", (draft.draft_vocab_size or draft.vocab_size or 0, h)))
    return {x.name: x for x in params}


def _mla_params(draft: DraftConfig) -> dict[str, Param]:
    h, raw = draft.hidden_size, draft.raw
    h_in = fc_input_hidden(draft) or h
    k = num_aux_states(draft)
    heads, inter = draft.num_attention_heads, draft.intermediate_size
    q_lora, kv_lora = raw["q_lora_rank"], raw["kv_lora_rank"]
    nope, rope, v = raw["qk_nope_head_dim"], raw["qk_rope_head_dim"], raw["v_head_dim"]
    a = "model.midlayer.self_attn"
    params = [Param("model.embed_tokens.weight", (draft.vocab_size or 0, h)),
              Param("model.fc.weight", (h, h_in * k))]
    if draft.fc_bias:
        params.append(Param("model.fc.bias", (h,)))
    if uses_fc_norm(draft):
        params.extend(Param(f"model.fc_norm.{i}.weight", (h_in,)) for i in range(k))
    params += [
        Param(f"{a}.fused_qkv_a_proj_with_mqa.weight", (q_lora + kv_lora + rope, 2 * h),
              {"q_a": (q_lora, 2 * h), "kv_a": (kv_lora + rope, 2 * h)}),
        Param(f"{a}.q_a_layernorm.weight", (q_lora,)),
        Param(f"{a}.q_b_proj.weight", (heads * (nope + rope), q_lora)),
        Param(f"{a}.kv_a_layernorm.weight", (kv_lora,)),
        Param(f"{a}.kv_b_proj.weight", (heads * (nope + v), kv_lora)),
        Param(f"{a}.o_proj.weight", (h, heads * v)),
        Param("model.midlayer.mlp.gate_up_proj.weight", (2 * inter, h), {0: (inter, h), 1: (inter, h)}),
        Param("model.midlayer.mlp.down_proj.weight", (h, inter)),
        Param("model.midlayer.input_layernorm.weight", (h,)),
        Param("model.midlayer.hidden_norm.weight", (h,)),
        Param("model.midlayer.post_attention_layernorm.weight", (h,)),
        Param("model.norm.weight", (h,)),
    ]
    if not draft.tie_word_embeddings:
        params.append(Param("lm_head.weight", (draft.draft_vocab_size or draft.vocab_size or 0, h)))
    return {x.name: x for x in params}


def route_key(name: str, params: dict[str, Param], *, mla: bool = False) -> KeyTarget:
    """Where ``load_weights`` sends checkpoint key ``name`` (same order of tests as SGLang)."""
    if mla:
        return _route_key_mla(name, params)
    for legacy, new in LEGACY_NAME_MAP.items():
        if legacy in name:
            name = name.replace(legacy, new)
    if "d2t" in name:
        return KeyTarget("d2t")
    if "t2d" in name:
        return KeyTarget("t2d")
    for param_name, weight_name, shard in STACKED:
        if weight_name not in name:
            continue
        name = name.replace(weight_name, param_name)
        full = f"model.{name}" if name not in params else name
        return KeyTarget("param", full, shard) if full in params else KeyTarget("dropped")
    full = name if name in params else f"model.{name}"
    return KeyTarget("param", full) if full in params else KeyTarget("dropped")


def _route_key_mla(name: str, params: dict[str, Param]) -> KeyTarget:
    if name == "d2t" or name.endswith(".d2t"):
        return KeyTarget("d2t")
    if name == "t2d" or name.endswith(".t2d"):
        return KeyTarget("t2d")
    mapped = re.sub(r"^layers\.0\.", "midlayer.", name)
    if not mapped.startswith("lm_head."):
        mapped = f"model.{mapped}"
    for param_name, weight_name, shard in STACKED[3:]:  # gate/up only
        if weight_name in mapped and mapped.replace(weight_name, param_name) in params:
            return KeyTarget("param", mapped.replace(weight_name, param_name), shard)
    if "q_a_proj" in mapped or "kv_a_proj_with_mqa" in mapped:
        q_name = mapped if "q_a_proj" in mapped else mapped.replace("kv_a_proj_with_mqa", "q_a_proj")
        fused = q_name.replace("q_a_proj", "fused_qkv_a_proj_with_mqa")
        shard = "q_a" if "q_a_proj" in mapped else "kv_a"
        return KeyTarget("param", fused, shard) if fused in params else KeyTarget("dropped")
    return KeyTarget("param", mapped) if mapped in params else KeyTarget("dropped")


def load_lm_head_from_target(draft: DraftConfig) -> bool:
    """SGLang replaces the draft head with the target's when no draft vocab is declared."""
    return not draft.tie_word_embeddings and draft.draft_vocab_size is None


def embed_replaced_by_target(draft: DraftConfig) -> bool:
    """``EagleDraftWorker.init_lm_head``: ``set_embed_and_head`` always replaces the embedding;
    ``set_embed`` keeps the draft's own only when ``target_hidden_size != hidden_size``."""
    if load_lm_head_from_target(draft):
        return True
    if is_mla(draft):  # its set_embed also ignores a null target_hidden_size
        return draft.target_hidden_size is None or draft.target_hidden_size == draft.hidden_size
    return not (draft.has_target_hidden_size and draft.target_hidden_size != draft.hidden_size)


@dataclass
class LoadPlan:
    """The outcome of SGLang's ``load_weights`` over this checkpoint, before anything runs."""

    params: dict[str, Param]
    routes: dict[str, KeyTarget]
    loaded: dict[str, set[object]]        # param -> shards loaded (None for unsharded)
    shape_errors: list[tuple[str, str, tuple[int, ...], tuple[int, ...]]]  # key, param, got, want

    @property
    def dropped(self) -> list[str]:
        return sorted(k for k, r in self.routes.items() if r.kind == "dropped")

    def missing(self, replaced: set[str]) -> list[str]:
        """Params left (partly) at their random init, not counting those replaced at startup."""
        out = []
        for name, param in self.params.items():
            if name in replaced:
                continue
            got = self.loaded.get(name, set())
            need = set(param.shards) if param.shards else {None}
            if not need <= got:
                out.append(name)
        return out


def plan_load(draft: DraftConfig, shapes: dict[str, tuple[int, ...]]) -> LoadPlan:
    params = sglang_params(draft)
    plan = LoadPlan(params=params, routes={}, loaded={}, shape_errors=[])
    for key, shape in shapes.items():
        route = route_key(key, params, mla=is_mla(draft))
        plan.routes[key] = route
        if route.kind != "param":
            continue
        param = params[route.param]
        want = param.shards[route.shard] if param.shards and route.shard in param.shards else param.shape
        if route.param.endswith(".bias") and param.shards:
            want = want[:1]
        if tuple(shape) != tuple(want):
            plan.shape_errors.append((key, route.param, tuple(shape), tuple(want)))
            continue
        plan.loaded.setdefault(route.param, set()).add(route.shard)
    return plan

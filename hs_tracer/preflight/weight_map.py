"""The parameters SGLang 0.5.23's ``LlamaForCausalLMEagle3`` has, and where each checkpoint key goes.

Mirrors sglang/srt/models/llama_eagle3.py (0.5.23): ``LlamaModel.__init__`` (fc width = target
hidden x num aux, optional ``input_norm`` / ``fc_norm``, decoder layer 0 with a 2H-wide qkv) and
``LlamaForCausalLMEagle3.load_weights``: the legacy renames (``midlayer`` -> ``layers.0``,
``aux_norm_*`` -> ``fc_norm.*``) applied as substring replacements, ``d2t``/``t2d`` consumed by name,
q/k/v and gate/up stacked into ``qkv_proj``/``gate_up_proj``, a name tried as is and then with a
``model.`` prefix, and anything else dropped without a word. tests/test_check_weights.py checks this
mirror against the real class built on CPU.
"""

from __future__ import annotations

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


def num_aux_states(draft: DraftConfig) -> int:
    """``LlamaModel.num_aux_hidden_states``: explicit attr, else len(nested ids), else 3."""
    if draft.num_aux_hidden_states is not None:
        return draft.num_aux_hidden_states
    return len(draft.nested_layer_ids) if draft.nested_layer_ids else 3


def fc_input_hidden(draft: DraftConfig) -> int | None:
    """``hidden_size_in``: ``target_hidden_size`` whenever the key exists (None crashes SGLang)."""
    return draft.target_hidden_size if draft.has_target_hidden_size else draft.hidden_size


def uses_fc_norm(draft: DraftConfig) -> bool:
    return bool(draft.raw.get("fc_norm") or draft.raw.get("use_aux_norm", False))


def uses_norm_before_fc(draft: DraftConfig) -> bool:
    return bool(draft.flag("norm_before_fc"))


def sglang_params(draft: DraftConfig) -> dict[str, Param]:
    """Every parameter ``LlamaForCausalLMEagle3(draft)`` registers, with its full shape."""
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


def route_key(name: str, params: dict[str, Param]) -> KeyTarget:
    """Where ``load_weights`` sends checkpoint key ``name`` (same order of tests as SGLang)."""
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


def load_lm_head_from_target(draft: DraftConfig) -> bool:
    """SGLang replaces the draft head with the target's when no draft vocab is declared."""
    return not draft.tie_word_embeddings and draft.draft_vocab_size is None


def embed_replaced_by_target(draft: DraftConfig) -> bool:
    """``EagleDraftWorker.init_lm_head``: ``set_embed_and_head`` always replaces the embedding;
    ``set_embed`` keeps the draft's own only when ``target_hidden_size != hidden_size``."""
    if load_lm_head_from_target(draft):
        return True
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
        route = route_key(key, params)
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

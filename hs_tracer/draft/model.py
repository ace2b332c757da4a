"""Plain-torch EAGLE-3 draft with the semantics of SGLang's ``LlamaForCausalLMEagle3`` (newest release).

Why its own implementation: the testbed trains the draft with it, the offline acceptance
simulation runs it, and the replay tool feeds it captured live features, all without starting
SGLang. It follows ``sglang/srt/models/llama_eagle3.py`` step by step:

* ``fc`` (K*H_t -> H) is applied only when the incoming feature width differs from the embedding
  width (SGLang's width test: target features at draft-extend are K*H_t wide, the draft's own
  recurrent hidden at draft-decode is H wide and skips fc);
* decoder layer 0: ``residual = h``; ``cat([input_layernorm(embeds), hidden_norm(h)])`` (2H) into
  q/k/v; rope (neox style, ``rope_theta``); causal attention; ``post_attention_layernorm`` fused
  with the residual add; SwiGLU MLP;
* final ``norm`` fused with the residual add: the normed state goes to ``lm_head`` (draft vocab),
  the pre-norm sum is the recurrent hidden handed to the next draft step (``norm_output`` false);
* draft token ids map to target ids through ``d2t`` diffs: ``target = draft + d2t[draft]``.

Two flags SGLang's class lacks follow vLLM's ``llama_eagle3.py`` (which serves speculators'
checkpoints): ``norm_before_fc``, an RMSNorm (``input_norm``) over the K*H_t target features before
``fc``, and ``norm_before_residual``, where the residual of layer 0 is ``hidden_norm(h)`` rather than
``h``. speculators' layout (model dimensions under ``transformer_layer_config``, the rest at the top
level, weights named ``layers.0.*``) is read as vLLM reads it.

The token embedding is the target's (SGLang overwrites the draft's with the target's), so it is
passed in (``embed_weight``) or read from the target checkpoint (:func:`load_target_embedding`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hs_tracer.errors import InputError

# SGLang's legacy names (SpecForge writes ``midlayer.*``); speculators writes ``layers.0.*``.
_LAYER_PREFIXES = ("midlayer.", "layers.0.")


@dataclass
class DraftConfig:
    """The fields of an EAGLE-3 draft config.json that the forward depends on."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    target_hidden_size: int | None = None
    aux_layer_ids: list[int] | None = None
    num_aux_hidden_states: int = 3
    norm_output: bool = False
    norm_before_fc: bool = False
    norm_before_residual: bool = False
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> DraftConfig:
        """Parse a config.json dict the way SGLang's LlamaForCausalLMEagle3 resolves it (vLLM's
        reading for speculators' layout and the two flags SGLang lacks)."""
        eagle = cfg.get("eagle_config") or {}
        ids = eagle.get("eagle_aux_hidden_state_layer_ids")
        num_aux = cfg.get("num_aux_hidden_states") or (len(ids) if ids else 3)
        for flag in ("fc_norm", "use_aux_norm"):
            if eagle.get(flag) or cfg.get(flag):
                raise InputError(
                    f"draft config sets {flag}; hs_tracer's draft forward supports it not yet"
                )
        layer = cfg.get("transformer_layer_config")
        dims = cfg
        if isinstance(layer, dict):  # speculators: the dims nested, the top level over them
            top = {k: v for k, v in cfg.items() if k != "transformer_layer_config" and v is not None}
            dims = {**layer, **top}
        missing = [k for k in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")
                   if k not in dims]
        if missing:
            raise InputError(f"draft config lacks {', '.join(missing)} (at the top level or in "
                             "transformer_layer_config)")
        rope = dims.get("rope_parameters") or {}
        heads = dims["num_attention_heads"]
        return cls(
            hidden_size=dims["hidden_size"],
            intermediate_size=dims["intermediate_size"],
            num_attention_heads=heads,
            num_key_value_heads=dims.get("num_key_value_heads") or heads,
            head_dim=dims.get("head_dim") or dims["hidden_size"] // heads,
            vocab_size=dims["vocab_size"],
            draft_vocab_size=dims.get("draft_vocab_size") or dims["vocab_size"],
            rms_norm_eps=dims.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", dims.get("rope_theta", 10000.0))),
            target_hidden_size=dims.get("target_hidden_size"),
            aux_layer_ids=list(ids) if ids else None,
            num_aux_hidden_states=int(num_aux),
            norm_output=bool(cfg.get("norm_output", False)),
            norm_before_fc=bool(eagle.get("norm_before_fc", cfg.get("norm_before_fc", False))),
            norm_before_residual=bool(cfg.get("norm_before_residual", False)),
            raw=cfg,
        )

    @property
    def fc_in(self) -> int:
        return (self.target_hidden_size or self.hidden_size) * self.num_aux_hidden_states


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 (as SGLang's native path does)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * xf).to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [*, head_dim] for neox-style rope at ``positions``."""
    inv = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim)
    )
    freqs = positions.float()[..., None] * inv
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox rope on ``x`` [..., T, heads, d] with cos/sin [..., T, d]."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x.float() * cos[..., None, :] + rot.float() * sin[..., None, :]).to(x.dtype)


@dataclass
class KVCache:
    """Keys/values of the positions a sequence already wrote ([T, kv_heads, d] each)."""

    k: torch.Tensor | None = None
    v: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.k is None else int(self.k.shape[0])

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` positions (drop rejected speculative entries)."""
        if self.k is not None:
            self.k, self.v = self.k[:n], self.v[:n]


@dataclass
class DraftOutput:
    logits: torch.Tensor  # [T, draft_vocab]
    hidden: torch.Tensor  # [T, H] recurrent hidden for the next draft step (pre-norm unless norm_output)


class Eagle3Draft(nn.Module):
    """EAGLE-3 draft head (one decoder layer over [embedding, fused target features])."""

    def __init__(self, config: DraftConfig, embed_weight: torch.Tensor | None = None) -> None:
        super().__init__()
        c = config
        self.config = c
        h, d = c.hidden_size, c.head_dim
        self.embed_tokens = nn.Embedding(c.vocab_size, h)
        if embed_weight is not None:
            self.set_embedding(embed_weight)
        self.input_norm = RMSNorm(c.fc_in, c.rms_norm_eps) if c.norm_before_fc else None
        self.fc = nn.Linear(c.fc_in, h, bias=False)
        self.input_layernorm = RMSNorm(h, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, c.rms_norm_eps)
        self.q_proj = nn.Linear(2 * h, c.num_attention_heads * d, bias=False)
        self.k_proj = nn.Linear(2 * h, c.num_key_value_heads * d, bias=False)
        self.v_proj = nn.Linear(2 * h, c.num_key_value_heads * d, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * d, h, bias=False)
        self.post_attention_layernorm = RMSNorm(h, c.rms_norm_eps)
        self.gate_proj = nn.Linear(h, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, h, bias=False)
        self.norm = RMSNorm(h, c.rms_norm_eps)
        self.lm_head = nn.Linear(h, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(c.vocab_size, dtype=torch.bool))

    def trainable_parameters(self) -> list[nn.Parameter]:
        """Everything but the embedding (the target's, frozen)."""
        return [p for n, p in self.named_parameters() if not n.startswith("embed_tokens")]

    # ---- checkpoint I/O -------------------------------------------------------------------
    # Module attribute -> checkpoint key (SGLang / SpecForge names).
    KEY_MAP: dict[str, str] = {  # noqa: RUF012
        "fc.weight": "fc.weight",
        "input_layernorm.weight": "midlayer.input_layernorm.weight",
        "hidden_norm.weight": "midlayer.hidden_norm.weight",
        "q_proj.weight": "midlayer.self_attn.q_proj.weight",
        "k_proj.weight": "midlayer.self_attn.k_proj.weight",
        "v_proj.weight": "midlayer.self_attn.v_proj.weight",
        "o_proj.weight": "midlayer.self_attn.o_proj.weight",
        "post_attention_layernorm.weight": "midlayer.post_attention_layernorm.weight",
        "gate_proj.weight": "midlayer.mlp.gate_proj.weight",
        "up_proj.weight": "midlayer.mlp.up_proj.weight",
        "down_proj.weight": "midlayer.mlp.down_proj.weight",
        "norm.weight": "norm.weight",
        "lm_head.weight": "lm_head.weight",
        "d2t": "d2t",
        "t2d": "t2d",
    }

    def key_map(self) -> dict[str, str]:
        """``KEY_MAP`` plus the optional modules this config creates."""
        extra = {"input_norm.weight": "input_norm.weight"} if self.input_norm is not None else {}
        return {**self.KEY_MAP, **extra}

    def checkpoint_state_dict(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """Weights under SGLang's checkpoint names (no embedding: SGLang shares the target's)."""
        own = self.state_dict()
        out = {}
        for attr, key in self.key_map().items():
            t = own[attr].detach().clone().contiguous()
            if dtype is not None and t.is_floating_point():
                t = t.to(dtype)
            out[key] = t
        return out

    def save_pretrained(self, out_dir: Path, dtype: torch.dtype = torch.bfloat16) -> None:
        """Write config.json (the config this draft was built from) and model.safetensors."""
        from safetensors.torch import save_file

        out_dir.mkdir(parents=True, exist_ok=True)
        save_file(
            self.checkpoint_state_dict(dtype), str(out_dir / "model.safetensors"), metadata={"format": "pt"}
        )
        (out_dir / "config.json").write_text(json.dumps(self.config.raw, indent=2, sort_keys=True) + "\n")

    @classmethod
    def from_pretrained(
        cls,
        draft_dir: Path | str,
        embed_weight: torch.Tensor | None = None,
        target_dir: Path | str | None = None,
    ) -> Eagle3Draft:
        """Load a draft dir (config.json + *.safetensors) into fp32.

        The embedding comes from ``embed_weight``, else from ``target_dir``'s checkpoint, else from
        the draft's own ``embed_tokens.weight`` if it ships one.
        """
        from safetensors.torch import load_file

        draft_dir = Path(draft_dir)
        cfg_path = draft_dir / "config.json"
        if not cfg_path.exists():
            raise FileNotFoundError(f"{cfg_path} not found: point at an EAGLE-3 draft directory")
        config = DraftConfig.from_dict(json.loads(cfg_path.read_text()))
        weights: dict[str, torch.Tensor] = {}
        files = sorted(draft_dir.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {draft_dir}: the draft weights are missing")
        for f in files:
            weights.update(load_file(str(f)))
        if embed_weight is None and target_dir is not None:
            embed_weight = load_target_embedding(Path(target_dir))
        if embed_weight is None:
            embed_weight = weights.get("embed_tokens.weight", weights.get("model.embed_tokens.weight"))
        if embed_weight is None:
            raise ValueError(
                f"{draft_dir} has no embed_tokens.weight; pass embed_weight= or target_dir= "
                "(SGLang shares the target's embedding)"
            )
        model = cls(config, embed_weight.float())
        model.load_checkpoint(weights)
        return model

    def load_checkpoint(self, weights: dict[str, torch.Tensor]) -> None:
        """Load SGLang-named (``midlayer.*``) or speculators-named (``layers.0.*``) weights."""
        norm: dict[str, torch.Tensor] = {}
        for key, t in weights.items():
            k = key.removeprefix("model.")
            for p in _LAYER_PREFIXES[1:]:
                if k.startswith(p):
                    k = "midlayer." + k[len(p) :]
            norm[k] = t
        own = self.state_dict()
        new: dict[str, torch.Tensor] = {}
        missing = []
        for attr, key in self.key_map().items():
            if key in norm:
                t = norm[key]
                if tuple(t.shape) != tuple(own[attr].shape):
                    raise ValueError(
                        f"draft weight {key} has shape {tuple(t.shape)}, "
                        f"config implies {tuple(own[attr].shape)}"
                    )
                new[attr] = t.to(own[attr].dtype)
            elif key in ("d2t", "t2d") and self.config.draft_vocab_size == self.config.vocab_size:
                continue  # full vocabulary: the identity mapping is right
            else:
                missing.append(key)
        if missing:
            raise ValueError(f"draft checkpoint lacks {missing}; re-export it with SGLang key names")
        self.load_state_dict(new, strict=False)

    def set_embedding(self, weight: torch.Tensor) -> None:
        """Use the target's token embedding (what SGLang's set_embed does)."""
        if tuple(weight.shape) != tuple(self.embed_tokens.weight.shape):
            raise ValueError(
                f"target embedding {tuple(weight.shape)} does not fit draft vocab/hidden "
                f"{tuple(self.embed_tokens.weight.shape)}"
            )
        with torch.no_grad():
            self.embed_tokens.weight.copy_(weight)

    # ---- forward ----------------------------------------------------------------------------
    def project(self, features: torch.Tensor) -> torch.Tensor:
        """SGLang's width test: fc only when features are not already H wide (after ``input_norm``
        when ``norm_before_fc``)."""
        if features.shape[-1] != self.config.hidden_size:
            if features.shape[-1] != self.config.fc_in:
                raise ValueError(
                    f"draft input width {features.shape[-1]} is neither H={self.config.hidden_size} nor "
                    f"K*H={self.config.fc_in}"
                )
            return self.fc(features if self.input_norm is None else self.input_norm(features))
        return features

    def qkv(
        self, hidden: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer input -> (q, k, v with rope, residual). ``hidden`` is already H wide ([..., T, H])."""
        c = self.config
        normed = self.hidden_norm(hidden)
        residual = normed if c.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(self.embed_tokens(input_ids)), normed], dim=-1)
        shape = x.shape[:-1]
        q = self.q_proj(x).view(*shape, c.num_attention_heads, c.head_dim)
        k = self.k_proj(x).view(*shape, c.num_key_value_heads, c.head_dim)
        v = self.v_proj(x).view(*shape, c.num_key_value_heads, c.head_dim)
        cos, sin = rope_cos_sin(positions, c.head_dim, c.rope_theta)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, residual

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Attention of q [..., Tq, nh, d] over k/v [..., Tk, nkv, d] with bool ``mask`` [..., Tq, Tk]."""
        c = self.config
        rep = c.num_attention_heads // c.num_key_value_heads
        k = k.repeat_interleave(rep, dim=-2)
        v = v.repeat_interleave(rep, dim=-2)
        scores = torch.einsum("...qhd,...khd->...hqk", q.float(), k.float()) * c.head_dim**-0.5
        scores = scores.masked_fill(~mask.unsqueeze(-3), float("-inf"))
        out = torch.einsum("...hqk,...khd->...qhd", scores.softmax(-1), v.float()).to(q.dtype)
        return self.o_proj(out.flatten(-2))

    def finish(self, attn_out: torch.Tensor, residual: torch.Tensor) -> DraftOutput:
        """Post-attention half of the layer, final norm and lm_head."""
        residual = attn_out + residual
        h = self.post_attention_layernorm(residual)
        h = self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))
        pre = h + residual
        normed = self.norm(pre)
        return DraftOutput(self.lm_head(normed), normed if self.config.norm_output else pre)

    def forward(
        self,
        features: torch.Tensor,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache | None = None,
    ) -> DraftOutput:
        """One sequence: ``features`` [T, K*H_t] (target) or [T, H] (own recurrent hidden).

        Queries attend causally to the new positions and to everything already in ``cache``
        (which is extended in place when given).
        """
        hidden = self.project(features)
        q, k, v, residual = self.qkv(hidden, input_ids, positions)
        past = 0
        if cache is not None:
            past = len(cache)
            if cache.k is not None:
                k = torch.cat([cache.k, k])
                v = torch.cat([cache.v, v])
            cache.k, cache.v = k, v
        t = q.shape[0]
        mask = torch.ones(t, past + t, dtype=torch.bool, device=q.device).tril(diagonal=past)
        return self.finish(self.attend(q, k, v, mask), residual)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft vocabulary ids -> target ids (``d2t`` holds diffs)."""
        return draft_ids + self.d2t[draft_ids]


def load_target_embedding(target_dir: Path) -> torch.Tensor:
    """``model.embed_tokens.weight`` from a target checkpoint dir (safetensors, fp32)."""
    from safetensors import safe_open

    for f in sorted(Path(target_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            for name in ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight"):
                if name in fh.keys():  # noqa: SIM118
                    return fh.get_tensor(name).float()
    raise FileNotFoundError(f"no model.embed_tokens.weight in {target_dir}/*.safetensors")

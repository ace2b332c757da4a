"""Kimi-K2.5 on the testbed: the testbed target and draft in the formats Kimi-K2.5 ships.

* **Target** ``KimiK25ForConditionalGeneration`` (``model_type: kimi_k25``): the trained testbed
  DeepSeek-V3 text model as ``text_config``, its weights under ``language_model.``, and a tiny
  vision config (one MoonViT block). SGLang serves it through the wrapper exactly as it serves the
  real Kimi-K2.5: the capture layers live at ``language_model.model.layers_to_capture``.
* **Draft** ``Eagle3DeepseekV2ForCausalLM`` (SGLang's ``models/kimi_k25_eagle3.py``): the EAGLE-3
  layout with DeepSeek multi-latent attention, whose ``fc`` is a ``ColumnParallelLinear``.

The draft's weights are the trained testbed draft's, converted: fc, norms, MLP, lm_head and the
vocabulary map carry over unchanged; the attention becomes MLA with latent ranks as wide as the
attention input, identity down-projections and the trained q/k/v/o projections in the no-rope
part of each head (the rope part is zero). MLA normalises its latents, so q, k and v are divided
by the input's RMS; a constant from the trained norm weights restores their typical scale. That
attention has no position signal, so acceptance is below the Llama-layout draft's (measured in
docs/testbed.md); the features the target hands the draft, which is what hs_tracer checks, are
the same tensors as with the Llama-layout draft.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

ROPE_DIM = 8  # the draft's rope head dim (its rope part carries zeros)

TINY_VISION = {
    "patch_size": 14,
    "init_pos_emb_height": 4,
    "init_pos_emb_width": 4,
    "init_pos_emb_time": 1,
    "pos_emb_type": "divided_fixed",
    "num_attention_heads": 2,
    "num_hidden_layers": 1,
    "hidden_size": 32,
    "intermediate_size": 64,
    "merge_kernel_size": [2, 2],
    "video_attn_type": "spatial_temporal",
    "merge_type": "sd2_tpool",
    "mm_projector_type": "patchmerger",
    "mm_hidden_size": 32,
    "vt_hidden_size": 32,
    "projector_hidden_act": "gelu",
    "projector_ln_eps": 1e-5,
}
"""A one-block MoonViT: the wrapper builds a vision tower; text-only serving never runs it."""


def write_target(target: Path, out: Path) -> Path:
    """``out``: the testbed target as ``KimiK25ForConditionalGeneration`` (weights re-keyed)."""
    from safetensors.torch import load_file, save_file

    text = json.loads((target / "config.json").read_text())
    vision = {**TINY_VISION, "text_hidden_size": text["hidden_size"]}
    cfg = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "text_config": text,
        "vision_config": vision,
        "media_placeholder_token_id": text["vocab_size"] - 1,
        "pad_token_id": text.get("pad_token_id", 0),
        "bos_token_id": text.get("bos_token_id"),
        "eos_token_id": text.get("eos_token_id"),
        "tie_word_embeddings": False,
        "torch_dtype": text.get("torch_dtype", "bfloat16"),
    }
    out.mkdir(parents=True)
    for item in sorted(target.iterdir()):
        if item.name not in ("config.json", "model.safetensors") and item.is_file():
            shutil.copy2(item, out / item.name)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    weights = load_file(str(target / "model.safetensors"))
    save_file({f"language_model.{k}": v.contiguous() for k, v in sorted(weights.items())},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def draft_config(llama: dict[str, Any], target_text: dict[str, Any]) -> dict[str, Any]:
    """config.json of the MLA draft that :func:`write_draft` converts ``llama`` (the testbed draft's
    config) into."""
    h, heads, head_dim = llama["hidden_size"], llama["num_attention_heads"], llama["head_dim"]
    cfg = {k: v for k, v in llama.items() if k not in ("num_key_value_heads", "head_dim",
                                                        "attention_bias", "rope_parameters")}
    cfg.update({
        "architectures": ["Eagle3DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v3",
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "q_lora_rank": 2 * h,
        "kv_lora_rank": 2 * h,
        "qk_nope_head_dim": head_dim,
        "qk_rope_head_dim": ROPE_DIM,
        "v_head_dim": head_dim,
        # The target's rope entry (yarn with factor 1, i.e. plain rope): SGLang's CPU rope for
        # DeepSeek attention implements only that type.
        "rope_theta": target_text["rope_theta"],
        "rope_parameters": target_text["rope_parameters"],
        "target_hidden_size": target_text["hidden_size"],
    })
    return cfg


def convert_weights(llama_cfg: dict[str, Any], weights: dict[str, Any]) -> dict[str, Any]:
    """The Llama-layout draft's tensors -> the MLA draft's checkpoint keys (see the module doc)."""
    import torch

    h, heads, hd = llama_cfg["hidden_size"], llama_cfg["num_attention_heads"], llama_cfg["head_dim"]
    width = 2 * h  # attention input: [input_layernorm(embed), hidden_norm(features)]
    f32 = {k: v.float() for k, v in weights.items()}
    g = torch.cat([f32["midlayer.input_layernorm.weight"], f32["midlayer.hidden_norm.weight"]])
    scale = float(g.pow(2).mean().sqrt())  # typical RMS of the attention input
    # MLA scores use (nope + rope)^-0.5 where the Llama draft used head_dim^-0.5.
    q_gain = scale * math.sqrt((hd + ROPE_DIM) / hd)
    wq, wk, wv = (f32[f"midlayer.self_attn.{n}_proj.weight"] for n in ("q", "k", "v"))
    q_b = torch.zeros(heads * (hd + ROPE_DIM), width)
    kv_b = torch.zeros(heads * (hd + hd), width)
    for i in range(heads):
        rows = slice(i * hd, (i + 1) * hd)
        q_b[i * (hd + ROPE_DIM): i * (hd + ROPE_DIM) + hd] = wq[rows] * q_gain
        kv_b[i * 2 * hd: i * 2 * hd + hd] = wk[rows] * scale
        kv_b[i * 2 * hd + hd: (i + 1) * 2 * hd] = wv[rows] * scale
    kv_a = torch.cat([torch.eye(width), torch.zeros(ROPE_DIM, width)])
    attn = "layers.0.self_attn."
    out = {
        "fc.weight": f32["fc.weight"],
        "norm.weight": f32["norm.weight"],
        "lm_head.weight": f32["lm_head.weight"],
        f"{attn}q_a_proj.weight": torch.eye(width),
        f"{attn}q_a_layernorm.weight": torch.ones(width),
        f"{attn}q_b_proj.weight": q_b,
        f"{attn}kv_a_proj_with_mqa.weight": kv_a,
        f"{attn}kv_a_layernorm.weight": torch.ones(width),
        f"{attn}kv_b_proj.weight": kv_b,
        f"{attn}o_proj.weight": f32["midlayer.self_attn.o_proj.weight"],
    }
    for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm", "mlp.gate_proj",
                 "mlp.up_proj", "mlp.down_proj"):
        out[f"layers.0.{name}.weight"] = f32[f"midlayer.{name}.weight"]
    dtype = weights["fc.weight"].dtype
    out = {k: v.to(dtype).contiguous() for k, v in out.items()}
    out["d2t"], out["t2d"] = weights["d2t"], weights["t2d"]
    return out


def write_draft(draft: Path, target: Path, out: Path) -> Path:
    """``out``: the testbed draft as ``Eagle3DeepseekV2ForCausalLM`` (Kimi-K2.5's MLA draft)."""
    from safetensors.torch import load_file, save_file

    llama = json.loads((draft / "config.json").read_text())
    text = json.loads((target / "config.json").read_text())
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(draft_config(llama, text), indent=2, sort_keys=True) + "\n")
    weights = convert_weights(llama, load_file(str(draft / "model.safetensors")))
    save_file(dict(sorted(weights.items())), str(out / "model.safetensors"), metadata={"format": "pt"})
    return out

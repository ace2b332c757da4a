"""Config-only checkpoints at DeepSeek-V3 width for throughput runs: a target (hidden 7168, MLA with
DeepSeek-V3's ranks and head sizes, a few layers and experts) and an EAGLE-3 draft of the same width.

Nothing large is written or carried: the directories hold ``config.json`` only and SGLang fills the
weights on the GPU (``--load-format dummy --speculative-draft-load-format dummy``), so the run
measures real kernel shapes with random weights. Per-token cost of attention and the dense layers is
DeepSeek-V3's; the MoE has 32 experts (top-8) instead of 256, so its weights fit many times over.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

HIDDEN = 7168
VOCAB = 129280
NUM_LAYERS = 5
# EAGLE-3 aux layer ids as drafts for DeepSeek configure them (first id 1: SGLang adds 1 to each).
AUX_LAYER_IDS = [1, 2, 3]

TARGET: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": HIDDEN,
    "vocab_size": VOCAB,
    "num_hidden_layers": NUM_LAYERS,
    "first_k_dense_replace": 1,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "n_routed_experts": 32,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "n_group": 1,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "moe_layer_freq": 1,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 163840,
    "rope_theta": 10000.0,
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                        "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
                        "mscale": 1.0, "mscale_all_dim": 1.0},
    "rope_interleave": True,
    "num_nextn_predict_layers": 0,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "torch_dtype": "bfloat16",
    "use_cache": True,
}

DRAFT: dict[str, Any] = {
    "architectures": ["LlamaForCausalLMEagle3"],
    "model_type": "llama",
    "hidden_size": HIDDEN,
    "vocab_size": VOCAB,
    "draft_vocab_size": 32000,
    "num_hidden_layers": 1,
    "num_attention_heads": 56,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 18432,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 163840,
    "rope_theta": 10000.0,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "eagle_config": {"eagle_aux_hidden_state_layer_ids": AUX_LAYER_IDS, "use_aux_hidden_state": True},
    "attention_bias": False,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "torch_dtype": "bfloat16",
}


def write_models(out: Path) -> Path:
    """Write ``out/target/config.json``, ``out/draft/config.json`` and ``out/summary.json``."""
    for name, cfg in (("target", TARGET), ("draft", DRAFT)):
        (out / name).mkdir(parents=True, exist_ok=True)
        (out / name / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")
    summary = {"target": {k: TARGET[k] for k in ("hidden_size", "num_hidden_layers", "n_routed_experts",
                                                 "num_experts_per_tok", "kv_lora_rank", "q_lora_rank",
                                                 "num_attention_heads", "vocab_size")},
               "draft": {k: DRAFT[k] for k in ("hidden_size", "num_hidden_layers", "draft_vocab_size",
                                               "intermediate_size")},
               "aux_layer_ids": AUX_LAYER_IDS, "weights": "random (SGLang --load-format dummy)"}
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return out

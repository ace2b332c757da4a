"""A Kimi-K2 EAGLE-3 draft at its real size (a 2.7 GB checkpoint, written sparse), checked from headers.

Config: SpecForge's ``configs/kimi-k2-eagle3.json`` (ids ``[2, 30, 58]``, hidden 7168, draft vocab
32000); target: Kimi-K2 (``DeepseekV3ForCausalLM``, 61 layers, hidden 7168, vocab 163840). This is the
Kimi hazard: SpecForge's training capture (+1 always) fed blocks
2, 30, 58; SGLang 0.5.23 on a DeepSeek target takes ``[2, 30, 58]`` as-is and feeds blocks 1, 29, 57.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from test_check_drafts import codes, sparse_safetensors

from hs_tracer import sources as src
from hs_tracer.preflight.runner import run_check

H, V, DV, HEADS, HD, INTER = 7168, 163840, 32000, 64, 128, 18432

KIMI_K2_DRAFT_CONFIG = {  # SpecForge configs/kimi-k2-eagle3.json
    "architectures": ["LlamaForCausalLMEagle3"],
    "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 30, 58], "use_aux_hidden_state": True},
    "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 163584, "eos_token_id": 163585,
    "head_dim": HD, "hidden_act": "silu", "hidden_size": H, "initializer_range": 0.02,
    "intermediate_size": INTER, "max_position_embeddings": 131072, "max_window_layers": 48,
    "model_type": "kimi_k2", "num_attention_heads": HEADS, "num_hidden_layers": 1,
    "num_key_value_heads": HEADS,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.53.2",
    "use_cache": True, "use_sliding_window": False, "vocab_size": V, "draft_vocab_size": DV,
}


@pytest.fixture(scope="module")
def kimi(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("kimi")
    target = base / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2", "hidden_size": H,
        "num_hidden_layers": 61, "vocab_size": V, "first_k_dense_replace": 1, "kv_lora_rank": 512}))
    draft = base / "draft"
    draft.mkdir()
    (draft / "config.json").write_text(json.dumps(KIMI_K2_DRAFT_CONFIG, indent=2))
    rng = np.random.default_rng(0)
    used = np.sort(rng.choice(V, size=DV, replace=False))
    t2d = np.zeros(V, bool)
    t2d[used] = True
    q = HEADS * HD
    tensors = {
        "fc.weight": ("BF16", (H, 3 * H), None),
        "midlayer.self_attn.q_proj.weight": ("BF16", (q, 2 * H), None),
        "midlayer.self_attn.k_proj.weight": ("BF16", (q, 2 * H), None),
        "midlayer.self_attn.v_proj.weight": ("BF16", (q, 2 * H), None),
        "midlayer.self_attn.o_proj.weight": ("BF16", (H, q), None),
        "midlayer.mlp.gate_proj.weight": ("BF16", (INTER, H), None),
        "midlayer.mlp.up_proj.weight": ("BF16", (INTER, H), None),
        "midlayer.mlp.down_proj.weight": ("BF16", (H, INTER), None),
        "midlayer.input_layernorm.weight": ("BF16", (H,), None),
        "midlayer.hidden_norm.weight": ("BF16", (H,), None),
        "midlayer.post_attention_layernorm.weight": ("BF16", (H,), None),
        "norm.weight": ("BF16", (H,), None),
        "lm_head.weight": ("BF16", (DV, H), None),
        "d2t": ("I64", (DV,), (used - np.arange(DV)).astype("<i8").tobytes()),
        "t2d": ("BOOL", (V,), t2d.tobytes()),
    }
    sparse_safetensors(draft / "model.safetensors", tensors)
    return draft, target


def test_real_size_draft_is_read_from_headers(kimi: tuple[Path, Path]) -> None:
    draft, target = kimi
    assert (draft / "model.safetensors").stat().st_size > 2_000_000_000  # never read whole
    res = run_check(draft, target)
    assert res.summary["engine"]["layers_to_capture"] == [2, 30, 58]
    assert res.summary["engine"]["sources"] == ["block:1", "block:29", "block:57"]
    # weights, shapes and d2t/t2d are all fine; read in SpecForge's convention (the producer of this
    # config) the ids name blocks 2, 30, 58 while SGLang feeds 1, 29, 57: what is served differs from
    # what the draft was trained on, so the first-id rule is critical, not a latent warning
    # (and no profile: the info that the served layers were not compared with the training data)
    assert codes(res) == {"layer_id_convention": "critical", "spec_args_adjusted": "info",
                          "insufficient_data": "info"}


def test_real_size_draft_against_its_training_layers(kimi: tuple[Path, Path]) -> None:
    draft, target = kimi
    trained = src.to_sources([2, 30, 58], src.Convention.SPECFORGE, 61)  # SpecForge capture: +1 always
    res = run_check(draft, target, trained_sources=trained)
    slots = [(f.slot, f.expected, f.observed) for f in res.report.findings if f.slot is not None]
    assert slots == [(0, "block:2", "block:1"), (1, "block:30", "block:29"), (2, "block:58", "block:57")]
    assert res.report.status == "miswired" and res.report.exit_code == 1
    assert any("[3, 31, 59]" in f.fix for f in res.report.findings)

"""Tiny drafts written the way SpecForge, speculators and the original EAGLE write them, for the check tests.

SpecForge / SGLang drafts: ``LlamaConfig`` (+ ``draft_vocab_size``, optional ``eagle_config``) saved
with ``save_pretrained``; ``model.safetensors`` via ``safetensors.torch.save_file`` with keys
``fc.weight``, ``midlayer.*``, ``norm.weight``, ``lm_head.weight``, ``d2t`` (int64 diffs), ``t2d``
(bool) and no embedding. speculators: ``Eagle3Speculator`` config
with ``transformer_layer_config`` and top-level ids, keys ``layers.0.*`` plus ``embed_tokens.weight``
Original EAGLE: ``architectures: ["LlamaForCausalLM"]``.

The tests in this file pin the builders themselves: a clean SpecForge draft passes every check.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig

N_LAYERS = 8  # target depth
H = 64  # target and draft hidden size
VOCAB = 512  # target vocabulary
DRAFT_VOCAB = 128
HEADS, KV_HEADS, HEAD_DIM, INTER = 4, 2, 16, 128


def target_config(
    path: Path,
    *,
    arch: str = "LlamaForCausalLM",
    layers: int = N_LAYERS,
    hidden: int = H,
    vocab: int = VOCAB,
    model_type: str = "llama",
) -> Path:
    """A target config.json as transformers writes it (only the fields a check reads matter)."""
    path.mkdir(parents=True, exist_ok=True)
    cfg = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=INTER,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        num_hidden_layers=layers,
        vocab_size=vocab,
    )
    cfg.architectures = [arch]
    cfg.save_pretrained(path)
    if model_type != "llama":
        data = json.loads((path / "config.json").read_text())
        data["model_type"] = model_type
        (path / "config.json").write_text(json.dumps(data, indent=2))
    return path


def vocab_mapping(
    draft_vocab: int = DRAFT_VOCAB, vocab: int = VOCAB, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """d2t/t2d as SpecForge's process_token_dict_to_mappings builds them (diffs + bool mask)."""
    rng = np.random.default_rng(seed)
    used = np.sort(rng.choice(vocab, size=draft_vocab, replace=False))
    d2t = torch.tensor(used - np.arange(draft_vocab), dtype=torch.int64)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[torch.tensor(used)] = True
    return d2t, t2d


def draft_state(
    *,
    prefix: str = "midlayer",
    n_aux: int = 3,
    hidden_in: int = H,
    draft_vocab: int = DRAFT_VOCAB,
    with_embed: bool = False,
    vocab: int = VOCAB,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """A trained-looking EAGLE-3 draft state dict (SpecForge key names unless prefix says otherwise)."""
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    state = {
        "fc.weight": w(H, n_aux * hidden_in),
        f"{prefix}.self_attn.q_proj.weight": w(q, 2 * H),
        f"{prefix}.self_attn.k_proj.weight": w(kv, 2 * H),
        f"{prefix}.self_attn.v_proj.weight": w(kv, 2 * H),
        f"{prefix}.self_attn.o_proj.weight": w(H, q),
        f"{prefix}.mlp.gate_proj.weight": w(INTER, H),
        f"{prefix}.mlp.up_proj.weight": w(INTER, H),
        f"{prefix}.mlp.down_proj.weight": w(H, INTER),
        f"{prefix}.input_layernorm.weight": torch.ones(H, dtype=torch.bfloat16),
        f"{prefix}.hidden_norm.weight": torch.ones(H, dtype=torch.bfloat16),
        f"{prefix}.post_attention_layernorm.weight": torch.ones(H, dtype=torch.bfloat16),
        "norm.weight": torch.ones(H, dtype=torch.bfloat16),
        "lm_head.weight": w(draft_vocab, H),
    }
    d2t, t2d = vocab_mapping(draft_vocab, vocab, seed)
    state["d2t"], state["t2d"] = d2t, t2d
    if with_embed:
        state["embed_tokens.weight"] = w(vocab, H)
    return state


def specforge_draft(
    path: Path,
    *,
    layer_ids: list[int] | None = None,
    state: dict[str, torch.Tensor] | None = None,
    config_extra: dict[str, Any] | None = None,
    draft_vocab: int | None = DRAFT_VOCAB,
    eagle_config: Any = "auto",
) -> Path:
    """A SpecForge export: LlamaConfig.save_pretrained + safetensors save_file (metadata format=pt)."""
    path.mkdir(parents=True, exist_ok=True)
    cfg = LlamaConfig(
        hidden_size=H,
        intermediate_size=INTER,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        num_hidden_layers=1,
        vocab_size=VOCAB,
        tie_word_embeddings=False,
    )
    cfg.architectures = ["LlamaForCausalLMEagle3"]
    cfg.draft_vocab_size = draft_vocab
    if eagle_config == "auto":
        if layer_ids is not None:
            cfg.eagle_config = {"eagle_aux_hidden_state_layer_ids": layer_ids, "use_aux_hidden_state": True}
    elif eagle_config is not None:
        cfg.eagle_config = eagle_config
    for key, value in (config_extra or {}).items():
        setattr(cfg, key, value)
    cfg.save_pretrained(path)
    save_file(
        state if state is not None else draft_state(),
        str(path / "model.safetensors"),
        metadata={"format": "pt"},
    )
    return path


def speculators_draft(
    path: Path,
    *,
    layer_ids: list[int] | None = (2, 4, 5),
    state: dict[str, torch.Tensor] | None = None,
    extra: dict[str, Any] | None = None,
) -> Path:
    """A speculators Eagle3Speculator export (config fields of Eagle3SpeculatorConfig)."""
    path.mkdir(parents=True, exist_ok=True)
    layer = LlamaConfig(
        hidden_size=H,
        intermediate_size=INTER,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        num_hidden_layers=1,
        vocab_size=VOCAB,
    ).to_dict()
    config = {
        "architectures": ["Eagle3Speculator"],
        "auto_map": {"": "eagle3.Eagle3SpeculatorConfig"},
        "speculators_model_type": "eagle3",
        "speculators_version": "0.2.0",
        "draft_vocab_size": DRAFT_VOCAB,
        "eagle_aux_hidden_state_layer_ids": list(layer_ids) if layer_ids is not None else None,
        "norm_before_residual": False,
        "embed_requires_grad": False,
        "target_hidden_size": None,
        "has_no_defaults_at_init": False,
        "transformer_layer_config": layer,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": 3,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "verifier": {"name_or_path": "tiny-target", "architectures": ["LlamaForCausalLM"]},
        },
        "torch_dtype": "bfloat16",
        "transformers_version": "4.56.1",
    }
    config.update(extra or {})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    st = state if state is not None else draft_state(prefix="layers.0", with_embed=True)
    save_file(st, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def eagle_draft(path: Path) -> Path:
    """An original EAGLE (SafeAILab) EAGLE-3 draft: LlamaForCausalLM architecture, same weight names."""
    path.mkdir(parents=True, exist_ok=True)
    cfg = LlamaConfig(
        hidden_size=H,
        intermediate_size=INTER,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        num_hidden_layers=1,
        vocab_size=VOCAB,
    )
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.draft_vocab_size = DRAFT_VOCAB
    cfg.save_pretrained(path)
    save_file(draft_state(), str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def codes(result) -> dict[str, str]:
    """finding code -> worst severity, for compact assertions."""
    order = {"info": 0, "warning": 1, "critical": 2}
    out: dict[str, str] = {}
    for f in result.report.findings:
        sev = f.severity.value
        if order[sev] >= order.get(out.get(f.code.value, "info"), 0):
            out[f.code.value] = sev
    return out


def problems(result) -> list[str]:
    """Findings above info, as one-liners (pytest shows them on failure)."""
    return [f.one_line() for f in result.report.findings if f.severity.value != "info"]


# ---- the builders themselves -------------------------------------------------------------------


def test_specforge_builder_writes_what_specforge_writes(tmp_path: Path) -> None:
    d = specforge_draft(tmp_path / "d", layer_ids=[1, 3, 4])
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    from safetensors import safe_open

    with safe_open(str(d / "model.safetensors"), "pt") as fh:
        keys = set(fh.keys())
        d2t = fh.get_tensor("d2t")
    assert "midlayer.self_attn.q_proj.weight" in keys and "embed_tokens.weight" not in keys
    assert d2t.dtype == torch.int64 and bool((d2t >= 0).all())


@pytest.mark.parametrize("ids", [[1, 3, 4], None])
def test_clean_specforge_draft_passes(tmp_path: Path, ids: list[int] | None) -> None:
    from hs_tracer.preflight.runner import run_check

    target = target_config(tmp_path / "t")
    draft = specforge_draft(tmp_path / "d", layer_ids=ids)
    result = run_check(draft, target)
    if ids is None:  # no ids: only the "default layers used" warning (and: nothing compared with training)
        want = {"layer_ids_ignored": "warning", "spec_args_adjusted": "info", "insufficient_data": "info"}
        assert codes(result) == want, problems(result)
    else:
        assert problems(result) == []
        assert result.report.exit_code == 0 and result.report.status == "ok"


def sparse_safetensors(path: Path, tensors: dict[str, tuple[str, tuple[int, ...], bytes | None]]) -> Path:
    """A safetensors file at real model size without the disk: the header is exact, tensors given as
    None are a sparse hole of the right length (the preflight must never read them)."""
    import struct

    itemsize = {"BF16": 2, "F16": 2, "F32": 4, "I64": 8, "BOOL": 1}
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (dtype, shape, _) in tensors.items():
        n = int(np.prod(shape)) * itemsize[dtype]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with path.open("wb") as fh:
        fh.write(struct.pack("<Q", len(raw)) + raw)
        start = fh.tell()
        for name, (_, _, data) in tensors.items():
            begin, end = header[name]["data_offsets"]
            if data is not None:
                assert len(data) == end - begin, name
                fh.seek(start + begin)
                fh.write(data)
        fh.truncate(start + offset)
    return path


MLA_DIMS = {
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
}


def mla_state(*, n_aux: int = 3, seed: int = 0) -> dict[str, torch.Tensor]:
    """A Kimi MLA EAGLE-3 draft (``kimi-k2.5-eagle3-mla`` layout: ``layers.0.*``, unfused q_a/kv_a)."""
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    m = MLA_DIMS
    p = "layers.0.self_attn"
    state = {
        "fc.weight": w(H, n_aux * H),
        f"{p}.q_a_proj.weight": w(m["q_lora_rank"], 2 * H),
        f"{p}.q_a_layernorm.weight": torch.ones(m["q_lora_rank"], dtype=torch.bfloat16),
        f"{p}.q_b_proj.weight": w(HEADS * (m["qk_nope_head_dim"] + m["qk_rope_head_dim"]), m["q_lora_rank"]),
        f"{p}.kv_a_proj_with_mqa.weight": w(m["kv_lora_rank"] + m["qk_rope_head_dim"], 2 * H),
        f"{p}.kv_a_layernorm.weight": torch.ones(m["kv_lora_rank"], dtype=torch.bfloat16),
        f"{p}.kv_b_proj.weight": w(HEADS * (m["qk_nope_head_dim"] + m["v_head_dim"]), m["kv_lora_rank"]),
        f"{p}.o_proj.weight": w(H, HEADS * m["v_head_dim"]),
        "layers.0.mlp.gate_proj.weight": w(INTER, H),
        "layers.0.mlp.up_proj.weight": w(INTER, H),
        "layers.0.mlp.down_proj.weight": w(H, INTER),
        "layers.0.input_layernorm.weight": torch.ones(H, dtype=torch.bfloat16),
        "layers.0.hidden_norm.weight": torch.ones(H, dtype=torch.bfloat16),
        "layers.0.post_attention_layernorm.weight": torch.ones(H, dtype=torch.bfloat16),
        "norm.weight": torch.ones(H, dtype=torch.bfloat16),
        "lm_head.weight": w(DRAFT_VOCAB, H),
    }
    state["d2t"], state["t2d"] = vocab_mapping(DRAFT_VOCAB, VOCAB, seed)
    return state


def mla_draft(
    path: Path,
    *,
    layer_ids: list[int] | None = (1, 3, 4),
    state: dict[str, torch.Tensor] | None = None,
    config_extra: dict[str, Any] | None = None,
) -> Path:
    """A Kimi MLA draft: DeepseekV3Config.save_pretrained with the Eagle3DeepseekV2ForCausalLM class."""
    from transformers import DeepseekV3Config

    path.mkdir(parents=True, exist_ok=True)
    cfg = DeepseekV3Config(
        hidden_size=H,
        intermediate_size=INTER,
        num_attention_heads=HEADS,
        num_hidden_layers=1,
        vocab_size=VOCAB,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        rope_scaling={
            "rope_type": "yarn",
            "factor": 1.0,
            "original_max_position_embeddings": 512,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        **MLA_DIMS,
    )
    cfg.architectures = ["Eagle3DeepseekV2ForCausalLM"]
    cfg.draft_vocab_size = DRAFT_VOCAB
    if layer_ids is not None:
        cfg.eagle_config = {"eagle_aux_hidden_state_layer_ids": list(layer_ids), "use_aux_hidden_state": True}
    for key, value in (config_extra or {}).items():
        setattr(cfg, key, value)
    cfg.save_pretrained(path)
    save_file(
        state if state is not None else mla_state(),
        str(path / "model.safetensors"),
        metadata={"format": "pt"},
    )
    return path

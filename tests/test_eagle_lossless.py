"""The correctness oracle for the CPU EAGLE-3 path: greedy speculative decoding is lossless.

With temperature 0, EAGLE-3 must commit exactly the tokens plain decoding of the same target
commits, whatever the draft proposes: a wrong tree mask, a wrong cache location, a wrong accept
index or bonus token shows up as a different token sequence. The real ``sgl.Engine`` runs with
the testbed runtime (pure-torch sgl-kernel ops, ``intel_amx`` attention backend) for plain
decoding, chain drafts (topk 1, 1 and 3 steps) and a tree draft (topk 2, 3 steps, 6 draft
tokens), on 24 prompts batched into one ``generate`` call per engine, in one fresh process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hs_tracer.testbed.corpus import prompts

CONFIGS = {"plain": "plain", "chain1": "chain1:1:1", "chain3": "chain3:3:1", "tree3": "tree3:3:2:6"}
MAX_NEW_TOKENS = 24
NUM_PROMPTS = 24


def write_random_draft(target: Path, out: Path, layer_ids: list[int], seed: int = 0) -> Path:
    """An EAGLE-3 draft (LlamaForCausalLMEagle3 layout) with random weights for ``target``: one
    decoder layer, fc over K*H, a reduced draft vocabulary (every other target id, d2t as diffs).
    Random proposals are mostly rejected, which still exercises draft, verify and draft extend."""
    import shutil

    import torch
    from safetensors.torch import save_file

    cfg = json.loads((target / "config.json").read_text())
    hidden, vocab = cfg["hidden_size"], cfg["vocab_size"]
    heads, inter, draft_vocab = 4, 2 * hidden, vocab // 2
    head_dim = hidden // heads
    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (target / name).exists():
            shutil.copy(target / name, out / name)
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": inter, "num_hidden_layers": 1, "num_attention_heads": heads,
        "num_key_value_heads": heads, "head_dim": head_dim, "vocab_size": vocab,
        "draft_vocab_size": draft_vocab,
        "rms_norm_eps": 1e-6, "max_position_embeddings": cfg.get("max_position_embeddings", 512),
        "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "float32",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": layer_ids, "use_aux_hidden_state": True},
    }  # fmt: skip
    (out / "config.json").write_text(json.dumps(config, indent=2))
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.1

    attn_in = 2 * hidden  # the EAGLE-3 midlayer attends over [embedding, hidden]
    hot = torch.arange(0, 2 * draft_vocab, 2)
    weights = {
        "midlayer.input_layernorm.weight": torch.ones(hidden),
        "midlayer.hidden_norm.weight": torch.ones(hidden),
        "midlayer.self_attn.q_proj.weight": rand(heads * head_dim, attn_in),
        "midlayer.self_attn.k_proj.weight": rand(heads * head_dim, attn_in),
        "midlayer.self_attn.v_proj.weight": rand(heads * head_dim, attn_in),
        "midlayer.self_attn.o_proj.weight": rand(hidden, heads * head_dim),
        "midlayer.post_attention_layernorm.weight": torch.ones(hidden),
        "midlayer.mlp.gate_proj.weight": rand(inter, hidden),
        "midlayer.mlp.up_proj.weight": rand(inter, hidden),
        "midlayer.mlp.down_proj.weight": rand(hidden, inter),
        "fc.weight": rand(hidden, len(layer_ids) * hidden),
        "norm.weight": torch.ones(hidden),
        "lm_head.weight": rand(draft_vocab, hidden),
        "d2t": hot - torch.arange(draft_vocab),
        "t2d": torch.zeros(vocab, dtype=torch.bool).index_fill_(0, hot, True),
    }
    save_file(weights, str(out / "model.safetensors"))
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from hs_tracer.testbed.target import build_target

    root = tmp_path_factory.mktemp("lossless-models")
    target = build_target(root / "target", train_steps=0, progress=False)
    num_layers = json.loads((target / "config.json").read_text())["num_hidden_layers"]
    draft = write_random_draft(target, root / "draft", [1, num_layers // 2, num_layers - 2])
    return target, draft


@pytest.fixture(scope="module")
def runs(models: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    target, draft = models
    work = tmp_path_factory.mktemp("lossless-runs")
    (work / "prompts.json").write_text(json.dumps(prompts(seed=4242, n=NUM_PROMPTS)))
    cmd = [sys.executable, "-m", "hs_tracer.testbed.runtime.runs", "--target", str(target),
           "--draft", str(draft), "--prompts", str(work / "prompts.json"),
           "--max-new-tokens", str(MAX_NEW_TOKENS), "--out", str(work / "result.json")]  # fmt: skip
    for spec in CONFIGS.values():
        cmd += ["--config", spec]
    env = {k: v for k, v in os.environ.items() if not k.startswith("HS_TRACER")}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return {r["config"]["name"]: r for r in json.loads((work / "result.json").read_text())}


@pytest.mark.engine
@pytest.mark.parametrize("name", ["chain1", "chain3", "tree3"])
def test_greedy_eagle3_commits_exactly_the_plain_tokens(runs: dict[str, dict], name: str) -> None:
    plain, spec = runs["plain"], runs[name]
    assert len(plain["output_ids"]) == NUM_PROMPTS
    assert all(len(ids) == MAX_NEW_TOKENS for ids in plain["output_ids"])
    for i, (want, got) in enumerate(zip(plain["output_ids"], spec["output_ids"], strict=True)):
        assert got == want, f"prompt {i}: {name} diverges from plain decoding at token " + str(
            next(j for j, (a, b) in enumerate(zip(want, got, strict=False)) if a != b)
        )
    # speculation really ran: every request was verified, never more tokens per step than the tree
    steps = spec["config"]["spec_steps"]
    assert all(v > 0 for v in spec["verify_steps"])
    assert 1.0 <= spec["mean_accept_length"] <= steps + 1

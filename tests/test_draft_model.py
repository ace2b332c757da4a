"""hs_tracer's plain-torch EAGLE-3 draft against SGLang 0.5.23's real ``LlamaForCausalLMEagle3``.

A child process (SGLang picks its CPU code path at import, so it gets a fresh process with the CPU
testbed runtime) builds the real class from the testbed draft's config.json, runs its real
``load_weights`` over model.safetensors, and evaluates SGLang's own modules stage by stage (fc,
norms, fused qkv + rope, o_proj, fused residual norms, MLP, final norm, lm_head, hot_token_id) on
the same inputs as :class:`hs_tracer.draft.model.Eagle3Draft`. Attention itself needs an engine
batch, so the child computes it with SDPA on SGLang's q/k/v; the engine tests cover the rest.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hs_tracer.draft.model import DraftConfig, Eagle3Draft, KVCache, load_target_embedding
from hs_tracer.errors import InputError
from hs_tracer_testbed.build import TestbedPaths, ensure_testbed

CHILD = r"""
import json, os, socket, sys
from hs_tracer_testbed.runtime.inproc import init_world_of_one
init_world_of_one()
import torch
from safetensors.torch import load_file
from transformers import AutoConfig
from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3
from hs_tracer.draft.model import Eagle3Draft

job = json.loads(sys.stdin.read())
torch.manual_seed(0)
sg = LlamaForCausalLMEagle3(AutoConfig.from_pretrained(job["draft"])).float()
params = dict(sg.named_parameters())
with torch.no_grad():
    for p in params.values():
        p.fill_(float("nan"))
sg.load_weights(list(load_file(os.path.join(job["draft"], "model.safetensors")).items()))
ours = Eagle3Draft.from_pretrained(job["draft"], target_dir=job["target"])
with torch.no_grad():
    # SGLang's set_embed: the target's embedding (its vocab is padded to a multiple of 64)
    sg.model.embed_tokens.weight[: ours.config.vocab_size].copy_(ours.embed_tokens.weight)
def unloaded(k, p):
    rows = p[: ours.config.draft_vocab_size] if k == "lm_head.weight" else p  # padded rows stay unset
    return "embed_tokens" not in k and bool(torch.isnan(rows).any())
out = {"nan_params": sorted(k for k, p in params.items() if unloaded(k, p))}
T = 7
feats = torch.randn(T, ours.config.fc_in)
ids = torch.randint(ours.config.vocab_size, (T,))
pos = torch.arange(3, 3 + T)
diff = {}
def d(name, a, b):
    diff[name] = float((a.float() - b.float()).abs().max())
with torch.no_grad():
    m, layer = sg.model, sg.model.layers[0]
    h = m.fc(feats)
    d("fc", h, ours.project(feats))
    residual = h
    x = torch.cat([layer.input_layernorm(m.embed_tokens(ids)), layer.hidden_norm(h)], dim=-1)
    qkv, _ = layer.self_attn.qkv_proj(x)
    a = layer.self_attn
    q, k, v = qkv.split([a.q_size, a.kv_size, a.kv_size], dim=-1)
    q, k = a.rotary_emb(pos, q, k)
    oq, ok, ov, ores = ours.qkv(h, ids, pos)
    d("q", q, oq.flatten(-2)); d("k", k, ok.flatten(-2)); d("v", v, ov.flatten(-2))
    d("residual", residual, ores)
    hd = a.head_dim
    qh, kh, vh = (t.view(T, -1, hd).transpose(0, 1) for t in (q, k, v))
    rep = qh.shape[0] // kh.shape[0]
    kh, vh = kh.repeat_interleave(rep, 0), vh.repeat_interleave(rep, 0)
    att = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=a.scaling)
    o, _ = a.o_proj(att.transpose(0, 1).reshape(T, -1))
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    d("attn_out", o, ours.attend(oq, ok, ov, mask))
    hs, res = layer.post_attention_layernorm(o, residual)
    hs = layer.mlp(hs)
    normed, pre = m.norm(hs, res)
    logits = torch.nn.functional.linear(normed, sg.lm_head.weight[: ours.config.draft_vocab_size])
    fin = ours.finish(o, residual)
    d("logits", logits, fin.logits); d("recurrent_hidden", pre, fin.hidden)
out["diff"] = diff
out["hot_token_id"] = sg.hot_token_id.tolist()
out["ours_target_ids"] = ours.to_target_ids(torch.arange(ours.config.draft_vocab_size)).tolist()
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def testbed() -> TestbedPaths:
    return ensure_testbed(progress=False)


def test_matches_sglang_llama_eagle3(testbed: TestbedPaths) -> None:
    job = json.dumps({"draft": str(testbed.draft), "target": str(testbed.target)})
    proc = subprocess.run(
        [sys.executable, "-c", CHILD], input=job, capture_output=True, text=True, timeout=600, check=False
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, f"child failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    res = json.loads(lines[-1][len("RESULT ") :])
    assert res["nan_params"] == [], "SGLang's load_weights left these parameters unloaded"
    for stage, err in res["diff"].items():
        assert err < 1e-4, f"{stage} differs from SGLang by {err}"
    assert res["hot_token_id"] == res["ours_target_ids"]


def test_cache_matches_full_sequence(testbed: TestbedPaths) -> None:
    """Prefill + step-by-step with the KV cache equals one causal pass (SGLang's extend/decode)."""
    draft = Eagle3Draft.from_pretrained(testbed.draft, target_dir=testbed.target)
    torch.manual_seed(1)
    t = 9
    feats = torch.randn(t, draft.config.fc_in)
    ids = torch.randint(draft.config.vocab_size, (t,))
    with torch.no_grad():
        full = draft(feats, ids, torch.arange(t))
        cache = KVCache()
        head = draft(feats[:5], ids[:5], torch.arange(5), cache)
        tail = [draft(feats[i : i + 1], ids[i : i + 1], torch.tensor([i]), cache) for i in range(5, t)]
    got = torch.cat([head.logits, *(o.logits for o in tail)])
    assert torch.allclose(got, full.logits, atol=1e-5)
    assert len(cache) == t


def test_width_test_skips_fc_for_own_hidden(testbed: TestbedPaths) -> None:
    """H-wide input bypasses fc (draft decode); any other width than H or K*H is an error."""
    draft = Eagle3Draft.from_pretrained(testbed.draft, target_dir=testbed.target)
    h = torch.randn(2, draft.config.hidden_size)
    assert draft.project(h) is h
    with pytest.raises(ValueError, match="neither"):
        draft.project(torch.randn(2, draft.config.hidden_size * 2))


def test_speculators_names_load_and_missing_keys_are_named(testbed: TestbedPaths, tmp_path: Path) -> None:
    weights = load_file(str(testbed.draft / "model.safetensors"))
    renamed = {k.replace("midlayer.", "layers.0."): v for k, v in weights.items()}
    d = tmp_path / "spec"
    d.mkdir()
    save_file(renamed, str(d / "model.safetensors"))
    (d / "config.json").write_text((testbed.draft / "config.json").read_text())
    a = Eagle3Draft.from_pretrained(testbed.draft, target_dir=testbed.target)
    b = Eagle3Draft.from_pretrained(d, target_dir=testbed.target)
    for (name, pa), (_, pb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(pa, pb), name
    del renamed["fc.weight"]
    save_file(renamed, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match=r"fc\.weight"):
        Eagle3Draft.from_pretrained(d, target_dir=testbed.target)


def test_d2t_diffs_map_to_t2d(testbed: TestbedPaths) -> None:
    draft = Eagle3Draft.from_pretrained(testbed.draft, embed_weight=load_target_embedding(testbed.target))
    ids = draft.to_target_ids(torch.arange(draft.config.draft_vocab_size))
    assert torch.equal(ids, draft.t2d.nonzero().flatten())
    assert bool((draft.d2t >= 0).all()) and bool((ids[1:] > ids[:-1]).all())
    cfg = DraftConfig.from_dict(json.loads((testbed.draft / "config.json").read_text()))
    assert cfg.draft_vocab_size < cfg.vocab_size  # a reduced vocabulary, so d2t matters


def test_speculators_layout_is_read_as_vllm_reads_it() -> None:
    """speculators' config: the model dimensions under ``transformer_layer_config``, the flags and ids
    at the top level (``target_hidden_size`` null there: the nested value, else H); ``input_norm``
    created for ``norm_before_fc`` and loaded from the checkpoint's key. Its own model's logits are
    the reference in tests/on_vllm/test_trainer_speculators.py."""
    layer = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 96, "rms_norm_eps": 1e-5,
             "rope_parameters": {"rope_theta": 50000.0, "rope_type": "default"}}
    cfg = DraftConfig.from_dict({"architectures": ["Eagle3DraftModel"], "transformer_layer_config": layer,
                                 "draft_vocab_size": 96, "target_hidden_size": None, "norm_before_fc": True,
                                 "norm_before_residual": True, "norm_output": True, "fc_norm": False,
                                 "eagle_aux_hidden_state_layer_ids": [1, 2, 3]})
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_key_value_heads, cfg.head_dim) == (64, 128, 2, 16)
    assert (cfg.vocab_size, cfg.rms_norm_eps, cfg.rope_theta, cfg.fc_in) == (96, 1e-5, 50000.0, 192)
    assert cfg.norm_before_fc and cfg.norm_before_residual and cfg.norm_output
    draft = Eagle3Draft(cfg, torch.randn(96, 64))
    weights = {k.replace("midlayer.", "layers.0."): torch.randn_like(v) if v.is_floating_point() else v
               for k, v in draft.checkpoint_state_dict().items()}
    assert "input_norm.weight" in weights
    draft.load_checkpoint(weights)
    assert torch.equal(draft.input_norm.weight, weights["input_norm.weight"])
    del weights["input_norm.weight"]
    with pytest.raises(ValueError, match=r"input_norm\.weight"):
        draft.load_checkpoint(weights)


def test_per_slot_fc_norm_is_still_refused() -> None:
    with pytest.raises(InputError, match="fc_norm"):
        DraftConfig.from_dict({"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                               "vocab_size": 96, "fc_norm": True})

"""The testbed target: a tiny DeepSeek-V3 (MLA + MoE) that SGLang 0.5.23 loads on CPU.

Built with transformers' ``DeepseekV3ForCausalLM`` and trained with plain torch on the synthetic
corpus. The checkpoint is written by hand (not ``save_pretrained``) because SGLang needs things
transformers 5.19 does not write:

* per-expert weight names (``mlp.experts.{e}.gate_proj.weight``; transformers keeps experts fused),
* the V3 routing keys in config.json (``moe_layer_freq``, ``topk_method=noaux_tc``,
  ``scoring_func=sigmoid``, ...), and
* a yarn ``rope_parameters`` entry (SGLang's CPU rope only implements ``deepseek_yarn``). The yarn
  factor is 1.0, which makes yarn identical to plain rope in both transformers and SGLang.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hs_tracer_testbed import corpus
from hs_tracer_testbed.tokenizer import BOS_ID, EOS_ID, PAD_ID, save_tokenizer, vocabulary

if TYPE_CHECKING:
    import torch
    from transformers import DeepseekV3ForCausalLM


@dataclass(frozen=True)
class TargetRecipe:
    """Everything that determines the target's weights (hashed into the testbed cache key)."""

    num_layers: int = 8
    hidden: int = 64
    heads: int = 4
    q_lora_rank: int = 32
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 16
    intermediate: int = 192
    moe_intermediate: int = 64
    n_routed_experts: int = 4
    experts_per_tok: int = 2
    first_k_dense_replace: int = 1
    max_position: int = 512
    rope_theta: float = 10000.0
    seed: int = 0
    train_steps: int = 800
    batch_size: int = 16
    seq_len: int = 64
    lr: float = 3e-3
    train_docs: int = 4000
    other_docs: int = 300
    dtype: str = "bfloat16"


def vocab_size() -> int:
    """The model's vocabulary: the tokenizer's, rounded up to a multiple of 16."""
    n = len(vocabulary())
    return (n + 15) // 16 * 16


def hf_config_dict(recipe: TargetRecipe) -> dict[str, Any]:
    """config.json for the target, with every key SGLang 0.5.23's deepseek_v2.py reads."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": vocab_size(),
        "hidden_size": recipe.hidden,
        "intermediate_size": recipe.intermediate,
        "moe_intermediate_size": recipe.moe_intermediate,
        "num_hidden_layers": recipe.num_layers,
        "num_attention_heads": recipe.heads,
        "num_key_value_heads": recipe.heads,
        "n_shared_experts": 1,
        "n_routed_experts": recipe.n_routed_experts,
        "num_experts_per_tok": recipe.experts_per_tok,
        "routed_scaling_factor": 1.0,
        "kv_lora_rank": recipe.kv_lora_rank,
        "q_lora_rank": recipe.q_lora_rank,
        "qk_rope_head_dim": recipe.qk_rope_head_dim,
        "qk_nope_head_dim": recipe.qk_nope_head_dim,
        "v_head_dim": recipe.v_head_dim,
        "n_group": 1,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "first_k_dense_replace": recipe.first_k_dense_replace,
        "moe_layer_freq": 1,
        "num_nextn_predict_layers": 0,
        "hidden_act": "silu",
        "max_position_embeddings": recipe.max_position,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-6,
        "use_cache": True,
        "pad_token_id": PAD_ID,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "rope_interleave": True,
        "rope_theta": recipe.rope_theta,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": recipe.rope_theta,
            "factor": 1.0,
            "original_max_position_embeddings": recipe.max_position,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        "torch_dtype": recipe.dtype,
        "dtype": recipe.dtype,
    }


def make_model(recipe: TargetRecipe) -> DeepseekV3ForCausalLM:
    """A freshly initialised transformers model for ``recipe`` (seeded: same recipe, same weights)."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = dict(hf_config_dict(recipe))
    for key in ("architectures", "model_type", "torch_dtype", "dtype"):
        cfg.pop(key)
    config = DeepseekV3Config(**cfg)
    config._attn_implementation = "eager"
    torch.manual_seed(recipe.seed)
    model = DeepseekV3ForCausalLM(config).float()
    model.eval()
    return model


def to_sglang_state_dict(model: DeepseekV3ForCausalLM) -> dict[str, torch.Tensor]:
    """The model's weights under the per-expert checkpoint names SGLang (and HF hub V3) use."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix = name[: -len("gate_up_proj")]
            inter = tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = tensor[e, :inter]
                out[f"{prefix}{e}.up_proj.weight"] = tensor[e, inter:]
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name[: -len("down_proj")]
            for e in range(tensor.shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = tensor[e]
        elif "rotary_emb" in name:
            continue
        else:
            out[name] = tensor
    return {k: v.detach().contiguous().clone() for k, v in out.items()}


def from_sglang_state_dict(model: DeepseekV3ForCausalLM, weights: dict[str, torch.Tensor]) -> None:
    """Inverse of :func:`to_sglang_state_dict`: load per-expert weights into the fused HF model."""
    import torch

    own = model.state_dict()
    fused: dict[str, torch.Tensor] = {}
    for name in own:
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix = name[: -len("gate_up_proj")]
            n = own[name].shape[0]
            fused[name] = torch.stack(
                [torch.cat([weights[f"{prefix}{e}.gate_proj.weight"], weights[f"{prefix}{e}.up_proj.weight"]])
                 for e in range(n)]
            )  # fmt: skip
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name[: -len("down_proj")]
            fused[name] = torch.stack(
                [weights[f"{prefix}{e}.down_proj.weight"] for e in range(own[name].shape[0])]
            )
        elif name in weights:
            fused[name] = weights[name]
    missing = [n for n in own if n not in fused and "rotary_emb" not in n]
    if missing:
        raise ValueError(
            f"target checkpoint lacks {missing[:3]}...; rebuild it with `hs-tracer testbed build`"
        )
    model.load_state_dict(fused, strict=False)


def save_target(model: DeepseekV3ForCausalLM, recipe: TargetRecipe, out_dir: Path) -> Path:
    """Write config.json, model.safetensors (recipe dtype), tokenizer and generation config."""
    import torch
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    dtype = getattr(torch, recipe.dtype)
    weights = {k: v.to(dtype) for k, v in to_sglang_state_dict(model).items()}
    save_file(dict(sorted(weights.items())), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(hf_config_dict(recipe), indent=2, sort_keys=True) + "\n")
    gen = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID, "do_sample": False}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    save_tokenizer(out_dir)
    return out_dir


def load_target(target_dir: Path) -> DeepseekV3ForCausalLM:
    """The target as an fp32 transformers model with the exact (rounded) weights on disk."""
    from safetensors.torch import load_file

    recipe_path = target_dir / "recipe.json"
    if not recipe_path.exists():
        raise FileNotFoundError(f"{recipe_path} missing; build the target with `hs-tracer testbed build`")
    recipe = TargetRecipe(**json.loads(recipe_path.read_text()))
    model = make_model(recipe)
    weights = {k: v.float() for k, v in load_file(str(target_dir / "model.safetensors")).items()}
    from_sglang_state_dict(model, weights)
    return model


def encode(texts: list[str], add_eos: bool = True) -> list[list[int]]:
    """Token ids of ``texts`` with BOS (and EOS): the exact sequences the target is trained on."""
    vocab = vocabulary()
    unk = vocab["<unk>"]
    return [[BOS_ID, *(vocab.get(w, unk) for w in t.split())] + ([EOS_ID] if add_eos else []) for t in texts]


def training_sequences(recipe: TargetRecipe) -> list[list[int]]:
    """The target's training set: ``train`` documents plus a few ``other``-domain ones."""
    docs = corpus.documents(recipe.seed, recipe.train_docs, "train")
    docs += corpus.documents(recipe.seed, recipe.other_docs, "other")
    return encode(docs)


def _batches(seqs: list[list[int]], batch: int, width: int, steps: int, seed: int) -> Iterator[torch.Tensor]:
    """Rows of ``width`` tokens cut from the shuffled, concatenated documents (no padding waste)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    stream: list[int] = []
    for _ in range(steps):
        while len(stream) < batch * width:
            for i in torch.randperm(len(seqs), generator=g).tolist():
                stream.extend(seqs[i])
        rows, stream = stream[: batch * width], stream[batch * width :]
        yield torch.tensor(rows, dtype=torch.long).view(batch, width)


def train(model: DeepseekV3ForCausalLM, recipe: TargetRecipe, progress: bool = True) -> list[float]:
    """Next-token training with AdamW and a cosine schedule; returns the loss curve."""
    import torch
    from tqdm import tqdm

    seqs = training_sequences(recipe)
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=0.0, betas=(0.9, 0.98))
    warmup = max(1, recipe.train_steps // 20)

    def lr_at(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, recipe.train_steps - warmup)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    model.train()
    losses: list[float] = []
    bar = tqdm(
        _batches(seqs, recipe.batch_size, recipe.seq_len, recipe.train_steps, recipe.seed),
        total=recipe.train_steps, desc="train target", disable=not progress,
    )  # fmt: skip
    for ids in bar:
        out = model(input_ids=ids, labels=ids)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(out.loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    model.eval()
    return losses


@contextlib.contextmanager
def deterministic(threads: int = 1) -> Iterator[None]:
    """Bit-reproducible CPU training inside the block (one thread, deterministic algorithms, forked
    RNG); the caller's thread count, determinism flag and RNG state are restored afterwards."""
    import torch

    old_threads, old_det = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    try:
        with torch.random.fork_rng(devices=[]):
            torch.set_num_threads(threads)
            torch.use_deterministic_algorithms(True)
            yield
    finally:
        torch.set_num_threads(old_threads)
        torch.use_deterministic_algorithms(old_det)


def build_target(
    out_dir: Path, train_steps: int | None = None, recipe: TargetRecipe | None = None, progress: bool = True
) -> Path:
    """Build the target into ``out_dir``; ``train_steps=0`` gives an untrained (random) model fast.

    Returns ``out_dir``. The weights written are rounded to the recipe dtype; use
    :func:`load_target` to get them back as an fp32 transformers model.
    """
    recipe = recipe or TargetRecipe()
    if train_steps is not None:
        recipe = TargetRecipe(**{**asdict(recipe), "train_steps": train_steps})
    with deterministic():
        model = make_model(recipe)
        losses = train(model, recipe, progress) if recipe.train_steps > 0 else []
    save_target(model, recipe, out_dir)
    (out_dir / "recipe.json").write_text(json.dumps(asdict(recipe), indent=2, sort_keys=True) + "\n")
    if losses:
        tail = losses[-20:]
        (out_dir / "train_log.json").write_text(
            json.dumps({"final_loss": sum(tail) / len(tail), "losses": losses[:: max(1, len(losses) // 50)]})
            + "\n"
        )
    return out_dir

"""Train the testbed EAGLE-3 draft on SpecForge-layout data, with training-time test (TTT).

Alignment (EAGLE-3, as SGLang runs it): at position t the draft gets the target's fused features
of position t and the embedding of token t+1, and predicts token t+2. The loss is a soft cross
entropy against the target's own next-token distribution (``lm_head`` on the stored post-norm
``hidden_state``) restricted to the draft vocabulary, like SpecForge.

TTT unrolls the draft on its own outputs for ``ttt_steps`` steps, exactly as SGLang's chain
decode does: step k at index t sits at position t+k-1, its hidden input is step k-1's recurrent
hidden at index t, its token is the target's greedy token, and it attends to the step-1 keys of
positions <= t (what draft-extend put in the KV cache) plus the keys of steps 2..k at index t
(its own chain). That makes the 2nd and 3rd draft tokens accurate, not only the first.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from hs_tracer.draft.model import Eagle3Draft


@dataclass(frozen=True)
class DraftRecipe:
    """Everything that determines the draft's weights (hashed into the testbed cache key)."""

    intermediate: int = 256
    heads: int = 4
    kv_heads: int = 4
    draft_vocab: int = 256
    ttt_steps: int = 3
    train_steps: int = 500
    batch_size: int = 16
    lr: float = 3e-3
    step_decay: float = 0.8
    token_dropout: float = 0.9
    seed: int = 0


def draft_config_dict(
    recipe: DraftRecipe, target_cfg: dict[str, Any], layer_ids: list[int], eos_id: int, bos_id: int
) -> dict[str, Any]:
    """config.json of a ``LlamaForCausalLMEagle3`` draft for the testbed target."""
    h = target_cfg["hidden_size"]
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": h,
        "intermediate_size": recipe.intermediate,
        "num_attention_heads": recipe.heads,
        "num_key_value_heads": recipe.kv_heads,
        "head_dim": h // recipe.heads,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "vocab_size": target_cfg["vocab_size"],
        "draft_vocab_size": recipe.draft_vocab,
        "max_position_embeddings": target_cfg["max_position_embeddings"],
        "rope_theta": 10000.0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "tie_word_embeddings": False,
        "attention_bias": False,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": 0,
        "torch_dtype": "bfloat16",
        "dtype": "bfloat16",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids), "use_aux_hidden_state": True},
    }


def _pad(rows: list[torch.Tensor], value: float = 0.0) -> torch.Tensor:
    import torch

    width = max(r.shape[0] for r in rows)
    first = rows[0]
    out = torch.full((len(rows), width, *first.shape[1:]), value, dtype=first.dtype, device=first.device)
    for i, r in enumerate(rows):
        out[i, : r.shape[0]] = r
    return out


def _ttt_attention(
    draft: Eagle3Draft,
    q: torch.Tensor,
    ctx: tuple[torch.Tensor, torch.Tensor],
    chain: list[tuple[torch.Tensor, torch.Tensor]],
    ctx_mask: torch.Tensor,
) -> torch.Tensor:
    """q [B,T,nh,d] over the step-1 keys (masked causal) plus the diagonal keys of later steps."""
    import torch

    c = draft.config
    rep = c.num_attention_heads // c.num_key_value_heads
    k1, v1 = (t.repeat_interleave(rep, dim=-2) for t in ctx)
    scale = c.head_dim**-0.5
    s_ctx = torch.einsum("bqhd,bkhd->bhqk", q, k1) * scale
    s_ctx = s_ctx.masked_fill(~ctx_mask[:, None], float("-inf"))
    diag_k = [k.repeat_interleave(rep, dim=-2) for k, _ in chain]
    diag_v = [v.repeat_interleave(rep, dim=-2) for _, v in chain]
    s_diag = [torch.einsum("bqhd,bqhd->bhq", q, k)[..., None] * scale for k in diag_k]
    p = torch.cat([s_ctx, *s_diag], dim=-1).softmax(-1)
    t = s_ctx.shape[-1]
    out = torch.einsum("bhqk,bkhd->bqhd", p[..., :t], v1)
    for j, v in enumerate(diag_v):
        out = out + p[..., t + j].permute(0, 2, 1)[..., None] * v
    return draft.o_proj(out.flatten(-2))


def ttt_loss(
    draft: Eagle3Draft,
    feats: torch.Tensor,
    ids: torch.Tensor,
    target_logp: torch.Tensor,
    target_next: torch.Tensor,
    valid: torch.Tensor,
    steps: int,
    decay: float,
    token_dropout: float = 0.0,
    generator: torch.Generator | None = None,
    loss_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, list[float]]:
    """Loss over ``steps`` unrolled draft steps; returns (loss, per-step top-1 accuracy).

    feats [B,T,K*H]; ids [B,T]; target_logp [B,T,Dv] (log-probs over the draft vocab of the
    target's prediction at each position); target_next [B,T] the target's greedy token;
    valid [B,T] positions with a real token; loss_mask [B,T] (default: ``valid``) the tokens whose
    prediction counts (a response's tokens, not its prompt's: SpecForge's ``loss_mask``).
    """
    import torch

    b, t = ids.shape
    dev = ids.device
    counts = valid
    if loss_mask is not None:
        # the target's prediction at position j is of token j+1: it counts if token j+1 does
        counts = torch.zeros_like(valid)
        counts[:, :-1] = loss_mask[:, 1:] & valid[:, 1:]
    n = t - 1  # index i: feature of position i, token i+1
    pos = torch.arange(n, device=dev).expand(b, n)
    hidden = draft.project(feats[:, :n])
    tokens = ids[:, 1:]
    if token_dropout > 0:
        # Replace a share of the step-1 tokens with random ones, so the draft must read the
        # target's features rather than re-derive everything from the (easy) tokens.
        # drawn on the CPU generator wherever the draft trains, so a run's draws don't depend on the device
        drop = (torch.rand(tokens.shape, generator=generator) < token_dropout).to(dev)
        noise = torch.randint(draft.config.vocab_size, tokens.shape, generator=generator).to(dev)
        tokens = torch.where(drop, noise, tokens)
    idx = torch.arange(n, device=dev)
    # causal over real keys; the diagonal always stays open so padded rows never softmax over nothing
    causal = (idx[None, :] <= idx[:, None])[None] & (
        valid[:, None, :n] | (idx[None, :] == idx[:, None])[None]
    )
    ctx = None
    chain: list[tuple[torch.Tensor, torch.Tensor]] = []
    total = feats.new_zeros(())
    accs: list[float] = []
    for k in range(steps):
        q, kk, vv, residual = draft.qkv(hidden, tokens, pos + k)
        if ctx is None:
            ctx = (kk, vv)
        else:
            chain.append((kk, vv))
        out = draft.finish(_ttt_attention(draft, q, ctx, chain, causal), residual)
        # step k at index i predicts the target's distribution at position i+k+1
        tgt = torch.zeros_like(target_logp[:, :n])
        ok = torch.zeros(b, n, dtype=torch.bool, device=dev)
        m = n - k
        if m <= 0:
            break
        tgt[:, :m] = target_logp[:, k + 1 : k + 1 + m]
        ok[:, :m] = counts[:, k + 1 : k + 1 + m] & valid[:, :m]
        logp = out.logits.float().log_softmax(-1)
        per = -(tgt.exp() * logp).sum(-1)
        denom = ok.sum().clamp(min=1)
        total = total + (decay**k) * (per * ok).sum() / denom
        pred = out.logits.argmax(-1)
        accs.append(float(((pred == tgt.argmax(-1)) & ok).sum() / denom))
        # next step: own hidden, the target's greedy token for position i+k+1 (what an accepted chain feeds)
        hidden = out.hidden
        nxt = torch.zeros_like(tokens)
        nxt[:, :m] = target_next[:, k + 1 : k + 1 + m]
        tokens = nxt
    return total, accs


def train_draft(
    draft: Eagle3Draft,
    records: list[dict[str, torch.Tensor]],
    lm_head: torch.Tensor,
    recipe: DraftRecipe,
    progress: bool = True,
    log_fn: Callable[[dict[str, float]], None] | None = None,
    use_loss_mask: bool = False,
    device: str = "cpu",
) -> list[dict[str, float]]:
    """Train ``draft`` (on ``device``) in place on SpecForge records; ``lm_head`` is the target's
    [V, H] head; ``log_fn`` gets each log entry as it is made (a long run's progress);
    ``use_loss_mask``: train only on the records' ``loss_mask`` tokens (responses), else on every token."""
    import torch
    from tqdm import tqdm

    prepared = _prepare(draft, records, lm_head, device)
    g = torch.Generator().manual_seed(recipe.seed)
    opt = torch.optim.AdamW(draft.trainable_parameters(), lr=recipe.lr, weight_decay=0.0, betas=(0.9, 0.98))
    warm = max(1, recipe.train_steps // 20)

    def lr_at(s: int) -> float:
        if s < warm:
            return (s + 1) / warm
        return 0.5 * (1 + math.cos(math.pi * (s - warm) / max(1, recipe.train_steps - warm)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    draft.train()
    log: list[dict[str, float]] = []
    recent: list[list[float]] = []
    bar = tqdm(range(recipe.train_steps), desc="train draft", disable=not progress)
    for step in bar:
        pick = torch.randint(len(prepared), (recipe.batch_size,), generator=g).tolist()
        feats = _pad([prepared[i][0] for i in pick])
        ids = _pad([prepared[i][1] for i in pick])
        logp = _pad([prepared[i][2] for i in pick])
        nxt = _pad([prepared[i][3] for i in pick])
        valid = _pad([prepared[i][4] for i in pick], value=False)
        mask = _pad([prepared[i][5] for i in pick], value=False)
        loss, accs = ttt_loss(
            draft, feats, ids, logp, nxt, valid, recipe.ttt_steps, recipe.step_decay, recipe.token_dropout, g,
            mask if use_loss_mask else None,
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.trainable_parameters(), 1.0)
        opt.step()
        sched.step()
        recent.append([loss.item(), *accs])
        if step % 10 == 0 or step == recipe.train_steps - 1:
            # means over the steps since the last entry: one batch's accuracy is too noisy to read
            mean = [sum(col) / len(recent) for col in zip(*recent, strict=True)]
            log.append({"step": step, "loss": mean[0], **{f"acc{k + 1}": a for k, a in enumerate(mean[1:])}})
            bar.set_postfix(loss=f"{mean[0]:.3f}", acc=" ".join(f"{a:.2f}" for a in mean[1:]))
            if log_fn is not None:
                log_fn(log[-1])
            recent = []
    draft.eval()
    return log


def _prepare(draft: Eagle3Draft, records: list[dict[str, torch.Tensor]], lm_head: torch.Tensor,
             device: str) -> list[tuple[torch.Tensor, ...]]:  # fmt: skip
    """Per record, on ``device``: features, ids, the target's log-probs over the draft vocab and its
    greedy token (from ``lm_head`` on the stored post-norm state), validity, loss mask."""
    import torch

    t2d = draft.t2d.to(device)
    head = lm_head.to(device).float()
    prepared = []
    for r in records:
        with torch.no_grad():
            logits = r["hidden_state"][0].to(device).float() @ head.T
        n = r["input_ids"].shape[0]
        prepared.append((r["aux_hidden_state"][0].to(device).float(), r["input_ids"].to(device).long(),
                         logits[:, t2d].log_softmax(-1), logits.argmax(-1),
                         torch.ones(n, dtype=torch.bool, device=device), r["loss_mask"].to(device).bool()))
    return prepared


def heldout_accuracy(draft: Eagle3Draft, records: list[dict[str, torch.Tensor]], lm_head: torch.Tensor,
                     recipe: DraftRecipe, device: str = "cpu") -> dict[str, float]:  # fmt: skip
    """Top-1 accuracy of each TTT step, teacher-forced on the response tokens of ``records`` (no
    token dropout, one batch): what the draft does on text it never saw."""
    import torch

    prepared = _prepare(draft, records, lm_head, device)
    cols = [_pad([p[j] for p in prepared], value=False if j >= 4 else 0.0) for j in range(6)]
    with torch.no_grad():
        _, accs = ttt_loss(draft, *cols[:5], recipe.ttt_steps, recipe.step_decay, loss_mask=cols[5])
    return {f"acc{k + 1}": a for k, a in enumerate(accs)}


def save_vocab_mapping(out_dir: Path, mapping: dict[str, torch.Tensor]) -> Path:
    """SpecForge's ``vocab_mapping/vocab_mapping.pt`` (plain tensors)."""
    import torch

    d = out_dir / "vocab_mapping"
    d.mkdir(parents=True, exist_ok=True)
    path = d / "vocab_mapping.pt"
    torch.save({"d2t": mapping["d2t"].clone(), "t2d": mapping["t2d"].clone()}, path)
    return path

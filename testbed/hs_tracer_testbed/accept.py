"""Offline greedy chain speculative decoding (target + EAGLE-3 draft, plain torch).

Why: it measures what the draft is worth before any engine runs, and what a miswiring costs: the
same loop with the draft fed other layers. It mirrors SGLang's EAGLE-3 chain (topk 1):

1. the target's pass gives the features of every verified position and the next token x_T;
2. draft-extend over positions 0..T-1 (feature of t, token t+1; token T is x_T) gives draft token 1;
3. ``num_steps - 1`` draft-decode steps on the draft's own hidden and tokens give tokens 2..;
4. the target verifies ``[x_T, d1, .., dn]``; the accept length of the step is the number of
   accepted draft tokens + 1 (the bonus), as SGLang counts it.

The draft context is recomputed from the target features each round, which is what SGLang's KV
cache holds after draft-extend (rejected speculative entries are overwritten).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hs_tracer_testbed.dumps import layer_states

if TYPE_CHECKING:
    import torch
    from transformers import DeepseekV3ForCausalLM

    from hs_tracer.draft.model import Eagle3Draft


@dataclass
class AcceptStats:
    """Accept lengths of every verify step, and per-position acceptance."""

    accept_lengths: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)  # per draft position: times accepted
    tokens: list[list[int]] = field(default_factory=list)  # generated tokens per prompt

    @property
    def mean_accept_length(self) -> float:
        return sum(self.accept_lengths) / max(1, len(self.accept_lengths))

    @property
    def per_position_rate(self) -> list[float]:
        n = max(1, len(self.accept_lengths))
        return [a / n for a in self.accepted_at]


def _draft_chain(
    draft: Eagle3Draft, feats: torch.Tensor, seq: torch.Tensor, bonus: int, num_steps: int
) -> list[int]:
    """Draft tokens (target ids) for the next ``num_steps`` positions after ``seq + [bonus]``."""
    import torch

    from hs_tracer.draft.model import KVCache

    t = seq.shape[0]
    cache = KVCache()
    tokens = torch.cat([seq[1:], torch.tensor([bonus])])
    out = draft(feats, tokens, torch.arange(t), cache)
    hidden, logits = out.hidden[-1:], out.logits[-1:]
    chain: list[int] = []
    for step in range(num_steps):
        tok = draft.to_target_ids(logits.argmax(-1))
        chain.append(int(tok))
        if step + 1 == num_steps:
            break
        out = draft(hidden, tok, torch.tensor([t + step]), cache)
        hidden, logits = out.hidden, out.logits
    return chain


def simulate(
    target: DeepseekV3ForCausalLM,
    draft: Eagle3Draft,
    prompts: list[list[int]],
    c_out_ids: list[int],
    num_steps: int = 3,
    max_new_tokens: int = 32,
    eos_id: int | None = None,
) -> AcceptStats:
    """Greedy chain speculative decoding of every prompt; the draft sees ``c_out_ids`` features."""
    import torch

    stats = AcceptStats(accepted_at=[0] * num_steps)
    with torch.no_grad():
        for prompt in prompts:
            seq = torch.tensor(prompt, dtype=torch.long)
            st = layer_states(target, seq)
            feats, bonus = st.aux(c_out_ids), int(st.logits[-1].argmax())
            generated: list[int] = []
            while len(generated) < max_new_tokens and bonus != eos_id:
                chain = _draft_chain(draft, feats, seq, bonus, num_steps)
                cand = torch.cat([seq, torch.tensor([bonus, *chain])])
                st = layer_states(target, cand)
                preds = st.logits.argmax(-1)
                t = seq.shape[0]
                a = 0
                while a < num_steps and chain[a] == int(preds[t + a]):
                    stats.accepted_at[a] += 1
                    a += 1
                stats.accept_lengths.append(a + 1)
                new = [bonus, *chain[:a]]
                generated.extend(new)
                seq = cand[: t + 1 + a]
                feats, bonus = st.aux(c_out_ids)[: t + 1 + a], int(preds[t + a])
            stats.tokens.append(generated)
    return stats


def greedy_tokens(target: DeepseekV3ForCausalLM, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Plain greedy decoding (no cache; tiny model): the oracle speculative decoding must equal."""
    import torch

    seq = torch.tensor(prompt, dtype=torch.long)
    out: list[int] = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            nxt = int(target(input_ids=seq[None]).logits[0, -1].argmax())
            out.append(nxt)
            seq = torch.cat([seq, torch.tensor([nxt])])
    return out

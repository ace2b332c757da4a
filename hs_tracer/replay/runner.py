"""Run the draft on replay sequences under a given wiring and score next-token top-1 agreement.

A wiring says what each of the draft's K slots gets: a slot of the recorded features (``slot j``) or
the token embedding computed from the ids (``embedding``: the one source that can be rebuilt exactly
without the target). The draft runs each sequence causally, as at draft extend and in training: row t
gets the target's states at position t and the token at t+1, and its top-1 (mapped to target ids
through ``d2t``) is compared with the token at t+2, the token the target actually produced next.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from hs_tracer.draft.model import Eagle3Draft
from hs_tracer.replay.data import Sequence

EMBEDDING = "embedding"

Pick = int | str  # a recorded slot index, or EMBEDDING
Wiring = tuple[Pick, ...]


def describe(wiring: Wiring, slot_sources: list[str] | None = None) -> list[str]:
    """Human names of a wiring's picks: ``"slot 1 (block:1)"`` or ``"embedding (from ids)"``."""
    out = []
    for p in wiring:
        if p == EMBEDDING:
            out.append("embedding (from ids)")
        else:
            src = f" ({slot_sources[int(p)]})" if slot_sources and int(p) < len(slot_sources) else ""
            out.append(f"slot {p}{src}")
    return out


@dataclass
class Agreement:
    correct: int
    total: int
    by_sequence: tuple[tuple[int, int], ...] = ()  # (correct, total) per scored sequence, in order

    @property
    def rate(self) -> float:
        return self.correct / self.total if self.total else 0.0

    def stderr(self) -> float:
        p = self.rate
        return (p * (1 - p) / self.total) ** 0.5 if self.total else 1.0


def wire(seq: Sequence, wiring: Wiring, draft: Eagle3Draft, zero: bool = False) -> torch.Tensor:
    """The [T, K*H] features a wiring feeds the draft for ``seq`` (``zero``: all zeros, tokens only)."""
    h = draft.config.target_hidden_size or draft.config.hidden_size
    if zero:
        return torch.zeros(seq.rows, h * len(wiring))
    parts = []
    for p in wiring:
        if p == EMBEDDING:
            parts.append(draft.embed_tokens(seq.ids).float())
        else:
            j = int(p)
            parts.append(seq.features[:, j * h:(j + 1) * h].float())
    return torch.cat(parts, dim=-1)


@torch.no_grad()
def agreement(draft: Eagle3Draft, seqs: Iterable[Sequence], wiring: Wiring, *,
              zero: bool = False) -> Agreement:
    """Top-1 agreement of the draft's next-token prediction with the recorded next tokens."""
    correct = total = 0
    by_sequence = []
    for seq in seqs:
        ids = seq.ids
        shifted = torch.cat([ids[1:], torch.tensor([seq.tail])]) if seq.tail is not None else ids[1:]
        t = int(shifted.shape[0])  # rows the draft can run (each needs the next token as input)
        if t < 2:
            continue
        feats = wire(seq, wiring, draft, zero)[:t]
        pos = torch.arange(seq.first_position, seq.first_position + t)
        out = draft(feats, shifted, pos)
        pred = draft.to_target_ids(out.logits.argmax(-1))
        labels = shifted[1:]  # row i predicts the token at position i+2 = shifted[i+1]
        hits = int((pred[: t - 1] == labels).sum())
        correct += hits
        total += t - 1
        by_sequence.append((hits, t - 1))
    return Agreement(correct, total, tuple(by_sequence))


def unigram_baseline(seqs: Iterable[Sequence]) -> float:
    """Agreement of always guessing the most frequent label: the floor a useless draft reaches."""
    counts: Counter[int] = Counter()
    for seq in seqs:
        counts.update(seq.ids[2:].tolist())
        if seq.tail is not None:
            counts[seq.tail] += 1
    n = sum(counts.values())
    return counts.most_common(1)[0][1] / n if n else 0.0

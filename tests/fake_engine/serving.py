"""The fake engine's own code (what an adapter patches): a runner that loads a target and a draft,
then per step computes the target's captured hidden states, runs the draft extend on them and
verifies the drafts. The states are random rows; the accept lengths come from the batch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Request:
    rid: str


@dataclass
class Batch:
    reqs: list[Request]
    accept_lens: list[int] = field(default_factory=list)  # what verify will accept, per request


class Runner:
    """Captures ``aux_layer_ids`` (input of layer k, k from 0) of a ``num_layers``-layer target for a
    draft whose ``fc`` takes ``draft_states`` states."""

    num_draft_tokens = 4

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config

    def load(self) -> None:
        c = self.config
        self.num_layers, self.hidden_size = int(c["num_layers"]), int(c["hidden_size"])
        self.aux_layer_ids = list(c["aux_layer_ids"])
        self.draft_fc_in = int(c["draft_states"]) * self.hidden_size

    def step(self, batch: Batch) -> list[int]:
        rows = len(batch.reqs) * self.num_draft_tokens
        features = torch.randn(rows, len(self.aux_layer_ids) * self.hidden_size)
        self.draft_extend(features, batch)
        return self.verify(batch)

    def draft_extend(self, features: torch.Tensor, batch: Batch) -> None:
        """The draft's forward over the verify window (nothing to compute here)."""

    def verify(self, batch: Batch) -> list[int]:
        return list(batch.accept_lens)

"""Miswiring scenarios on real hidden states: how the detection latency and false-alarm numbers in
docs/diagnosis.md are measured, and what the tests replay.

Input is all-layer states of held-out sequences (``[T, S, H]`` per sequence, named by canonical
source). A scenario is the list of sources a broken (or correct) engine would feed, slot by slot; a
window draws whole sequences at random until it holds the requested number of tokens, as a live
window mixes requests.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hs_tracer.diagnosis.identity import diagnose
from hs_tracer.diagnosis.matcher import Thresholds
from hs_tracer.diagnosis.report import Report
from hs_tracer.fingerprint.stats import ChannelStats
from hs_tracer.profile.accumulate import StatsAccumulator
from hs_tracer.profile.model import Profile
from hs_tracer.sources import EMBEDDING, FINAL_NORM


@dataclass
class StatePool:
    """Held-out sequences with every candidate source: ``seqs[i]`` is ``[T_i, S, H]`` float32."""

    names: list[str]
    seqs: list[np.ndarray]

    def window(self, sources: Sequence[str], tokens: int, rng: np.random.Generator) -> np.ndarray:
        """``[tokens, K, H]``: random whole sequences (then cut) with the given sources as slots."""
        idx = [self.names.index(s) for s in sources]
        parts, n = [], 0
        for i in rng.permutation(len(self.seqs)):
            parts.append(self.seqs[i][:, idx])
            n += parts[-1].shape[0]
            if n >= tokens:
                break
        x = np.concatenate(parts)
        if x.shape[0] < tokens:
            raise ValueError(f"the pool holds {x.shape[0]} tokens, a window needs {tokens}")
        return x[:tokens]


def stats_of(x: np.ndarray) -> tuple[ChannelStats, int]:
    acc = StatsAccumulator(x.shape[1], x.shape[2])
    acc.add(x)
    return acc.stats, acc.nonfinite


def judge(profile: Profile, x: np.ndarray, thresholds: Thresholds | None = None) -> Report:
    stats, nonfinite = stats_of(x)
    return diagnose(stats, profile, tokens=x.shape[0], nonfinite=nonfinite, thresholds=thresholds)


def detection_rates(
    profile: Profile,
    pool: StatePool,
    live_sources: Sequence[str],
    sizes: Sequence[int],
    reps: int,
    seed: int = 0,
    thresholds: Thresholds | None = None,
) -> dict[int, dict[str, float]]:
    """Per window size: the fraction of windows with each status, and of windows naming every slot
    exactly (observed == the source really fed)."""
    rng = np.random.default_rng(seed)
    out: dict[int, dict[str, float]] = {}
    for size in sizes:
        counts: dict[str, float] = {"ok": 0, "warning": 0, "drift": 0, "miswired": 0, "named": 0}
        for _ in range(reps):
            report = judge(profile, pool.window(live_sources, size, rng), thresholds)
            counts[report.status] += 1
            observed = [s.observed_source for s in report.slots]
            counts["named"] += observed == list(live_sources)
        out[size] = {k: v / reps for k, v in counts.items()}
    return out


def pool_from_testbed(target_dir, docs: int, domain: str, seed: int, skip_first: int = 1) -> StatePool:
    """Fresh held-out sequences of the testbed corpus through the testbed target (bf16-rounded, as
    served), with every source: embedding, block:0..N-1, final_norm."""
    import torch

    from hs_tracer_testbed import corpus, dumps
    from hs_tracer_testbed.target import encode, load_target

    target = load_target(target_dir)
    n = len(target.model.layers)
    names = [EMBEDDING] + [f"block:{j}" for j in range(n)] + [FINAL_NORM]
    seqs = []
    for ids in encode(corpus.documents(seed, docs, domain)):
        st = dumps.layer_states(target, torch.tensor(ids))
        x = torch.cat([st.layers.transpose(0, 1), st.final_norm[:, None]], dim=1)
        seqs.append(x.to(torch.bfloat16).float().numpy()[skip_first:])
    return StatePool(names, seqs)

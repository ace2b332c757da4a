"""Replay's calibrated verdict rule (hs_tracer.replay.rule): the level follows the capture's size
and the draft's own variability, its constants are the committed calibration's, and a served wiring
at training level is never "recovered" by a rewiring that merely scores higher."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from hs_tracer.replay import rule
from hs_tracer.replay.analysis import Candidate, ReplayResult
from hs_tracer.replay.runner import Agreement

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks/results/replay_rule.json"


def _sequences(n: int, p: float, length: int = 20, seed: int = 0) -> list[tuple[int, int]]:
    rng = np.random.default_rng(seed)
    return [(int(rng.binomial(length, p)), length) for _ in range(n)]


def test_spread_shrinks_with_the_capture_and_is_deterministic() -> None:
    seqs = _sequences(1000, 0.7)
    small, large = rule.spread(seqs, 128), rule.spread(seqs, 2048)
    assert small > 2 * large
    assert rule.spread(seqs, 128) == small  # seeded windows
    assert large >= (0.7 * 0.3 / 2048) ** 0.5 * 0.9  # never below the binomial floor (p is estimated)


def test_sequences_that_vary_among_themselves_widen_the_spread() -> None:
    """Agreement that varies by request (easy and hard prompts) scatters more than coin flips."""
    even = _sequences(1000, 0.7)
    mixed = _sequences(500, 0.95, seed=1) + _sequences(500, 0.45, seed=2)
    assert rule.spread(mixed, 512) > 1.5 * rule.spread(even, 512)


def test_a_small_training_pool_does_not_shrink_the_spread() -> None:
    """Windows taking most of a small pool overlap; the scatter of a capture that size does not."""
    rng = np.random.default_rng(3)
    pool = [(int(rng.binomial(20, q)), 20) for q in rng.uniform(0.4, 0.95, 4000)]  # requests vary
    n = 2400  # scored tokens of the capture; the small pool holds 3,000
    assert rule.spread(pool[:150], n) > 0.75 * rule.spread(pool, n)


def test_level_lies_below_training_by_the_allowance_and_z_spreads() -> None:
    seqs = _sequences(1000, 0.7)
    level = rule.training_level(seqs, 512)
    assert level.value == pytest.approx(level.training * (1 - rule.ALLOWANCE) - rule.Z * level.spread)
    assert level.reached(level.value) and not level.reached(level.value - 1e-6)
    assert level.margin(level.value + level.spread) == pytest.approx(1.0)


def test_constants_are_the_committed_calibration() -> None:
    d = json.loads(RESULTS.read_text())
    assert (d["calibration"]["allowance"], d["calibration"]["z"]) == (rule.ALLOWANCE, rule.Z)
    assert {"date", "machine", "method"} <= d.keys()
    # the calibration held on prompts it never saw: no correct-wiring window below the level
    assert all(row["below_level"] <= 0.01 for size, row in d["rates"]["heldout"]["correct"].items()
               if size != "agreement_all")


def _result(served: float, permuted: float, training: float = 0.74, tokens: int = 600) -> ReplayResult:
    def cand(name: str, wiring: tuple, rate: float) -> Candidate:
        return Candidate(name, wiring, ["block:1", "block:3", "block:4"],
                         Agreement(round(rate * tokens), tokens))

    as_served, perm = cand("as served", (0, 1, 2), served), cand("permutation", (1, 0, 2), permuted)
    train = _sequences(1000, training)
    return ReplayResult(
        capture=Path("c"), slot_sources=["block:1", "block:3", "block:4"],
        slot_evidence=["profile match"] * 3, trained_sources=["block:1", "block:3", "block:4"],
        trained_from="profile", as_served=as_served,
        tokens_only=Agreement(30, tokens), baseline=0.06, sequences=30, cached_prefix_sequences=0,
        training=Agreement(sum(c for c, _ in train), sum(t for _, t in train), tuple(train)),
        candidates=[as_served, perm], rule=rule.training_level(train, tokens))


def test_a_served_wiring_at_training_level_is_not_recovered_by_a_higher_rewiring() -> None:
    r = _result(served=0.73, permuted=0.75)
    assert r.status == "ok" and r.recovered_by() is None
    d = r.to_json()
    assert d["recovered_by"] is None and d["training_level_rule"]["tokens"] == 600
    assert [a["at_training_level"] for a in d["alternatives"]] == [True, True]


def test_below_the_level_the_best_rewiring_at_it_recovers() -> None:
    r = _result(served=0.50, permuted=0.73)
    assert r.status == "miswired"
    assert r.recovered_by() is not None and r.recovered_by().name == "permutation"
    low = _result(served=0.50, permuted=0.55)
    assert low.status == "miswired" and low.recovered_by() is None

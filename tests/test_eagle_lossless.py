"""The correctness oracle for the CPU EAGLE-3 path: greedy speculative decoding is lossless.

With temperature 0, EAGLE-3 must commit exactly the tokens plain decoding of the same target
commits, whatever the draft proposes: a wrong tree mask, a wrong cache location, a wrong accept
index or bonus token shows up as a different token sequence. The real ``sgl.Engine`` runs with
the testbed runtime (pure-torch sgl-kernel ops, ``intel_amx`` attention backend) and the testbed's
trained target and EAGLE-3 draft, for plain decoding, chain drafts (topk 1, 1 and 3 steps) and a
tree draft (topk 2, 3 steps, 6 draft tokens), on 24 prompts batched into one ``generate`` call, each
engine's first workload (an empty radix cache). The engines are the suite's shared ones
(tests/engine_runs.py): the 3-step chain is the untraced engine, the 1-step chain and the tree are
fault-injection engines (tracing switched itself off at its fault). On an older release (docs/versions.md)
the 3-step chain is its default worker's traced engine and the fault engines run its V1 worker (the
tree runs V1 there anyway: topk > 1). The trained draft is accepted often, so full-depth accepts
(every draft token of a step) happen and are checked too, not only rejections.
"""

from __future__ import annotations

import pytest

from tests.engine_runs import COUNTERS, ENGINES, FAMILY, OLDER_RELEASE

CHAIN3 = f"correct:{FAMILY.workers[0]}" if OLDER_RELEASE else "untraced"
SHAPES = {"chain1": "fault:startup", "chain3": CHAIN3, "tree3": "fault:per-step before"}
MAX_NEW_TOKENS = 24
NUM_PROMPTS = 24


def test_shapes_are_the_named_ones() -> None:
    got = {name: (ENGINES[e].spec_steps, ENGINES[e].topk, ENGINES[e].num_draft_tokens)
           for name, e in SHAPES.items()}
    assert got == {"chain1": (1, 1, None), "chain3": (3, 1, None), "tree3": (3, 2, 6)}


@pytest.mark.engine
@pytest.mark.parametrize("name", sorted(SHAPES))
def test_greedy_eagle3_commits_exactly_the_plain_tokens(engines, name: str) -> None:
    plain, spec = engines["plain"], engines[SHAPES[name]]
    want_all, got_all = plain.output_ids("lossless"), spec.output_ids("lossless")
    assert len(want_all) == NUM_PROMPTS
    assert all(len(ids) == MAX_NEW_TOKENS for ids in want_all)
    for i, (want, got) in enumerate(zip(want_all, got_all, strict=True)):
        assert got == want, f"prompt {i}: {name} diverges from plain decoding at token " + str(
            next(j for j, (a, b) in enumerate(zip(want, got, strict=False)) if a != b)
        )
    # speculation really ran: every request was verified, and some steps accepted every draft
    # token of the deepest path (histogram index = accepted drafts in one verify step)
    steps = spec.spec.spec_steps
    meta = spec.meta("lossless")
    verify = [m["spec_verify_ct"] for m in meta]
    assert all(v > 0 for v in verify)
    histogram = [0] * (steps + 1)
    for m in meta:
        for n, count in enumerate(m[COUNTERS.accept_histogram]):
            histogram[n] += count
    assert histogram[steps] > 0, histogram
    assert sum(histogram) == sum(verify)
    mean_accept_length = 1 + sum(m[COUNTERS.accepted_drafts] for m in meta) / sum(verify)
    assert 1.0 < mean_accept_length <= steps + 1

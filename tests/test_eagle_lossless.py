"""The correctness oracle for the CPU EAGLE-3 path: greedy speculative decoding is lossless.

With temperature 0, EAGLE-3 must commit exactly the tokens plain decoding of the same target
commits, whatever the draft proposes: a wrong tree mask, a wrong cache location, a wrong accept
index or bonus token shows up as a different token sequence. The real ``sgl.Engine`` runs with
the testbed runtime (pure-torch sgl-kernel ops, ``intel_amx`` attention backend) and the testbed's
trained target and EAGLE-3 draft, for plain decoding, chain drafts (topk 1, 1 and 3 steps) and a
tree draft (topk 2, 3 steps, 6 draft tokens), on 24 prompts batched into one ``generate`` call
per engine, in one fresh process. The trained draft is accepted often, so full-depth accepts
(every draft token of a step) happen and are checked too, not only rejections.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hs_tracer_testbed.corpus import prompts

CONFIGS = {"plain": "plain", "chain1": "chain1:1:1", "chain3": "chain3:3:1", "tree3": "tree3:3:2:6"}
MAX_NEW_TOKENS = 24
NUM_PROMPTS = 24


@pytest.fixture(scope="module")
def models() -> tuple[Path, Path]:
    from hs_tracer_testbed import ensure_testbed

    testbed = ensure_testbed(progress=False)
    return testbed.target, testbed.draft


@pytest.fixture(scope="module")
def runs(models: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    target, draft = models
    work = tmp_path_factory.mktemp("lossless-runs")
    (work / "prompts.json").write_text(json.dumps(prompts(seed=4242, n=NUM_PROMPTS)))
    cmd = [sys.executable, "-m", "hs_tracer_testbed.runtime.runs", "--target", str(target),
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
    # speculation really ran: every request was verified, and some steps accepted every draft
    # token of the deepest path (histogram index = accepted drafts in one verify step)
    steps = spec["config"]["spec_steps"]
    assert all(v > 0 for v in spec["verify_steps"])
    histogram = spec["correct_drafts_histogram"]
    assert len(histogram) == steps + 1 and histogram[steps] > 0, histogram
    assert sum(histogram) == sum(spec["verify_steps"])
    assert 1.0 < spec["mean_accept_length"] <= steps + 1

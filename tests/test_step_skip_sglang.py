"""Which requests a verify step counts, against SGLang's own ``_resolve_spec_v2_tokens``.

A child process drives SGLang's overlap scheduler loop (``event_loop_overlap``: build the next batch,
launch it, then process the previous batch's result) over real ``Req`` objects for a few hundred
iterations, with requests finishing (at decode and at prefill), being retracted and resumed,
prefills launched in between decode steps, and batches whose overlap SGLang disables (the previous
result processed before the launch). The result hook runs through SGLang's real ``HookRegistry``
wrapper around SGLang's real ``_resolve_spec_v2_tokens``, which increments ``req.spec_verify_ct``
for exactly the requests it commits. Every step hs_tracer hands over must hold exactly those
requests, with their accept lengths, although hs_tracer tests only the requests that can be
skipped (``hs_tracer/core/steps.py``). Without overlap SGLang never skips one, and neither does hs_tracer.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hs_tracer.core.steps import departed

CHILD = r"""
import json, random, sys
from collections import deque
from types import SimpleNamespace
from hs_tracer_testbed.runtime.inproc import init_world_of_one
init_world_of_one()
import torch
from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Req
from sglang.srt.managers.scheduler_components.batch_result_processor import SchedulerBatchResultProcessor
from sglang.srt.plugins.hook_registry import HookType, _wrap_fn
from sglang.srt.sampling.sampling_params import SamplingParams
from hs_tracer.config import TracerConfig
from hs_tracer.integrations.sglang import hooks, state
from hs_tracer.core.steps import StepPath
from hs_tracer.records import Ranks

NDT = 4
overlap = sys.argv[1] == "1"
rng = random.Random(int(sys.argv[2]))
st = state.install(TracerConfig(metrics_port=0))
st.spec_args = {"speculative_num_steps": 3}
st.steps = StepPath(None, None, 1 << 30, Ranks(), 1 << 16)
resolve = _wrap_fn(SchedulerBatchResultProcessor._resolve_spec_v2_tokens, hooks.after_resolve_spec_v2_tokens,
                   HookType.AFTER)
launch = _wrap_fn(lambda worker, batch, result: None, hooks.before_draft_extend_for_decode, HookType.BEFORE)
processor = SimpleNamespace(
    enable_overlap=overlap, enable_overlap_mlx=False,
    metrics_reporter=SimpleNamespace(snapshot_spec_decode_metrics=lambda batch, result: None),
    model_worker=SimpleNamespace(on_verify_complete_cpu=lambda *a, **k: None),
    advance_grammar_fsm=lambda result, batch: None)

made = 0
def new_req():
    global made
    made += 1
    return Req(f"r{made}", "", [1, 2, 3], SamplingParams(max_new_tokens=1 << 20))

expected = []  # per resolved step: (step, [(rid, accept length)] SGLang committed)
running, waiting, queue, stats = [], [new_req() for _ in range(6)], deque(), {"skipped": 0}
def process(kind, reqs, result):
    if kind == "prefill":
        for r in reqs:
            if rng.random() < 0.1:
                r.finished_reason = FINISH_LENGTH(length=1)  # finished by its prefill result
        return
    before = [r.spec_verify_ct for r in reqs]
    resolve(processor, result, SimpleNamespace(reqs=reqs, has_grammar=False))
    lens = result.accept_lens.tolist()
    stats["skipped"] += sum(r.spec_verify_ct == b for r, b in zip(reqs, before))
    expected.append((result._hs_tracer_step, [(r.rid, lens[i]) for i, r in enumerate(reqs)
                                             if r.spec_verify_ct == before[i] + 1]))
    for r, b in zip(reqs, before):
        if r.spec_verify_ct == b + 1 and rng.random() < 0.08:
            r.finished_reason = FINISH_LENGTH(length=1)  # SGLang's decode loop finishes it

for it in range(400):
    if rng.random() < 0.3:
        waiting.append(new_req())
    # ---- build (get_next_batch_to_run) ----
    batch = None
    if waiting and rng.random() < 0.25:
        new = [waiting.pop(0) for _ in range(min(len(waiting), rng.randint(1, 3)))]
        for r in new:
            r.is_retracted = False  # prepare_for_extend
        batch = ("prefill", new, None)
    else:
        kept = [r for r in running if not r.finished()]
        if len(kept) != len(running):
            running = kept  # filter_batch rebinds the list
        if running and rng.random() < 0.08:
            gone = rng.sample(running, rng.randint(1, min(2, len(running))))
            for r in gone:
                r.is_retracted = True
                r.retraction_count += 1
            running = [r for r in running if r not in gone]
            waiting.extend(gone)
        if running:
            result = SimpleNamespace(logits_output=SimpleNamespace(hidden_states=None))
            batch = ("decode", running, result)
    disable = rng.random() < 0.1  # SGLang processes the previous result before this launch
    if disable and queue:
        process(*queue.popleft())
    # ---- launch ----
    if batch is not None:
        kind, reqs, result = batch
        if kind == "decode":
            launch(None, SimpleNamespace(reqs=reqs), result)
            bs = len(reqs)
            result.accept_lens = torch.randint(1, NDT + 1, (bs,), dtype=torch.int32)
            result.next_token_ids = torch.zeros(bs * NDT, dtype=torch.int64)
            result.num_non_draft_tokens_per_req = 1
            result.speculative_num_draft_tokens = result.speculative_output_stride = NDT
            result.block_accept_lens = result.cap_lens = None
        queue.append((kind, reqs[:], result))  # batch.copy(): a snapshot of the list
        if kind == "prefill":
            running = running + reqs  # merged before its result is processed (overlap)
    if not overlap or not disable:
        while len(queue) > (1 if overlap else 0):
            process(*queue.popleft())
while queue:
    process(*queue.popleft())

got = [(r.step, [list(pair) for pair in zip(r.request_ids, r.accept_lengths)]) for r in st.steps.take()]
want = [(s, c) for s, c in expected if c]
print("RESULT " + json.dumps({"got": got, "want": want, "enabled": st.enabled, "reason": st.disabled_reason,
                              "skipped": stats["skipped"],
                              "pairs": sum(len(c) for _, c in want)}))
"""


def run_child(overlap: bool, seed: int) -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, "1" if overlap else "0", str(seed)],
                          capture_output=True, text=True, timeout=600,
                          cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stderr[-5000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


@pytest.mark.parametrize(("overlap", "seed"), [(True, 1), (True, 2), (False, 3)])
def test_each_step_counts_exactly_the_requests_sglang_commits(overlap: bool, seed: int) -> None:
    out = run_child(overlap, seed)
    assert out["enabled"], out["reason"]
    assert out["pairs"] > 1000
    assert (out["skipped"] > 20) is overlap  # ride-alongs happen under overlap only
    assert out["got"] == out["want"]


def test_departed_finds_every_request_missing_from_the_next_list() -> None:
    a = [object() for _ in range(200)]
    assert departed(a, a) == [] and departed(a, [*a, object()]) == []
    nxt = [x for i, x in enumerate(a) if i not in (0, 33, 34, 199)] + [object()]
    assert departed(a, nxt) == [0, 33, 34, 199]
    shuffled = a[::-1][:150]  # not in order: still every missing one (and some that are not)
    assert {i for i in range(200) if a[i] not in shuffled} <= set(departed(a, shuffled))

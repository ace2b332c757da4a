"""The per-step hooks on SGLang's own objects, called in the order SGLang's schedulers call them.

One child process (SGLang picks its CPU/GPU code path at import) publishes a real runtime context,
runs hs_tracer's startup (``TracerState.finish_startup``) and then drives the hooks with real
``Req``, ``ScheduleBatch``, ``GenerationBatchResult`` and ``LogitsProcessorOutput`` objects:

* the overlap scheduler's order (``event_loop_overlap``): batch N+1's draft extend runs before
  batch N's ``_resolve_spec_v2_tokens``, with a prefill launched in between; every record must carry
  its own step, its own digest (row count) and only the requests SGLang commits (finished and
  retracted ones are skipped, as ``_resolve_spec_v2_tokens`` skips them);
* the probes exist after startup, before any forward, warmed for the model dtype;
* prefill windows never receive decode rows nor position-0 rows;
* a pipeline stage that never finishes startup (no draft there) enqueues nothing;
* two DP replicas without DP attention (``SpawnRanks.dp_rank`` 0 and 1, attention-DP rank 0 in
  both) get different labels, metrics ports and capture directories.

The overlap path itself (CUDA streams) runs in the GPU run; the CPU engine has no overlap for
speculative decoding.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

CHILD = r"""
import json, sys, os
from types import SimpleNamespace
from hs_tracer_testbed.runtime.inproc import init_world_of_one
init_world_of_one()
import torch
from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Req, ScheduleBatch
from sglang.srt.managers.utils import GenerationBatchResult
from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.sampling.sampling_params import SamplingParams
from hs_tracer.config import TracerConfig
from hs_tracer.fingerprint import probe as probe_mod
from hs_tracer.integrations.sglang import hooks, state
from pathlib import Path

from tests.infra.tiny_tracer import H, K, NDT, started
out = {}

def startup(cfg, finish=True):
    st = started(cfg, finish)
    if finish:
        st.recorder.stop()
        st.recorder.join(5)
    return st

def req(rid):
    return Req(rid, "", [1, 2, 3], SamplingParams(max_new_tokens=8))

def decode(worker, batch, rows, fill):
    res = GenerationBatchResult(logits_output=LogitsProcessorOutput(
        next_token_logits=None, hidden_states=torch.full((rows, K * H), fill)))
    hooks.before_draft_extend_for_decode(worker, batch, res)
    return res

def resolve(batch, res, lengths):
    res.accept_lens = torch.tensor(lengths, dtype=torch.int32)
    res.speculative_num_draft_tokens = NDT
    hooks.after_resolve_spec_v2_tokens(None, None, res, batch)

built = []
real_init = probe_mod.FingerprintProbe.__init__
def spy(self, *a, **k):
    built.append(k.get("warmup_dtype"))
    real_init(self, *a, **k)
probe_mod.FingerprintProbe.__init__ = spy

# ---- overlap order -----------------------------------------------------------------------------
st = startup(TracerConfig(metrics_port=int(sys.argv[1]), window_tokens=10_000))
out["probes_after_startup"] = len(built)
out["warmup_dtypes"] = [str(d) for d in built]
a, b, c = req("a"), req("b"), req("c")
worker = SimpleNamespace()
batch_n = ScheduleBatch(reqs=[a, b])
res_n = decode(worker, batch_n, 2 * NDT, 1.0)                 # launch N
prefill = ScheduleBatch(reqs=[c], prefix_lens=[0], extend_lens=[5])
prefill.input_ids = torch.arange(5)
hooks.before_draft_extend_for_prefill(worker, prefill, torch.full((5, K * H), 7.0), torch.tensor([9]))
b.finished_reason = FINISH_LENGTH(length=8)                     # b finished by result N-1
batch_n1 = ScheduleBatch(reqs=[a, c])                          # N+1: b filtered out, c merged
res_n1 = decode(worker, batch_n1, 2 * NDT, 2.0)               # launch N+1
resolve(batch_n.copy(), res_n, [3, 2])                         # process N (b finished: skipped)
c.is_retracted = True
resolve(batch_n1.copy(), res_n1, [4, 2])                       # process N+1 (c retracted: skipped)
recs = st.steps.take()                                         # the recorder thread's side
out["records"] = [{"step": r.step, "rids": r.request_ids, "lengths": r.accept_lengths,
                   "rows": r.digest.tokens if r.digest else None,
                   "mean": r.digest.slots[0].mean if r.digest else None,
                   "host_s": r.host_overhead_s, "max_accept": r.max_accept_length} for r in recs]
out["probes_built_by_steps"] = len(built) - out["probes_after_startup"]
pre = st.steps.prefill.probe
pre.end_window()
w = pre.read_window()
out["prefill_window_rows"] = int(w.count[0].max())
out["prefill_window_mean"] = float(w.sum[0].sum() / w.count[0].sum())

# ---- chunked prefill: the capture records the tail token SGLang's draft extend uses -------------
import tempfile
st = startup(TracerConfig(metrics_port=int(sys.argv[1]) + 10, capture_dir=Path(tempfile.mkdtemp()) / "cap",
                          capture_rate=1.0))
d1, d2 = req("d1"), req("d2")
chunk = ScheduleBatch(reqs=[d1, d2], prefix_lens=[0, 0], extend_lens=[3, 2])
chunk.input_ids = torch.arange(5)
chunk.chunked_req = d2                       # d2's prompt continues in the next chunk
chunk.chunked_req_next_prompt_token = 42
hooks.before_draft_extend_for_prefill(worker, chunk, torch.zeros(5, K * H), torch.tensor([7, 8]))
out["chunk_tail"] = st.capture.pending[-1].next_token_ids.tolist()

# ---- a pipeline stage without a draft: startup never finishes there -------------------------------
st = startup(TracerConfig(), finish=False)
d = ScheduleBatch(reqs=[req("x")])
res = decode(worker, d, NDT, 1.0)
resolve(d.copy(), res, [2])
out["pp_nonlast"] = {"enabled": st.enabled, "queued": 0 if st.steps is None else len(st.steps.log)}

# ---- two DP replicas without DP attention --------------------------------------------------------
from sglang.srt.runtime_context import SpawnRanks, publish, reset_context
from sglang.srt.server_args import ServerArgs
from hs_tracer.export.capture import capture_path
from hs_tracer.export.prometheus import metrics_port_for
from pathlib import Path
replicas = []
for dp_rank in (0, 1):
    reset_context()
    publish(ServerArgs(model_path="dummy", tp_size=1, pp_size=1, dp_size=2, device="cpu"), role="test",
            ranks=SpawnRanks(world_rank=0, dp_rank=dp_rank))
    ranks, emitting = state._ranks()
    replicas.append({"labels": ranks.labels(), "emitting": emitting, "port": metrics_port_for(ranks),
                     "capture": str(capture_path(Path("/cap"), ranks))})
out["dp"] = replicas

# ---- prefill/decode disaggregation: the role from the server args ---------------------------------
roles = {}
for mode in ("prefill", "decode"):
    reset_context()
    publish(ServerArgs(model_path="dummy", tp_size=1, pp_size=1, device="cpu", disaggregation_mode=mode),
            role="test", ranks=SpawnRanks(world_rank=0))
    st = startup(TracerConfig(metrics_port=int(sys.argv[1]) + 1 + len(roles), window_tokens=4))
    b = ScheduleBatch(reqs=[req("p")], prefix_lens=[0], extend_lens=[5])
    b.input_ids = torch.arange(5)
    hooks.before_draft_extend_for_prefill(worker, b, torch.full((5, K * H), 3.0), torch.tensor([9]))
    window = st.recorder._read_window()                       # what the recorder reads and ships
    roles[mode] = {"role": st.role,
                   "decode": st.steps.decode is not None, "prefill": st.steps.prefill is not None,
                   "windows": int(window is not None)}
out["roles"] = roles
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def child() -> dict[str, Any]:
    from tests.infra.net import free_port

    proc = subprocess.run([sys.executable, "-c", CHILD, str(free_port())], capture_output=True,
                          text=True, timeout=900, cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stderr[-5000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def test_overlap_order_joins_each_record_to_its_own_step(child) -> None:
    n, n1 = child["records"]
    assert (n["step"], n1["step"]) == (1, 2)
    # Each record's digest is its own step's: 2 requests x 4 rows of 1.0, 2 x 4 rows of 2.0; the
    # prefill launched in between (rows of 7.0) is in neither.
    assert (n["rows"], n["mean"]) == (8, 1.0)
    assert (n1["rows"], n1["mean"]) == (8, 2.0)


def test_finished_and_retracted_requests_are_not_counted(child) -> None:
    n, n1 = child["records"]
    assert (n["rids"], n["lengths"]) == (["a"], [3])
    assert (n1["rids"], n1["lengths"]) == (["a"], [4])


def test_every_record_carries_its_host_time_and_acceptable_positions(child) -> None:
    assert all(r["host_s"] > 0 for r in child["records"])
    assert all(r["max_accept"] == 4 for r in child["records"])


def test_probes_are_built_and_warmed_at_startup(child) -> None:
    assert child["probes_after_startup"] == 1  # before any forward (one stream on a combined instance)
    assert child["warmup_dtypes"] == ["torch.float32"]
    assert child["probes_built_by_steps"] == 0


def test_window_leaves_out_position_0(child) -> None:
    """8 + 8 decode rows and the prefill's 5 prompt rows from position 0, of which four are kept."""
    assert child["prefill_window_rows"] == 8 + 8 + 4
    assert child["prefill_window_mean"] == pytest.approx((8 * 1.0 + 8 * 2.0 + 4 * 7.0) / 20)


def test_chunked_prefill_capture_records_the_next_prompt_token(child) -> None:
    """For a non-final chunk SGLang appends the next prompt token, not the sampled one."""
    assert child["chunk_tail"] == [7, 42]


def test_a_stage_that_never_finished_startup_enqueues_nothing(child) -> None:
    assert child["pp_nonlast"] == {"enabled": True, "queued": 0}


def test_pd_roles_come_from_server_args(child) -> None:
    """A prefill instance never verifies: prefill probe only, and its windows feed the diagnosis;
    a decode instance never runs the prefill draft extend: decode probe only."""
    pre, dec = child["roles"]["prefill"], child["roles"]["decode"]
    assert (pre["role"], pre["decode"], pre["prefill"], pre["windows"]) == ("prefill", False, True, 1)
    assert (dec["role"], dec["decode"], dec["prefill"], dec["windows"]) == ("decode", True, False, 0)


def test_dp_replicas_without_dp_attention_are_kept_apart(child) -> None:
    r0, r1 = child["dp"]
    assert r0["emitting"] and r1["emitting"]
    assert (r0["labels"]["dp_rank"], r1["labels"]["dp_rank"]) == ("0", "1")
    assert r0["labels"]["attn_dp_rank"] == r1["labels"]["attn_dp_rank"] == "0"
    assert r0["port"] != r1["port"]
    assert r0["capture"] != r1["capture"]

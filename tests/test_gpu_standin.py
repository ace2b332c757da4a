"""The GPU testbed runtime's CPU-checkable parts: the pure-torch ``sgl_kernel`` ops against references
(SGLang's own ``forward_native`` where it has one), the stand-in package's shape, the fallback
modules, the SGLang patches on SGLang's real classes, the sync-debug wrapper, the launcher's env.

The ops run on CUDA tensors in the GPU run (benchmarks/gpu_sglang.py); here they run on CPU tensors,
which exercises the same torch code.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from hs_tracer_testbed.runtime.gpu import launcher, ops, patches, standin

ROOT = Path(__file__).resolve().parents[1]


# ---- ops ---------------------------------------------------------------------------------------
def test_rmsnorm_matches_sglang_forward_native_on_a_row_strided_input() -> None:
    from sglang.srt.layers.layernorm import RMSNorm

    torch.manual_seed(0)
    norm = RMSNorm(96, eps=1e-6)
    norm.weight.data = torch.randn(96, dtype=torch.bfloat16)
    latent = torch.randn(5, 96 + 32, dtype=torch.bfloat16)
    x = latent[:, :96]  # row-strided, like DeepSeek's kv_a norm on a slice of the latent cache
    before = latent.clone()
    got = ops.rmsnorm(x, norm.weight.data, 1e-6)
    assert torch.equal(got, norm.forward_native(x.contiguous()))
    assert torch.equal(latent, before)
    out = torch.empty_like(got)
    assert ops.rmsnorm(x, norm.weight.data, 1e-6, out=out) is out and torch.equal(out, got)


def test_fused_add_rmsnorm_updates_both_in_place_like_forward_native() -> None:
    from sglang.srt.layers.layernorm import RMSNorm

    torch.manual_seed(1)
    norm = RMSNorm(64, eps=1e-6)
    norm.weight.data = torch.randn(64, dtype=torch.bfloat16)
    x, res = torch.randn(7, 64, dtype=torch.bfloat16), torch.randn(7, 64, dtype=torch.bfloat16)
    want_x, want_res = norm.forward_native(x.clone(), res.clone())
    ops.fused_add_rmsnorm(x, res, norm.weight.data, 1e-6)
    assert torch.equal(x, want_x) and torch.equal(res, want_res)


def test_silu_and_mul_matches_sglang() -> None:
    from sglang.srt.layers.activation import SiluAndMul

    x = torch.randn(3, 4, 2 * 20, dtype=torch.bfloat16)
    want = SiluAndMul().forward_native(x)
    assert torch.equal(ops.silu_and_mul(x), want)
    out = torch.empty(3, 4, 20, dtype=torch.bfloat16)
    ops.silu_and_mul(x, out)
    assert torch.equal(out, want)


def test_moe_sum_reduce_sums_top_k_in_fp32() -> None:
    x = torch.randn(6, 8, 32, dtype=torch.bfloat16)
    out = torch.empty(6, 32, dtype=torch.bfloat16)
    ops.moe_sum_reduce(x, out, 2.5)
    assert torch.equal(out, (x.float().sum(1) * 2.5).to(torch.bfloat16))


def test_weak_ref_tensor_views_the_same_memory() -> None:
    t = torch.arange(24.0).reshape(4, 6)[:, 1:5]
    w = ops.weak_ref_tensor(t)
    assert (w.data_ptr(), w.shape, w.stride(), w.dtype) == (t.data_ptr(), t.shape, t.stride(), t.dtype)
    t.fill_(3.0)
    assert torch.equal(w, t)
    assert ops.weak_ref_tensor(5) == 5


def _align_reference(topk_ids: list[list[int]], num_buckets: int,
                     block: int) -> tuple[list[int], list[int], int]:
    """The "+1 offset" contract written out in plain Python: bucket = id + 1, stable inside a bucket,
    each bucket padded to ``block`` with ``numel``; one expert id (bucket - 1) per block."""
    flat = [e for row in topk_ids for e in row]
    numel = len(flat)
    ids: list[int] = []
    experts: list[int] = []
    for b in range(num_buckets):
        members = [i for i, e in enumerate(flat) if e + 1 == b]
        if not members:
            continue
        padded = -(-len(members) // block) * block
        ids += members + [numel] * (padded - len(members))
        experts += [b - 1] * (padded // block)
    return ids, experts, len(ids)


@pytest.mark.parametrize("seed", range(40))
def test_moe_align_block_size_follows_the_plus_one_contract(seed: int) -> None:
    rng = random.Random(seed)
    experts, topk, block = rng.randint(2, 40), rng.randint(1, 8), rng.choice([1, 4, 16, 64])
    tokens = rng.randint(1, 40)
    topk = min(topk, experts)
    rows = [rng.sample(range(experts), topk) for _ in range(tokens)]
    if seed % 3 == 0:  # EP-filtered slots carry -1
        rows = [[-1 if rng.random() < 0.2 else e for e in row] for row in rows]
    topk_ids = torch.tensor(rows, dtype=torch.int32)
    buckets = experts + 1
    numel = topk_ids.numel()
    cap = numel + buckets * (block - 1)
    sorted_ids = torch.full((cap,), -7, dtype=torch.int32)
    expert_ids = torch.full((-(-cap // block),), -7, dtype=torch.int32)
    post_pad = torch.empty(1, dtype=torch.int32)
    cumsum = torch.empty(buckets + 1, dtype=torch.int32)
    ops.moe_align_block_size(topk_ids, buckets, block, sorted_ids, expert_ids, post_pad, cumsum, True)
    want_ids, want_experts, total = _align_reference(rows, buckets, block)
    assert int(post_pad[0]) == total
    assert sorted_ids[:total].tolist() == want_ids
    assert sorted_ids[total:].eq(numel).all()  # pad_sorted_token_ids=True pre-fills everything
    assert expert_ids[: total // block].tolist() == want_experts
    assert int(cumsum[0]) == 0 and int(cumsum[buckets]) == total


# ---- the stand-in package, fallbacks and patches, as SGLang's processes see them -----------------
# The hooks that run once while SGLang starts (by target method name): left unarmed.
STARTUP_METHODS = ("resolve_spec_aux_hidden_state_config", "init_attention_backends", "init_lm_head",
                   "init_cuda_graphs")
STANDIN_PROBE = """
    import importlib, json, sys
    import torch
    import sgl_kernel, sgl_kernel.quantization, sgl_kernel.kvcacheio, sgl_kernel.utils
    from sgl_kernel import rmsnorm, transfer_kv_all_layer_mla  # bound at import, like SGLang does
    out = {"stand_in": sgl_kernel.HS_TRACER_TESTBED_STAND_IN, "version": sgl_kernel.__version__,
           "file": sgl_kernel.__file__}
    try:
        sgl_kernel.merge_state_v2(1)
    except NotImplementedError as exc:
        out["missing_call"] = str(exc)
    out["missing_submodules"] = []
    for name in ("sgl_kernel.allreduce", "sgl_kernel.scalar_type"):
        try:
            importlib.import_module(name)
        except ImportError:
            out["missing_submodules"].append(name)
    out["torch_ops"] = hasattr(torch.ops.sgl_kernel, "awq_marlin_repack")
    from flash_mla.flash_mla_interface import FlashMLASchedMeta
    import flash_mla
    from IPython.display import HTML
    out["flash_mla_stub"] = getattr(flash_mla, "HS_TRACER_TESTBED_STAND_IN", False)
    import IPython
    out["ipython_stub"] = getattr(IPython, "HS_TRACER_TESTBED_STAND_IN", False)
    from sglang.srt.layers.dual_gemm import DualGemm
    out["dual_gemm_mode"] = DualGemm._select_mode(None, None, 7168)
    from sglang.srt.distributed.device_communicators.triton_symm_mem_ag import MultimemAllGatherer
    out["multimem_state"] = repr(MultimemAllGatherer(128, enabled=True)._state)
    from hs_tracer.integrations.sglang import hooks, plugin
    table = hooks.hook_table(wrap=plugin.register.keywords["wrap"])  # the entry point SGLang calls
    out["hooks_wrapped"] = [h.__hs_tracer_where__ for _t, h, _k in table
                            if getattr(h, "__hs_tracer_sync_checked__", False)]
    print("RESULT " + json.dumps(out))
"""


def test_sitecustomize_applies_the_gpu_runtime_in_a_fresh_process() -> None:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("HS_TRACER", "SGLANG_"))}
    base["PYTHONPATH"] = str(ROOT)
    env = launcher.runtime_env({patches.SYNC_DEBUG_FLAG: "1"}, base=base)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(STANDIN_PROBE)], env=env,
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))[7:])
    assert out["stand_in"] is True and out["version"] == "0.4.10"
    assert out["file"].startswith(str(launcher.PYTHONPATH_DIR))
    assert "sgl_kernel.merge_state_v2 was called" in out["missing_call"]
    assert out["missing_submodules"] == ["sgl_kernel.allreduce", "sgl_kernel.scalar_type"]
    assert out["torch_ops"] is False  # no fake torch.ops.sgl_kernel names (SGLang probes them)
    assert out["flash_mla_stub"] is True
    assert out["ipython_stub"] is False  # a real IPython is installed here: the fallback stays out
    assert out["dual_gemm_mode"] is None
    assert out["multimem_state"] == "None"  # NCCL fallback, multicast never tried
    from hs_tracer.integrations.sglang import hooks

    serving = [h.__hs_tracer_where__ for t, h, _k in hooks.hook_table()
               if t.rsplit(".", 1)[-1] not in STARTUP_METHODS]
    # per step: the draft's input (prefill, decode), the accept lengths, the logits; at graph capture:
    # every importable model body that captures aux states
    bodies = [t for t, _h, _k in hooks.hook_table() if t.startswith("sglang.srt.models.")]
    assert out["hooks_wrapped"] == serving and bodies and len(serving) == 4 + len(bodies)


BREAKDOWN_PROBE = """
import json, torch
from types import SimpleNamespace
from hs_tracer.fingerprint.probe import FingerprintProbe
from hs_tracer.core.steps import StepPath
from hs_tracer.records import Ranks
from hs_tracer_testbed.runtime.gpu import patches

probe = FingerprintProbe(2, 8, "cpu")
path = StepPath(probe, probe, 32, Ranks(), 64)
reqs = [SimpleNamespace(is_retracted=False, finished_reason=None, rid=str(i)) for i in range(3)]
for _ in range(20):
    result = SimpleNamespace()
    path.observe_decode(torch.ones(12, 16), result, reqs)
    path.record(result, reqs, torch.tensor([1, 2, 3], dtype=torch.int32), 4, 4)
patches._breakdown.write()
print("RESULT " + json.dumps({"path": str(patches._breakdown.path), "steps": len(path.take())}))
"""


def test_host_breakdown_times_the_step_path_per_batch_size(tmp_path: Path) -> None:
    """With the breakdown flag the runtime times hs_tracer's real per-step functions, once per call,
    keyed by the batch size, and a canary beside every decode hook; tracing itself is unchanged."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("HS_TRACER", "SGLANG_"))}
    base["PYTHONPATH"] = str(ROOT)
    env = launcher.runtime_env({patches.BREAKDOWN_FLAG: str(tmp_path)}, base=base)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(BREAKDOWN_PROBE)], env=env,
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))[7:])
    assert out["steps"] == 20
    summary = json.loads(Path(out["path"]).read_text())
    per_call = summary["3"]  # the batch size is noted as each result comes in
    assert per_call["record"]["count"] == per_call["step_log_append"]["count"] == 20
    assert per_call["observe_decode"]["count"] == per_call["canary"]["count"] == 19  # the first: before any
    assert summary["0"]["observe_decode"]["count"] == 1
    assert per_call["window_close"]["count"] >= 1  # 12 rows a step, windows of 32 rows
    assert all(v["median_us"] > 0 for v in per_call.values())


def test_fallback_finder_serves_modules_only_when_none_is_installed() -> None:
    finder = standin.FallbackFinder()
    assert finder.find_spec("flash_mla", None) is not None
    assert finder.find_spec("numpy", None) is None
    spec = finder.find_spec("IPython.display", None)
    module = spec.loader.create_module(spec)
    spec.loader.exec_module(module)
    assert module.HTML("x") is None and module.display("x") is None
    with pytest.raises(standin.UnavailableKernelError):
        module.anything_else()


# ---- sync debug wrapper ---------------------------------------------------------------------------
def test_sync_checked_arms_error_mode_only_around_the_hook_and_restores_it_on_errors() -> None:
    calls: list[str] = []

    def hook(x: int) -> int:
        calls.append(f"hook {x}")
        if x < 0:
            raise ValueError("boom")
        return x

    checked = patches.sync_checked(hook, set_mode=calls.append)
    assert checked(3) == 3
    with pytest.raises(ValueError):
        checked(-1)
    assert calls == ["error", "hook 3", "default", "error", "hook -1", "default"]


def test_arm_sync_debug_gives_the_plugin_a_wrap_that_arms_the_serving_time_hooks() -> None:
    from hs_tracer.integrations.sglang import hooks

    calls: list[Any] = []
    module = types.SimpleNamespace(register=lambda wrap=None: calls.append(wrap))
    patches.arm_sync_debug(module)
    module.register()  # as SGLang calls the entry point: without arguments
    (wrap,) = calls
    plain, armed = hooks.hook_table(), hooks.hook_table(wrap=wrap)
    assert [(t, k) for t, _h, k in armed] == [(t, k) for t, _h, k in plain]
    for (target, new, _k), (_t, orig, _k2) in zip(armed, plain, strict=True):
        checked = getattr(new, "__hs_tracer_sync_checked__", False)
        assert checked is (target.rsplit(".", 1)[-1] not in STARTUP_METHODS), target
        assert new.__hs_tracer_where__ == orig.__hs_tracer_where__
    bodies = [t for t, _h, _k in plain if t.startswith("sglang.srt.models.")]
    assert bodies and sum(getattr(new, "__hs_tracer_sync_checked__", False)
                          for _t, new, _k in armed) == 4 + len(bodies)
    assert patches.PLUGIN_MODULE not in patches.patches({})
    assert patches.PLUGIN_MODULE in patches.patches({patches.SYNC_DEBUG_FLAG: "1"})


def test_narrow_mla_decode_loads_v_itself_only_where_the_latent_tile_is_wider() -> None:
    """SGLang's grouped decode kernel reuses the K tile as V for MLA, which only fits when both pad to
    the same power of two (DeepSeek's 576/512 and 288/256 have their own tiles). The testbed's 40/32
    failed to compile; there the kernel loads V from the value buffer instead."""
    from sglang.kernels.ops.attention import decode_attention

    assert callable(decode_attention._decode_grouped_att_m_fwd)  # the patched name exists in 0.5.23
    seen: list[bool] = []
    module = types.SimpleNamespace(
        _decode_grouped_att_m_fwd=lambda q, k, v, *a, has_mla=False, **kw: seen.append(has_mla))
    patches.narrow_mla_decode(module)
    for lk, lv, mla in ((40, 32, True), (576, 512, True), (288, 256, True), (64, 64, True), (40, 32, False)):
        module._decode_grouped_att_m_fwd(None, torch.empty(1, 1, lk), torch.empty(1, 1, lv), 0, has_mla=mla)
    assert seen == [False, True, True, True, False]


@pytest.mark.parametrize(("lq", "lv", "dv"), [(40, 32, 64), (16, 16, 16), (32, 32, 32), (576, 512, 512)])
def test_unified_extend_gets_a_v_tile_as_wide_as_qk_only_where_they_differ(
        monkeypatch: pytest.MonkeyPatch, lq: int, lv: int, dv: int) -> None:
    """Deterministic mode's unified extend kernel, launched through SGLang's real
    ``extend_attention_fwd_unified`` on CPU tensors (the Triton kernel itself is a recorder here):
    the tiny target's absorbed MLA (Q·K tile 64, V tile 32) read past shared memory on the H200, so
    its V tile is widened to 64; equal tiles and DeepSeek-V3's own tiles stay as SGLang chose, and
    the tile lookup is SGLang's own again after the call."""
    from sglang.kernels.ops.attention import extend_attention as ea

    launches: list[dict[str, Any]] = []

    class Kernel:
        def __getitem__(self, grid: Any) -> Callable[..., None]:
            return lambda *args, **kwargs: launches.append(kwargs)

    monkeypatch.setattr(ea, "_fwd_kernel_unified", Kernel())
    monkeypatch.setattr(ea, "extend_attention_fwd_unified", ea.extend_attention_fwd_unified)
    original_sizes = ea._get_block_sizes_for_extend_attention
    patches.even_unified_extend_tiles(ea)
    tokens, heads = 3, 2
    kv = torch.zeros(8, 1, lq)
    indptr = torch.tensor([0, tokens], dtype=torch.int32)
    ea.extend_attention_fwd_unified(torch.zeros(tokens, heads, lq), torch.zeros(tokens, heads, lv), kv,
                                    kv[..., :lv], 1.0, 1.0, indptr, indptr,
                                    torch.arange(1, tokens + 1), torch.zeros(1, dtype=torch.int32), tokens)
    (launch,) = launches
    assert launch["BLOCK_DV"] == dv and launch["Lv"] == lv  # V loads and stores stay masked to Lv
    assert launch["BLOCK_DMODEL"] == original_sizes(lq, lv)[0]
    assert ea._get_block_sizes_for_extend_attention is original_sizes


# ---- launcher ------------------------------------------------------------------------------------
def test_runtime_env_keeps_multicast_off_whatever_the_caller_asks() -> None:
    base = {"PYTHONPATH": f"/x{os.pathsep}{launcher.PYTHONPATH_DIR}", "NVSHMEM_DISABLE_NVLS": "0"}
    env = launcher.runtime_env({"NCCL_NVLS_ENABLE": "1", "HS_TRACER": "1"}, base=base)
    assert {k: env[k] for k in launcher.NO_MULTICAST_ENV} == launcher.NO_MULTICAST_ENV
    want = [str(launcher.PYTHONPATH_DIR), "/x", str(launcher.PACKAGE_ROOT)]
    assert env["PYTHONPATH"].split(os.pathsep) == want
    assert env["HS_TRACER"] == "1" and env[launcher.RUNTIME_FLAG] == "1"
    assert env["SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND"] == "python"


def test_production_width_configs_are_deepseek_v3_width(tmp_path: Path) -> None:
    from hs_tracer_testbed.runtime.gpu.prodwidth import write_models

    out = write_models(tmp_path)
    target = json.loads((out / "target" / "config.json").read_text())
    draft = json.loads((out / "draft" / "config.json").read_text())
    assert target["hidden_size"] == draft["hidden_size"] == 7168
    assert (target["kv_lora_rank"], target["q_lora_rank"], target["qk_rope_head_dim"]) == (512, 1536, 64)
    assert max(draft["eagle_config"]["eagle_aux_hidden_state_layer_ids"]) + 1 < target["num_hidden_layers"]


# ---- defects the GPU run exposed ------------------------------------------------------------------
def test_probe_is_built_at_startup_not_on_the_first_serving_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Building the fingerprint probe compiles its kernel and synchronises; on the H200 that
    happened inside the first prefill's hook (caught by sync-debug mode). It now happens when
    startup finishes, for the width the target hands over; a step of another width builds
    nothing (fingerprints stay off for it, the width finding stands)."""
    from hs_tracer.config import TracerConfig
    from hs_tracer.fingerprint import probe as probe_mod
    from hs_tracer.integrations.sglang import state as state_mod
    from hs_tracer.records import Ranks

    class NoRecorder:
        def __init__(self, _st: object) -> None:
            pass

        def start(self) -> None:
            pass

    monkeypatch.setattr(state_mod, "_ranks", lambda: (Ranks(), True))
    monkeypatch.setattr(state_mod, "_role", lambda: "null")
    monkeypatch.setattr("hs_tracer.core.recorder.Recorder", NoRecorder)
    built: list[int] = []
    init = probe_mod.FingerprintProbe.__init__
    monkeypatch.setattr(probe_mod.FingerprintProbe, "__init__",
                        lambda self, k, h, *a, **kw: built.append(k * h) or init(self, k, h, *a, **kw))
    st = state_mod.TracerState(TracerConfig())
    st.target = {"architecture": "DeepseekV3ForCausalLM", "model_path": "t", "num_layers": 8,
                 "hidden_size": 64, "layers_to_capture": [2, 4, 5], "capture_aux_hidden_states": True}
    st.aux = {"use_aux_hidden_state": True, "layer_ids": [1, 3, 4]}
    st.draft = {"fc_in_features": 192, "num_aux_hidden_states": 3, "graph_width": 192}
    st.finish_startup()
    assert built == [192] and st.steps is not None and st.steps.decode is not None
    probe = st.steps.decode.probe
    st.steps.observe_decode(torch.randn(4, 192), types.SimpleNamespace())
    assert built == [192] and probe.steps == 1
    st.steps.observe_decode(torch.randn(4, 128), types.SimpleNamespace())  # another width: no build
    st.steps.observe_decode(torch.randn(4, 128), types.SimpleNamespace())
    assert built == [192] and probe.steps == 1 and st.steps.width_warned


def test_accept_lengths_count_only_requests_sglang_commits(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the overlap scheduler a verify batch still holds requests that finished (or were retracted)
    in the step before; SGLang discards their tokens and does not count the step in spec_verify_ct.
    On the H200 hs_tracer counted them (793 request-steps against SGLang's 773); now it skips them."""
    from array import array

    from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    from hs_tracer.config import TracerConfig
    from hs_tracer.integrations.sglang import hooks, state

    reqs = [Req(f"r{i}", "", array("i", [1, 2, 3]), SamplingParams(max_new_tokens=8)) for i in range(4)]
    reqs[1].finished_reason = FINISH_LENGTH(8)
    reqs[2].is_retracted = True
    # the step path reads finished_reason itself: it must mean what SGLang's finished() means
    finished = [r.finished() for r in reqs]
    assert finished == [r.finished_reason is not None for r in reqs] == [False, True, False, False]
    monkeypatch.setattr(state.SLOT, "state", state.SLOT.state)  # restored after the test
    from hs_tracer.core.steps import StepPath
    from hs_tracer.records import Ranks

    st = state.install(TracerConfig())
    st.steps = StepPath(None, None, 1 << 30, Ranks(), 64)
    result = types.SimpleNamespace(accept_lens=torch.tensor([3, 4, 2, 1]), speculative_num_draft_tokens=4)
    hooks.after_resolve_spec_v2_tokens(None, None, result, types.SimpleNamespace(reqs=reqs))
    assert st.hook_errors == 0
    for r in reqs:  # finishing after the step does not change what that step committed
        r.finished_reason = FINISH_LENGTH(8)
    recorded = st.steps.take()
    assert [(r.request_ids, r.accept_lengths) for r in recorded] == [(["r0", "r3"], [3, 1])]
    hooks.after_resolve_spec_v2_tokens(None, None, result, types.SimpleNamespace(reqs=reqs))
    assert st.steps.take() == []  # a batch of finished requests only is no verify step


def test_dp_attention_prefill_padding_stays_out_of_the_fingerprint(monkeypatch: pytest.MonkeyPatch) -> None:
    """With DP attention every rank's prefill is padded to a shared token count (MAX_LEN), and when
    all its requests have a cached prefix SGLang trims the target's hidden states to ``seq_lens_sum``
    (prefix included), so the padding rows reach the draft extend. On the H200 (TP=2, attention DP 2)
    they went into DP rank 0's windows and every slot read "unknown". SGLang's own
    ``post_forward_mlp_sync_batch`` shows the padding surviving; hs_tracer now fingerprints only the
    requests' extend rows, and skips an idle rank's batch."""
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    from hs_tracer.config import TracerConfig
    from hs_tracer.core.steps import StepPath
    from hs_tracer.fingerprint.probe import FingerprintProbe
    from hs_tracer.integrations.sglang import hooks, state
    from hs_tracer.records import Ranks

    k, h, padded = 3, 8, 16

    def target_prefill(prefix: list[int], extend: list[int]) -> torch.Tensor:
        """The hidden states SGLang hands to the draft after a padded DP prefill: real rows ~N(0, 1),
        padding rows far off (what a dummy token at position 0 carries)."""
        real = sum(extend)
        rows = torch.cat([torch.randn(real, k * h, dtype=torch.float64),
                          torch.full((padded - real, k * h), 1e4, dtype=torch.float64)])
        seq_lens = [p + e for p, e in zip(prefix, extend, strict=True)]
        fb = ForwardBatch(forward_mode=ForwardMode.EXTEND, batch_size=len(extend),
                          input_ids=torch.zeros(padded, dtype=torch.long),
                          req_pool_indices=torch.arange(len(extend)), seq_lens=torch.tensor(seq_lens),
                          out_cache_loc=torch.zeros(padded, dtype=torch.long), seq_lens_sum=sum(seq_lens),
                          positions=torch.zeros(padded, dtype=torch.long))
        fb._original_num_tokens, fb._original_batch_size = real, len(extend)  # as prepare_mlp_sync_batch
        out = LogitsProcessorOutput(next_token_logits=torch.zeros(len(extend), 4), hidden_states=rows)
        fb.post_forward_mlp_sync_batch(out)
        return out.hidden_states

    monkeypatch.setattr(state.SLOT, "state", state.SLOT.state)  # restored after the test
    st = state.install(TracerConfig())
    probe = FingerprintProbe(k, h, "cpu")
    st.steps = StepPath(probe, probe, 1 << 30, Ranks(), 64)  # nothing is recorded here
    cases = [([0, 0], [3, 5], 8),  # no cached prefix: SGLang trims to the real rows itself
             ([9, 9], [2, 2], padded)]  # cached prefixes: SGLang keeps the padding rows
    for prefix, extend, rows in cases:
        features = target_prefill(prefix, extend)
        assert features.shape[0] == rows
        batch = types.SimpleNamespace(prefix_lens=prefix, extend_lens=extend)
        hooks.before_draft_extend_for_prefill(None, batch, features)
    # An idle rank runs the prefill path too while another rank prefills; its batch (SGLang's own
    # idle ScheduleBatch) has no prefix_lens. On the H200 this raised in the hook and switched
    # tracing off on DP rank 0.
    idle = ScheduleBatch(reqs=[], forward_mode=ForwardMode.IDLE)
    hooks.before_draft_extend_for_prefill(None, idle, torch.zeros(0, k * h, dtype=torch.float64))
    assert st.hook_errors == 0 and st.enabled
    probe.end_window()
    window = probe.read_window()
    assert window is not None
    # rows seen: 3 + 5 minus the two rows at position 0, then the 4 cached-prefix rows; no padding
    assert window.count[0, 0] == 6 + 4
    assert float(abs(window.sum).max()) < 1e3


def test_divergence_margins_read_plain_decodings_top2_where_eagle_first_differs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The lossless evidence of the GPU script: where an EAGLE engine's greedy output first leaves
    plain decoding's, the margin between plain's top-2 log-probabilities there, against all
    positions' margins."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_sglang", ROOT / "benchmarks" / "gpu_sglang.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_sglang", mod)  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    plain = [[1, 2, 3], [4, 5, 6]]
    eagle = [[1, 2, 9], [4, 5, 6]]
    top = [[[[-0.1, t, None], [-2.1, 7, None]] for t in seq] for seq in plain]
    top[0][2] = [[-0.69, 3, None], [-0.70, 9, None]]  # a near-tie where the outputs part
    got = mod.divergence_margins(plain, top, eagle)
    (first,) = got["first_divergences"]
    assert (first["sequence"], first["position"], first["eagle_token_is_top2"]) == (0, 2, True)
    assert got["max_margin_at_divergence"] == pytest.approx(0.01)
    assert got["median_margin_all_positions"] == pytest.approx(2.0)
    assert got["share_of_positions_at_or_below_max"] == pytest.approx(1 / 6)
    assert mod.plain_reference("tree_fp32_on") == "plain_fp32" and mod.plain_reference("tree_on") == "plain"
    assert mod.plain_reference("tree_fp32_off") == "plain_fp32"


def test_testbed_summary_compares_every_round_on_off_and_each_engine_against_itself(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Three rounds: tracing on/off and EAGLE/plain per round, each engine's later rounds against its
    first (run-to-run variation), and the Markdown names every round."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_sglang", ROOT / "benchmarks" / "gpu_sglang.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_sglang", mod)
    spec.loader.exec_module(mod)
    servers = mod.testbed_servers(Path("t"), Path("d"), Path("s"), Path("p"), 1, deterministic=True)
    names = [s.name for s in servers]
    assert {"chain_fp32_off", "tree_fp32_off"} <= set(names)
    assert all("--enable-deterministic-inference" in s.args for s in servers)
    assert not any("--enable-deterministic-inference" in s.args
                   for s in mod.testbed_servers(Path("t"), Path("d"), Path("s"), Path("p"), 1))

    def outs(seqs: list[list[int]]) -> list[dict[str, Any]]:
        return [{"output_ids": x, "meta_info": {"spec_verify_ct": 2, "spec_num_correct_drafts": 1}}
                for x in seqs]

    same, other = [[1, 2], [3, 4]], [[1, 2], [3, 5]]
    runs = {n: {"rounds": [outs(same)] * 3, "reports": [], "metrics": None, "logprobs": None} for n in names}
    runs["tree_fp32_on"]["rounds"] = [outs(same), outs(other), outs(same)]
    tb = mod.summarize_testbed(servers, runs)
    assert [r["identical"] for r in tb["tracing_on_vs_off"]["tree_fp32_on vs tree_fp32_off"]] == [
        True, False, True]
    assert all(r["identical"] for r in tb["tracing_on_vs_off"]["chain_on vs chain_off"])
    assert [r["identical"] for r in tb["rounds_vs_round_1"]["tree_fp32_on"]] == [False, True]
    assert [r["identical"] for r in tb["lossless_vs_plain"]["tree_fp32_on"]] == [True, False, True]
    text = mod.markdown({"sglang": "0.5.23", "tp": 1, "date": "d", "cuda_graphs": "on",
                         "overlap_scheduler": "on", "radix_cache": "on", "method": "m", "server_flags": [],
                         "deterministic_inference": True, "source": {"commit": "abc", "dirty": False},
                         "notes": ["read me first"], "testbed": tb})
    assert "tree_fp32_on vs tree_fp32_off: identical / 1/2 differ / identical" in text
    assert "Source: commit abc (clean tree)" in text and "deterministic inference: on" in text
    assert "Note: read me first" in text


def test_prod_part_reports_the_self_measured_cost_next_to_the_wall_time_difference(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The prod part's per-step figures from hs_tracer's metrics: hooks + recorder thread CPU +
    kernel GPU, the on/off wall difference per step beside it, and the Markdown row showing both."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_sglang", ROOT / "benchmarks" / "gpu_sglang.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_sglang", mod)
    spec.loader.exec_module(mod)
    text = ('hs_tracer_thread_cpu_seconds_total{model="m",tp_rank="0"} 0.003\n'
            'hs_tracer_fingerprint_kernel_gpu_seconds{model="m",tp_rank="0"} 7.5e-06\n')
    assert mod.counter(text, "hs_tracer_thread_cpu_seconds") == 0.003
    assert mod.gauge(text, "hs_tracer_fingerprint_kernel_gpu_seconds") == 7.5e-06
    assert mod.gauge(text, "hs_tracer_enabled") is None
    own = mod.self_measured(30 * 15e-6, 0.003, 30, 7.5e-6)
    assert own == {"hook_us": 15.0, "thread_cpu_us": 100.0, "kernel_gpu_us": 7.5, "total_us": 122.5}
    assert mod.self_measured(0.0, 0.0, 0, None)["total_us"] is None
    assert mod.self_measured(30 * 15e-6, 0.0, 30, None)["total_us"] == 15.0  # on the CPU: no kernel
    wall = mod.wall_diff_us_per_step([1.0, 2.0, 1.0], [1.001, 2.003, 1.002], 100)
    assert wall["median_us"] == pytest.approx(20.0) and wall["iqr_us"] == pytest.approx([15.0, 25.0])
    row = {"batch_size": 8, "new_tokens_per_request": 256, "pairs": 3, "tokens_per_s_off": 1.0,
           "tokens_per_s_on": 1.0, "on_over_off": 1.0, "on_over_off_min": 1.0, "on_over_off_max": 1.0,
           "on_over_off_iqr": [1.0, 1.0], "decode_step_ms_off": 1.0, "host_overhead_mean_us": 15.0,
           "host_overhead_histogram_delta": {"count": 30}, "hs_tracer_verify_steps": 30,
           "sglang_verify_steps": {"on": 30}, "self_measured_us_per_step": own,
           "on_minus_off_wall_us_per_step": wall, "sglang_request_steps": 240,
           "hs_tracer_request_steps": 240.0}
    md = mod.markdown({"sglang": "0.5.23", "tp": 1, "date": "d", "cuda_graphs": "on",
                       "overlap_scheduler": "on", "radix_cache": "on", "method": "m",
                       "server_flags": [], "source": {"commit": "abc"},
                       "prod": {"throughput": [row]}})
    assert "| 8 | 15.0000 | 100.0000 | 7.5000 | 122.5000 | 20.0000 | [15.0, 25.0] | 240 / 240.0000 |" in md

"""The CPU testbed runtime: applied only by its launcher, and correct inside a real sgl.Engine.

* Importing hs_tracer (package, plugin entry point, testbed package) installs nothing of the
  runtime: no ``sgl_kernel`` stand-in, no ops under ``torch.ops.sgl_kernel``, no env changes.
* After ``prepare_process()`` the patches act on SGLang's real classes: DeepSeek's attention
  dispatch picks MLA on the ``intel_amx``/``torch_native`` backends, SGLang keeps ``intel_amx``
  (platform fact ``has_amx``), yet ``cpu_has_amx_support()`` stays False so ordinary layers run
  ``forward_native``; unported sgl-kernel names fail loudly, naming the op.
* A real ``sgl.Engine`` (plain decoding, the testbed's trained DeepSeek-V3 target: the suite's shared
  ``plain`` engine) produces the same greedy tokens as the target run by Hugging Face transformers:
  the pure-torch attention ops (MLA prefill via extend, decode) compute what SGLang's C++ kernels
  would.

Each check runs in a fresh interpreter: the runtime must be prepared before SGLang is imported,
and other tests in the pytest process import SGLang's GPU-path modules.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest


def _run_python(script: str, *args: str, timeout: int = 600) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HS_TRACER", "SGLANG_"))}
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


PRODUCTION_IMPORTS = """
    import json, os, sys
    import torch
    import hs_tracer, hs_tracer_testbed, hs_tracer_testbed.runtime
    from importlib.metadata import entry_points
    (plugin,) = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "hs_tracer"]
    plugin.load()()  # what SGLang's load_plugins() does, with HS_TRACER unset
    print("RESULT " + json.dumps({
        "sgl_kernel": "sgl_kernel" in sys.modules,
        "ops": hasattr(torch.ops.sgl_kernel, "decode_attention_cpu"),
        "sys_path": [p for p in sys.path if p.endswith("pythonpath")],
        "env": {k: os.environ.get(k) for k in ("SGLANG_USE_CPU_ENGINE", "HS_TRACER_TESTBED_RUNTIME")},
        "meta_path": [type(f).__name__ for f in sys.meta_path],
    }))
"""


def test_importing_hs_tracer_installs_nothing_of_the_runtime() -> None:
    result = _run_python(PRODUCTION_IMPORTS)
    assert result["sgl_kernel"] is False
    assert result["ops"] is False
    assert result["sys_path"] == []
    assert result["env"] == {"SGLANG_USE_CPU_ENGINE": None, "HS_TRACER_TESTBED_RUNTIME": None}
    assert "PostImportHook" not in result["meta_path"]


PATCHED_SGLANG = """
    import json
    from hs_tracer_testbed.runtime.launcher import prepare_process
    prepare_process()
    import sgl_kernel
    import torch
    from sglang.srt.models.deepseek_common.attention_backend_handler import AttentionBackendRegistry
    from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import AttnForwardMethod
    from sglang.srt.runtime_context import get_platform
    from sglang.srt.utils.common import cpu_has_amx_support, is_cpu
    from sglang.srt.distributed.parallel_state import GroupCoordinator
    try:
        sgl_kernel.fused_experts_cpu(torch.zeros(1))
        error = None
    except NotImplementedError as exc:
        error = str(exc)
    print("RESULT " + json.dumps({
        "is_cpu": is_cpu(),
        "handlers": {b: AttentionBackendRegistry.get_handler(b)(None, None) == AttnForwardMethod.MLA
                     for b in ("intel_amx", "torch_native")},
        "has_amx": get_platform().has_amx,
        "cpu_has_amx_support": cpu_has_amx_support(),
        "stand_in": getattr(sgl_kernel, "HS_TRACER_TESTBED_STAND_IN", False),
        "decode_op": sgl_kernel.decode_attention_cpu is torch.ops.sgl_kernel.decode_attention_cpu,
        "error": error,
        "groups_wrapped": hasattr(GroupCoordinator.__init__, "__wrapped__"),
    }))
"""


def test_runtime_patches_act_on_real_sglang_and_keep_layers_native() -> None:
    result = _run_python(PATCHED_SGLANG)
    assert result["is_cpu"] is True
    assert result["handlers"] == {"intel_amx": True, "torch_native": True}
    assert result["has_amx"] is True, "SGLang must keep the intel_amx attention backend"
    assert result["cpu_has_amx_support"] is False, "ordinary layers must stay on forward_native"
    assert result["stand_in"] is True and result["decode_op"] is True
    assert result["error"] is not None and "sgl_kernel.fused_experts_cpu" in result["error"]
    assert result["groups_wrapped"] is True  # process groups built without pynccl on the CPU


RELEASE_PATCHES = """
    import importlib, json
    from hs_tracer_testbed.runtime import patches
    from hs_tracer_testbed.runtime.launcher import prepare_process
    prepare_process()
    _env, found = patches.release_patches()
    for name in found:
        importlib.import_module(name)
    print("RESULT " + json.dumps({"patched": sorted(found), "pending": sorted(patches._hook.pending)}))
"""


def test_the_installed_releases_testbed_patches_take_on_its_modules() -> None:
    """Each module the testbed's patches for the installed release name exists in it and takes its
    patch (a renamed module or attribute fails here, not in an engine start; make test runs this
    on every release)."""
    result = _run_python(RELEASE_PATCHES)
    assert set(result["pending"]) & set(result["patched"]) == set()


@pytest.mark.engine
def test_plain_engine_matches_transformers_greedy(engines, testbed) -> None:
    from hs_tracer_testbed.accept import greedy_tokens
    from hs_tracer_testbed.target import load_target

    run = engines["plain"]  # the suite's shared plain engine (tests/engine_runs.py)
    ids = run.workloads["transformers"]["prompts"]
    hf_target = load_target(testbed.target)
    assert run.output_ids("transformers") == [greedy_tokens(hf_target, p, 12) for p in ids]


def test_a_multi_rank_engine_gets_one_core_binding_per_rank() -> None:
    """SGLang refuses more CPU ranks than NUMA nodes unless each rank's cores are listed; attention DP
    runs inside the TP ranks, so it adds no process."""
    from hs_tracer_testbed.runtime.launcher import rank_env

    assert rank_env({}) == {}
    dp_attention = {"tp_size": 2, "dp_size": 2, "enable_dp_attention": True}
    for overrides, ranks in (({"tp_size": 2}, 2), (dp_attention, 2), ({"tp_size": 2, "dp_size": 2}, 4)):
        env = rank_env(overrides)
        assert len(env["SGLANG_CPU_OMP_THREADS_BIND"].split("|")) == ranks
        assert env["OMP_NUM_THREADS"] == "1"

"""The vLLM engines of the test session: each real vLLM CPU engine starts once, on first use, and
serves every workload the tests read from it (an engine start costs about a minute on a 2-core
machine).

* ``plain``: EAGLE-3 with the pair's draft, untraced (greedy reference tokens: the same shapes of
  verify forwards, so the same bf16 rounding, as the traced engines);
* ``configured``: EAGLE-3 with the pair's draft, traced, with the training profile;
* ``ids_missing``: the same draft without its layer ids (vLLM falls back to its default), traced;
* ``late_deep``: ``configured`` with the target's capture loop patched to capture every slot but
  the first one layer late, its record unchanged (``hs_tracer_testbed.runtime.miscapture``);
  without vLLM's compile cache (the patch is not in its key: ``configured``'s graph would load),
  so compiled through vLLM's other path (Dynamo's bytecode hook, no ahead-of-time artifact);
* ``tp2``: ``configured`` with ``tensor_parallel_size=2`` (a worker process per rank), traced, and
  ``tp2:plain``, the target alone at TP 2 (its greedy reference);
* ``faults``: EAGLE-3 traced, serving one workload per hook with a fault injected in that hook.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

from hs_tracer.integrations.vllm import versions

# every target forward measures the slots' layer identity (a few rows; the default samples 1 in 32)
TRACED_ENV = {"HS_TRACER": "1", "HS_TRACER_WINDOW_TOKENS": "128", "HS_TRACER_IDENTITY_EVERY": "1"}
NUM_PROMPTS = 16
MAX_NEW_TOKENS = 24
STARTUP_HOOK = "GPUModelRunner._setup_eagle3_aux_hidden_state_outputs"
# every hook the pair's engine runs (its draft is vLLM's Llama EAGLE-3 class)
HOOK_NAMES = sorted({h.name for f in versions.FAMILIES for h in f.hooks
                     if not h.name.startswith(("Eagle3Qwen3", "Eagle3DeepseekV2"))})


def prompts() -> list[list[int]]:
    from hs_tracer_testbed.corpus import prompts as corpus_prompts
    from hs_tracer_testbed.target import encode

    return encode(corpus_prompts(seed=77, n=NUM_PROMPTS), add_eos=False)


def workload(name: str) -> dict[str, Any]:
    return {"name": name, "prompts": prompts(), "max_new_tokens": MAX_NEW_TOKENS}


class Engines:
    def __init__(self, pair: Any, profile: Path, tmp: Path) -> None:
        self.pair, self.profile, self.tmp = pair, profile, tmp
        self._runs: dict[str, dict[str, Any]] = {}

    def spec(self, name: str) -> dict[str, Any]:
        from hs_tracer_testbed.llama_pair import write_ids_missing

        base = {"target": str(self.pair.target), "workloads": [workload("main")], "enforce_eager": False}
        eager = {**base, "enforce_eager": True}
        traced = {**TRACED_ENV, "HS_TRACER_PROFILE": str(self.profile)}
        if name == "plain":
            return {**base, "draft": str(self.pair.draft)}
        if name == "configured":
            return {**base, "draft": str(self.pair.draft), "env": traced}
        if name == "late_deep":
            return {**base, "draft": str(self.pair.draft),
                    "env": {**traced, "HS_TRACER_TESTBED_MISCAPTURE": "late_deep",
                            "VLLM_DISABLE_COMPILE_CACHE": "1"}}
        if name == "tp2":  # two worker processes (vLLM's multi-process executor), tracing in each
            return {**eager, "draft": str(self.pair.draft), "env": traced, "tensor_parallel_size": 2}
        if name == "tp2:plain":  # its reference: TP 2 sums in another order than TP 1 (bf16 near-ties)
            return {**eager, "tensor_parallel_size": 2}
        if name == "ids_missing":  # eager: the sampler's eager path on a real engine
            draft = write_ids_missing(self.pair.draft, self.tmp / "ids_missing")
            return {**eager, "draft": str(draft), "env": traced}
        if name == "faults":  # the startup hook's fault from the start, then each per-step hook's
            return {"target": str(self.pair.target), "draft": str(self.pair.draft), "enforce_eager": False,
                    "env": {**traced, "HS_TRACER_FAULT_INJECT": STARTUP_HOOK},
                    "faults": [STARTUP_HOOK, *(h for h in HOOK_NAMES if h != STARTUP_HOOK)],
                    "fault_workload": workload("fault")}
        raise KeyError(name)

    def __getitem__(self, name: str) -> dict[str, Any]:
        from hs_tracer_testbed.vllm_runs import run

        if name not in self._runs:
            self._runs[name] = run(self.spec(name))
        return self._runs[name]


def serve_traced(target: Path, draft: Path, profile: Path, prompts: list[list[int]],
                 max_new_tokens: int = 24) -> dict[str, Any]:
    """One vLLM engine serving ``prompts`` with ``draft`` as the target's EAGLE-3 draft, traced with
    ``profile`` (a trained draft from outside the pair: the trainers' tests)."""
    from hs_tracer_testbed.vllm_runs import run

    return run({"target": str(target), "draft": str(draft),
                "workloads": [{"name": "main", "prompts": prompts, "max_new_tokens": max_new_tokens}],
                "env": {**TRACED_ENV, "HS_TRACER_PROFILE": str(profile)}})


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    """``hs-tracer ARGS`` in this venv."""
    return subprocess.run([sys.executable, "-m", "hs_tracer.cli", *args], capture_output=True, text=True,
                          timeout=600)


def diagnosis(run: dict[str, Any]) -> dict[str, Any]:
    """The emitting process's diagnosis in an engine run's reports."""
    for rep in run.get("reports", []):
        if rep.get("emitting") and rep.get("diagnosis"):
            return rep["diagnosis"]
    raise AssertionError(f"no report with a diagnosis: {run.get('reports')}\n{run.get('log', '')[-3000:]}")

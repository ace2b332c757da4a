"""Real vLLM engines on CPU with the vLLM testbed pair: one engine per call, in a fresh interpreter.

``run(spec)`` starts ``python -m hs_tracer_testbed.vllm_runs`` with the spec as JSON: that process
builds vLLM's offline ``LLM`` (EAGLE-3 when the spec names a draft), serves each workload with greedy
decoding, reads vLLM's own spec-decode counters after each, and reads the report the plugin wrote
(``HS_TRACER_REPORT_DIR``). A fresh interpreter per engine because vLLM fixes its platform, its
plugins and its process layout at first import, and a finished engine gives all its memory back.

The engine core runs in that process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) with its worker
(``distributed_executor_backend="uni"``), so the runner can wait until hs_tracer's recorder has
handed every logged step on before it reads the report. A spec with ``tensor_parallel_size`` 2 runs
vLLM's multi-process executor instead: one worker process per rank, over gloo on the CPU; the
accept lengths of a workload's last step reach the emitting worker with the next step the core
schedules, so the runner serves one one-token request (no verify step, so vLLM's counters stay)
before it reads the reports. ``"enforce_eager": false`` serves with vLLM's default compilation
(Dynamo and Inductor on the CPU: tens of seconds more per start).
``faults`` (the spec's list of hook names) serves the fault workload once per name, with
``HS_TRACER_FAULT_INJECT`` set to it in the tracer's configuration (a startup hook's name is set in
the environment, so the fault hits at startup): the hook raises, the tracer
switches off, and the tokens served must not change. Before the next name the tracer is switched back
on (test machinery: a real deployment has one fault at most per process life).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

# vLLM's CPU backend reserves this much KV cache (GiB) per engine: small, the machine is shared.
CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
           "TOKENIZERS_PARALLELISM": "false"}
START_LOG = "TESTBED_ENGINE_START_LOG"


def run(spec: dict[str, Any], timeout_s: float = 600) -> dict[str, Any]:
    """Serve ``spec`` on a fresh vLLM engine (module docstring) and return what it produced."""
    with tempfile.TemporaryDirectory(prefix="hs-tracer-vllm-") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec))
        env = {**os.environ, **CPU_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", **spec.get("env", {})}
        report = spec.get("env", {}).get("HS_TRACER_REPORT_DIR")
        if report is None and any(k.startswith("HS_TRACER") for k in spec.get("env", {})):
            env["HS_TRACER_REPORT_DIR"] = str(Path(tmp) / "report")
        proc = subprocess.run([sys.executable, "-m", "hs_tracer_testbed.vllm_runs", str(spec_path),
                               str(out_path)], env=env, timeout=timeout_s, capture_output=True, text=True)
        if proc.returncode != 0 or not out_path.exists():
            tail = (proc.stdout + proc.stderr)[-6000:]
            raise RuntimeError(f"the vLLM engine run failed (exit {proc.returncode}):\n{tail}")
        out = json.loads(out_path.read_text())
        log = proc.stdout + proc.stderr  # its start (what vLLM set up) and its end
        out["log"] = log if len(log) <= 40000 else f"{log[:20000]}\n[...]\n{log[-20000:]}"
        return out


def _serve() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    from vllm import LLM, SamplingParams

    from hs_tracer_testbed.runtime import miscapture

    miscapture.patch_vllm()  # HS_TRACER_TESTBED_MISCAPTURE: the engine in this process (one rank)
    _count_start()
    tp = int(spec.get("tensor_parallel_size", 1))
    kwargs: dict[str, Any] = {
        "model": spec["target"], "tokenizer": spec["target"], "dtype": "bfloat16", "seed": 0,
        "max_model_len": 256, "max_num_seqs": 32, "enforce_eager": spec.get("enforce_eager", True),
        "disable_log_stats": False, "tensor_parallel_size": tp,
        # one rank: the worker in the engine core's process, where the step's draft input (worker)
        # and its accept lengths (scheduler) meet in one tracer; more ranks need vLLM's
        # multi-process executor, one worker process per rank (docs/vllm.md)
        "distributed_executor_backend": "uni" if tp == 1 else "mp",
    }
    if spec.get("draft"):
        kwargs["speculative_config"] = {"method": "eagle3", "model": spec["draft"],
                                        "num_speculative_tokens": int(spec.get("num_speculative_tokens", 3))}
    llm = LLM(**kwargs)
    out: dict[str, Any] = {"workloads": {}, "faults": {}}
    report_dir = os.environ.get("HS_TRACER_REPORT_DIR")

    def serve(w: dict[str, Any]) -> dict[str, Any]:
        params = SamplingParams(temperature=0.0, max_tokens=int(w["max_new_tokens"]), ignore_eos=True)
        before = _spec_counters(llm)
        results = llm.generate([{"prompt_token_ids": list(p)} for p in w["prompts"]], params, use_tqdm=False)
        after = _spec_counters(llm)
        return {"output_ids": [list(r.outputs[0].token_ids) for r in results],
                "spec": {k: _minus(after[k], before.get(k)) for k in after}}

    for w in spec.get("workloads", []):
        out["workloads"][w["name"]] = serve(w)
    if report_dir:
        from hs_tracer_testbed.demo import settled_reports

        if tp > 1:  # a step that carries the last step's accept lengths to the workers (docstring)
            llm.generate([{"prompt_token_ids": [1, 2]}], SamplingParams(temperature=0.0, max_tokens=1),
                         use_tqdm=False)
        out["reports"] = settled_reports(Path(report_dir), _spec_counters(llm).get("num_drafts"))
    initial = os.environ.get("HS_TRACER_FAULT_INJECT")  # a startup hook's fault: injected from the start
    for name in spec.get("faults", []):
        st = _current() if name == initial else _inject(name)
        result = serve(spec["fault_workload"])
        result["tracer"] = {"enabled": st.enabled, "hook_errors": st.hook_errors,
                            "disabled_reason": st.disabled_reason}
        out["faults"][name] = result
    Path(sys.argv[2]).write_text(json.dumps(out))


def _current() -> Any:
    from hs_tracer.integrations.vllm import state

    st = state.current()
    if st is None:
        raise RuntimeError("no hs_tracer state in this process: the plugin did not register")
    return st


def _inject(name: str) -> Any:
    """Switch the in-process tracer back on with a fault set in ``name`` (module docstring)."""
    st = _current()
    st.config = dataclasses.replace(st.config, fault_inject=name)
    st.enabled, st.disabled_reason = True, None
    return st


def _spec_counters(llm: Any) -> dict[str, Any]:
    """vLLM's own spec-decode counters (Prometheus metrics of the engine), by name without prefix."""
    out: dict[str, Any] = {}
    for m in llm.get_metrics():
        if not m.name.startswith("vllm:spec_decode_"):
            continue
        key = m.name.removeprefix("vllm:spec_decode_")
        out[key] = list(m.values) if hasattr(m, "values") else m.value
    return out


def _minus(after: Any, before: Any) -> Any:
    if before is None:
        return after
    if isinstance(after, list):
        return [a - b for a, b in zip(after, before, strict=False)]
    return after - before


def _count_start() -> None:
    """One line per engine start in ``$TESTBED_ENGINE_START_LOG`` (the test session counts them)."""
    log = os.environ.get(START_LOG)
    if log:
        with contextlib.suppress(OSError), open(log, "a") as f:
            f.write(os.environ.get("PYTEST_CURRENT_TEST", "") + "\n")


if __name__ == "__main__":
    _serve()

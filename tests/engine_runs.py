"""Run several real CPU engines in one fresh interpreter and print their results as JSON.

Engine tests call :func:`run_scenarios` from pytest; it starts this module as a subprocess because
the CPU runtime must be prepared before SGLang is first imported (the pytest process imports
SGLang's GPU-path modules in other tests). One subprocess for many engines saves the parent's
import time; each engine still starts its own scheduler process, as SGLang always does.

A scenario is a dict: ``name``, ``draft`` (dir, or null for plain decoding), ``traced`` (default
true: ``HS_TRACER=1``), ``env`` (extra settings), ``profile`` (optional path), ``linger_s`` (keep the
engine up that long after the workload, e.g. for a Prometheus scrape).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

MARK = "ENGINE-RUNS "


def run_scenarios(target: Path, scenarios: list[dict[str, Any]], prompts: list[str],
                  max_new_tokens: int, timeout_s: int = 1800) -> dict[str, dict[str, Any]]:
    spec = {"target": str(target), "scenarios": scenarios, "prompts": prompts,
            "max_new_tokens": max_new_tokens}
    env = {k: v for k, v in os.environ.items() if not k.startswith("HS_TRACER")}
    proc = subprocess.run([sys.executable, "-m", "tests.engine_runs"], input=json.dumps(spec), env=env,
                          capture_output=True, text=True, timeout=timeout_s,
                          cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stderr[-6000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith(MARK))
    return json.loads(line[len(MARK):])


def _main() -> None:
    from hs_tracer_testbed.demo import run_engine

    spec = json.loads(sys.stdin.read())
    results: dict[str, dict[str, Any]] = {}
    for sc in spec["scenarios"]:
        draft = Path(sc["draft"]) if sc.get("draft") else None
        profile = Path(sc["profile"]) if sc.get("profile") else None
        run = run_engine(sc["name"], Path(spec["target"]), draft, spec["prompts"], profile=profile,
                         max_new_tokens=spec["max_new_tokens"], extra_env=sc.get("env"),
                         traced=sc.get("traced", True), linger_s=sc.get("linger_s", 0.0))
        results[sc["name"]] = {"outputs": run.outputs, "output_ids": run.output_ids,
                               "schedulers": run.schedulers, "diagnosis": run.to_json()}
    print(MARK + json.dumps(results))


if __name__ == "__main__":
    _main()

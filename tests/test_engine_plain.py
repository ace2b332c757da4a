"""A real sgl.Engine on CPU (tiny DeepSeek-V3, plain decoding) with the hs_tracer plugin inside.

The engine runs in a fresh interpreter: the CPU runtime must be prepared before SGLang is imported,
and other tests in this process import SGLang's GPU-path modules.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = """
    import json, os, sys
    from pathlib import Path
    from hs_tracer_testbed.demo import read_reports
    from hs_tracer_testbed.corpus import prompts
    from hs_tracer_testbed.runtime.launcher import engine

    report_dir = Path(sys.argv[1])
    target = Path(sys.argv[2])
    texts = prompts(seed=7, n=6)
    sampling = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}
    with engine(target, env={"HS_TRACER": "1", "HS_TRACER_REPORT_DIR": str(report_dir)}) as eng:
        first = [o["output_ids"] for o in eng.generate(texts, sampling)]
        second = [o["output_ids"] for o in eng.generate(texts, sampling)]
    print("RESULT " + json.dumps({"first": first, "second": second, "pid": os.getpid(),
                                  "reports": read_reports(report_dir)}))
"""


@pytest.mark.engine
def test_plain_engine_is_deterministic_and_plugin_runs_in_scheduler(tmp_path: Path, testbed) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HS_TRACER")}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(SCRIPT), str(tmp_path), str(testbed.target)],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    result = json.loads(line[len("RESULT "):])

    assert result["first"] == result["second"]
    assert all(len(ids) == 12 for ids in result["first"])

    (report,) = result["reports"]  # tp=1: exactly one scheduler process
    assert report["pid"] != result["pid"], "the report must come from the scheduler subprocess"
    assert report["enabled"] and report["hook_errors"] == 0
    assert report["hooks_applied"], "hooks must be applied through SGLang's HookRegistry"
    target = report["target"]
    config = json.loads((testbed.target / "config.json").read_text())
    assert target["architecture"] == "DeepseekV3ForCausalLM"
    assert target["num_layers"] == config["num_hidden_layers"]
    assert target["hidden_size"] == config["hidden_size"]

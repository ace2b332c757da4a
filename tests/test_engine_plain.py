"""A real sgl.Engine on CPU (tiny DeepSeek-V3, plain decoding) with the hs_tracer plugin inside: the
suite's shared ``plain`` engine (tests/engine_runs.py), which also serves the lossless oracle's
baseline and the comparison with Hugging Face transformers (test_engine_cpu.py)."""

from __future__ import annotations

import json

import pytest


@pytest.mark.engine
def test_plain_engine_is_deterministic_and_plugin_runs_in_scheduler(engines, testbed) -> None:
    run = engines["plain"]
    first, second = run.output_ids("transformers"), run.output_ids("transformers#2")
    assert first == second  # the second batch is served from the radix cache
    assert all(len(ids) == 12 for ids in first)
    assert all(m["cached_tokens"] > 0 for m in run.meta("transformers#2"))

    report = run.report  # tp=1: exactly one scheduler process
    assert report["pid"] != run.engine_pid, "the report must come from the scheduler subprocess"
    assert report["enabled"] and report["hook_errors"] == 0
    assert report["hooks_applied"], "hooks must be applied through SGLang's HookRegistry"
    target = report["target"]
    config = json.loads((testbed.target / "config.json").read_text())
    assert target["architecture"] == "DeepseekV3ForCausalLM"
    assert target["num_layers"] == config["num_hidden_layers"]
    assert target["hidden_size"] == config["hidden_size"]

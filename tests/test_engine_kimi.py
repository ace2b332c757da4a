"""Kimi-K2.5 end to end: ``hs-tracer demo`` on the testbed pair in Kimi-K2.5's formats.

The target is ``KimiK25ForConditionalGeneration`` (DeepSeek-V3 text model behind the multimodal
wrapper) and the draft ``Eagle3DeepseekV2ForCausalLM`` (Kimi's MLA EAGLE-3 draft, whose fc is a
``ColumnParallelLinear``). The demo command itself, run through the engine harness's
``run_tool``, runs the real CPU engine twice: the draft as configured (ok,
every slot on its trained source) and a copy with its layer ids shifted (miswired, slot 0 fed the
embedding).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.engine_runs import run_tool

pytestmark = [pytest.mark.engine, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def demo(testbed, testbed_profile) -> list[dict[str, Any]]:
    proc = run_tool(["-m", "hs_tracer.cli", "demo", "--target", str(testbed.kimi_target),
                     "--draft", str(testbed.kimi_draft), "--profile", str(testbed_profile),
                     "--scenario", "ids_shifted", "--prompts", "8", "--max-new-tokens", "24", "--json"])
    return json.loads(proc.stdout)


def trained_sources(testbed) -> list[str]:
    return json.loads(Path(testbed.manifest).read_text())["layers"]["aux_sources"]


def test_kimi_as_configured_is_ok(demo, testbed) -> None:
    run = demo[0]
    assert run["status"] == "ok", run["findings"]
    assert run["wiring"]["target_arch"] == "KimiK25ForConditionalGeneration"
    assert run["wiring"]["draft_fc_in_features"] == 3 * run["wiring"]["hidden_size"]
    trained = trained_sources(testbed)
    assert [s["observed_source"] for s in run["slots"]] == trained
    assert [s["expected_source"] for s in run["slots"]] == trained
    assert run["acceptance"]["mean_accept_length"] > 1.3


def test_kimi_miswired_copy_names_the_slots(demo, testbed) -> None:
    run = demo[1]
    assert run["status"] == "miswired"
    trained = trained_sources(testbed)
    slots = {s["index"]: s for s in run["slots"]}
    assert slots[0]["observed_source"] == "embedding"
    assert [s["observed_source"] for s in run["slots"]] == run["wiring"]["sources"]
    mismatches = {(f["slot"], f["expected"], f["observed"]) for f in run["findings"]
                  if f["code"] == "slot_source_mismatch"}
    assert (0, trained[0], "embedding") in mismatches

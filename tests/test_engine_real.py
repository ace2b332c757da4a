"""The real-model pair through real SGLang 0.5.23 on CPU: SmolLM2-135M-Instruct (``LlamaForCausalLM``,
30 layers) with its EAGLE-3 draft (``LlamaForCausalLMEagle3``) trained here, traced with
``HS_TRACER=1`` on held-out real text.

SGLang's most common production pairing (Llama and Qwen targets use the same layer-id rule): greedy
EAGLE-3 commits exactly the tokens of plain decoding, hs_tracer's accept length is SGLang's own, the
capture metadata of the Llama model body is recorded, and the draft as trained is fed the blocks it
was trained on. A miswired copy (every config id one lower: on a Llama target every slot one layer
early) is fed exactly those layers, in the live report and in SGLang's own capture list.
"""

from __future__ import annotations

import json

import pytest

from hs_tracer import sources
from tests.engine_runs import COUNTERS, EngineSpec

pytestmark = [pytest.mark.engine, pytest.mark.timeout(3600)]

PLAIN = EngineSpec(None, ("real",), profile=False)
CORRECT = EngineSpec("testbed", ("real",))
IDS_SHIFTED = EngineSpec("ids_shifted", ("real",))


def test_greedy_eagle3_on_the_real_pair_is_lossless_and_traced(real_engines, real_pair) -> None:
    plain, spec = real_engines.run("real:plain", PLAIN), real_engines.run("real:correct", CORRECT)
    assert spec.output_ids("real") == plain.output_ids("real")  # greedy EAGLE-3 is lossless
    report = spec.report
    assert report["enabled"], report["disabled_reason"]
    assert report["target"]["architecture"] == "LlamaForCausalLM"
    assert "sglang.srt.models.llama.LlamaModel.forward" in report["hooks_applied"]
    plan = real_pair.load_manifest()["layers"]
    # SGLang's Llama rule (+1 to every id) captures the inputs of layers 2, 15, 27 = blocks 1, 14, 26
    assert report["target"]["layers_to_capture"] == plan["sglang_layers_to_capture"] == [2, 15, 27]
    assert report["capture"]["layers_in_order"] == [2, 15, 27]  # the Llama body's own loop
    assert report["capture"]["aux_widths"] == [3 * 576]
    assert report["wiring"]["sources"] == plan["aux_sources"] == ["block:1", "block:14", "block:26"]


def test_hs_tracers_accept_length_is_sglangs(real_engines) -> None:
    spec = real_engines.run("real:correct", CORRECT)
    meta = spec.meta("real")
    steps = sum(m["spec_verify_ct"] for m in meta)
    sglang_mean = 1 + sum(m[COUNTERS.accepted_drafts] for m in meta) / steps
    acceptance = spec.diagnosis_after("real")["acceptance"]
    assert acceptance["steps"] == steps
    assert acceptance["mean_accept_length"] == pytest.approx(sglang_mean, abs=1e-9)
    assert sglang_mean > 1.2  # the trained draft is accepted on text it never saw


def test_a_shifted_config_feeds_the_layers_sglangs_llama_rule_says(real_engines, real_pair) -> None:
    run = real_engines.run("real:ids_shifted", IDS_SHIFTED)
    report = run.report
    ids = report["wiring"]["configured_layer_ids"]
    assert ids == [0, 13, 25]
    want = sources.sglang_sources(ids, sources.Family.LLAMA, 30)
    assert report["target"]["layers_to_capture"] == want.layers_to_capture == [1, 14, 26]
    assert report["capture"]["layers_in_order"] == [1, 14, 26]
    assert report["wiring"]["sources"] == want.sources == ["block:0", "block:13", "block:25"]
    # the draft was fed other layers than it was trained on: never "ok"
    assert run.diagnosis_after("real")["status"] != "ok"
    trained = json.loads((real_pair.specforge_data / "hs_tracer_data.json").read_text())["sources"]
    assert trained != want.sources

"""The real-model pair through real SGLang 0.5.23 on CPU: SmolLM2-135M-Instruct (``LlamaForCausalLM``,
30 layers) with its EAGLE-3 draft (``LlamaForCausalLMEagle3``) trained here, traced with
``HS_TRACER=1`` on held-out real text.

SGLang's most common production pairing (Llama and Qwen targets use the same layer-id rule): greedy
EAGLE-3 commits exactly the tokens of plain decoding, hs_tracer's accept length is SGLang's own, the
capture metadata of the Llama model body is recorded, and the draft as trained is fed the blocks it
was trained on. A miswired copy (every config id one lower: on a Llama target every slot one layer
early) is fed exactly those layers, in the live report and in SGLang's own capture list. Both traced
engines also capture, and ``hs-tracer diagnose`` on each capture says what the live report says.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hs_tracer import sources
from hs_tracer.diagnosis.report import Report
from tests.engine_runs import REPO, EngineResult, EngineSpec, child_env

pytestmark = [pytest.mark.engine, pytest.mark.timeout(3600)]

PLAIN = EngineSpec(None, ("real",), profile=False)
CORRECT = EngineSpec("testbed", ("real",), capture=True)
IDS_SHIFTED = EngineSpec("ids_shifted", ("real",), capture=True)


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
    sglang_mean = 1 + sum(m["spec_num_correct_drafts"] for m in meta) / steps
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


def _diagnose_capture(run: EngineResult, profile: Path) -> tuple[int, dict[str, Any]]:
    """``hs-tracer diagnose`` on what the engine captured, as a user runs it: its own process."""
    proc = subprocess.run([sys.executable, "-m", "hs_tracer.cli", "diagnose", str(run.work / "capture"),
                           "--profile", str(profile), "--json"], env=child_env(), cwd=REPO,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    return proc.returncode, json.loads(proc.stdout)


def _named(slot: dict[str, Any]) -> list[str]:
    """The sources a slot verdict names: the observed one, or the candidates it cannot tell apart."""
    return slot.get("candidates") or [slot["observed_source"]]


def _critical(report: dict[str, Any]) -> dict[int, set[str | None]]:
    """Per slot, the sources its critical findings say it is fed (live: the startup check of the
    engine's layers_to_capture and the window; offline: the capture's record and its rows)."""
    out: dict[int, set[str | None]] = {}
    for f in report["findings"]:
        if f["severity"] == "critical" and f.get("slot") is not None:
            out.setdefault(f["slot"], set()).add(f.get("observed"))
    return out


def _same_slots(live: dict[str, Any], offline: dict[str, Any], fed: list[str]) -> None:
    """Per slot: the same trained source, the true one ``fed`` among what each names, and the same
    source where both name one."""
    for true, on, off in zip(fed, live["slots"], offline["slots"], strict=True):
        assert on["expected_source"] == off["expected_source"]
        assert true in _named(on) and true in _named(off), (on, off)
        if len(_named(on)) == len(_named(off)) == 1:
            assert on["observed_source"] == off["observed_source"] == true


def test_diagnose_on_the_capture_agrees_with_the_live_report(real_engines) -> None:
    shifted = real_engines.run("real:ids_shifted", IDS_SHIFTED)
    live = shifted.diagnosis
    code, offline = _diagnose_capture(shifted, real_engines.profile)
    fed = sources.sglang_sources(shifted.report["wiring"]["configured_layer_ids"], sources.Family.LLAMA,
                                 30).sources
    assert code == Report.from_json(live).exit_code == 1
    assert offline["status"] == live["status"] == "miswired"
    on, off = _critical(live), _critical(offline)
    assert sorted(on) == sorted(off) == [0, 1, 2]  # every slot one layer early
    assert all(true in on[k] and true in off[k] for k, true in enumerate(fed))
    assert all(s["expected_source"] != true for s, true in zip(offline["slots"], fed, strict=True))
    _same_slots(live, offline, fed)

    correct = real_engines.run("real:correct", CORRECT)
    live = correct.diagnosis
    code, offline = _diagnose_capture(correct, real_engines.profile)
    assert code == Report.from_json(live).exit_code == 0
    assert offline["status"] == live["status"] == "ok"
    assert not _critical(offline)
    _same_slots(live, offline, correct.report["wiring"]["sources"])

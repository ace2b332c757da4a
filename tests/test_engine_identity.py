"""Same-token layer identity inside real SGLang 0.5.23 on CPU, on the real pair (SmolLM2-135M-Instruct,
``LlamaForCausalLM``, 30 layers, and its EAGLE-3 draft; configured capture: the inputs of layers
2, 15, 27 = ``block:1``, ``block:14``, ``block:26``).

The target's capture loop is patched the ways engines get it wrong while its ``layers_to_capture``
(the engine's record) stays as configured (``hs_tracer_testbed.runtime.miscapture``): every slot
captured after its layer (one layer late), only the deep slots late, the embedding in the first
slot. On every prefill forward (``HS_TRACER_IDENTITY_EVERY=1``) hs_tracer compares the rows the
draft is fed with every candidate source's rows of the same tokens: the live report must name each
slot as really fed, and say that the engine's record is wrong. The correct wiring is ``ok``, its
measurement the record's.
"""

from __future__ import annotations

import pytest

from hs_tracer.diagnosis.report import Report
from tests.engine_runs import EngineSpec
from tests.test_engine_real import CORRECT

pytestmark = [pytest.mark.engine, pytest.mark.timeout(3600)]

RECORDED = ["block:1", "block:14", "block:26"]
FED = {
    "late": ["block:2", "block:15", "block:27"],
    "late_deep": ["block:1", "block:15", "block:27"],
    "embedding_first": ["embedding", "block:14", "block:26"],
}


def _spec(mode: str) -> EngineSpec:
    return EngineSpec("testbed", ("real",), env=(("HS_TRACER_IDENTITY_EVERY", "1"),
                                                  ("HS_TRACER_TESTBED_MISCAPTURE", mode)))


def _measured(diagnosis: dict) -> list[str | None]:
    slots = diagnosis["measured_identity"]["slots"]
    return [s["sources"][0] if len(s["sources"]) == 1 else None for s in slots]


def test_the_correct_wiring_is_measured_as_recorded_and_ok(real_engines) -> None:
    run = real_engines.run("real:correct", CORRECT)
    report = run.report
    assert report["identity"]["sampled"] >= 1 and report["identity"]["failed"] is None
    diagnosis = run.diagnosis_after("real")
    assert diagnosis["measured_identity"]["samples"] >= 1
    assert _measured(diagnosis) == RECORDED == report["wiring"]["sources"]
    for slot in diagnosis["measured_identity"]["slots"]:
        assert slot["error"] <= 1e-3 < slot["runner_up_error"]  # equal to one source, far from the next
    assert diagnosis["status"] == "ok" and Report.from_json(diagnosis).exit_code == 0
    assert not [f for f in diagnosis["findings"] if f["code"] == "capture_record_mismatch"]


@pytest.mark.parametrize("mode", list(FED))
def test_a_capture_loop_that_feeds_other_layers_is_named_by_measurement(real_engines, mode: str) -> None:
    run = real_engines.run(f"real:miscapture_{mode}", _spec(mode))
    report = run.report
    assert report["enabled"], report["disabled_reason"]
    # the engine's own record still says the configured layers
    assert report["target"]["layers_to_capture"] == [2, 15, 27]
    assert report["wiring"]["sources"] == RECORDED
    diagnosis = run.diagnosis_after("real")
    assert _measured(diagnosis) == FED[mode]
    assert diagnosis["status"] == "miswired" and Report.from_json(diagnosis).exit_code == 1
    wrong = {i for i, (fed, rec) in enumerate(zip(FED[mode], RECORDED, strict=True)) if fed != rec}
    mismatches = [f for f in diagnosis["findings"] if f["code"] == "capture_record_mismatch"]
    assert {f["slot"] for f in mismatches} == wrong
    assert all(f["severity"] == "critical" for f in mismatches)
    for f in mismatches:
        assert f["observed"] == FED[mode][f["slot"]] and f["expected"] == RECORDED[f["slot"]]
    # the slot table names each slot as fed
    assert [s["observed_source"] for s in diagnosis["slots"]] == FED[mode]


# The loop captures the configured layers but appends another value (hs_tracer_testbed.runtime.miscapture's
# channel modes): the residual left out, the captured layer's input norm applied, the last two slots in
# each other's place. Each engine also captures its requests, for diagnose --target.
CHANNEL = {"residual_left_out": None, "input_norm": None, "swap": ["block:1", "block:26", "block:14"]}


def _channel_spec(mode: str) -> EngineSpec:
    return EngineSpec("testbed", ("real",), capture=True,
                      env=(("HS_TRACER_IDENTITY_EVERY", "1"), ("HS_TRACER_TESTBED_MISCAPTURE", mode)))


def _diagnose_target(run, real_engines, real_pair) -> tuple[int, dict]:
    import contextlib
    import io
    import json

    from hs_tracer.cli import main as cli

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = cli(["diagnose", str(run.work / "capture"), "--profile", str(real_engines.profile), "--json",
                    "--target", str(real_pair.target), "--sequences", "2", "--tokens", "160",
                    "--no-progress"])
    return code, json.loads(buf.getvalue())


@pytest.mark.parametrize("mode", list(CHANNEL))
def test_a_capture_channel_fault_is_named_as_the_evidence_allows(real_engines, real_pair, mode: str) -> None:
    """Live (measured in the engine) and offline (diagnose --target on the engine's capture): exit 1;
    swapped slots named exactly with the concatenation order as the fix; a value no layer has named as
    none of the layers (never as a layer, not by the statistics either), with the capture channel's
    code as the fix, and offline, where the sublayer output and the norm are recomputed, the transform."""
    run = real_engines.run(f"real:mischannel_{mode}", _channel_spec(mode))
    assert run.report["wiring"]["sources"] == RECORDED  # the engine's record says the configured layers
    live = run.diagnosis_after("real")
    code, offline = _diagnose_target(run, real_engines, real_pair)
    for doc, where in ((live, "live"), (offline, "offline")):
        assert Report.from_json(doc).exit_code == 1 and doc["status"] == "miswired", (where, doc["findings"])
        slots = doc["slots"]
        critical = [f for f in doc["findings"] if f["severity"] == "critical" and f.get("slot") is not None]
        assert all("eagle_aux_hidden_state_layer_ids" not in f["fix"] for f in critical), (where, critical)
        if mode == "swap":
            assert [s["observed_source"] for s in slots] == CHANNEL[mode], (where, slots)
            assert {f["slot"] for f in critical} == {1, 2}
            assert all(f["details"]["cause"] == "capture_order" for f in critical), (where, critical)
            continue
        for s in slots:
            assert s["observed_source"] == "unknown" and s["fed_none"] and "candidates" not in s, (where, s)
        assert {f["slot"] for f in critical} == {0, 1, 2}
        assert all(f["details"]["cause"] == "capture_channel" for f in critical), (where, critical)
    assert code == 1
    if mode != "swap":
        assert [(s["transform"] or {}).get("transform") for s in offline["measured"]["slots"]] == [mode] * 3
        assert [s["transform"]["source"] for s in offline["measured"]["slots"]] == RECORDED


def test_the_correct_wiring_is_ok_offline_with_target_too(real_engines, real_pair) -> None:
    run = real_engines.run("real:correct", CORRECT)
    code, doc = _diagnose_target(run, real_engines, real_pair)
    assert code == 0 and doc["status"] == "ok", doc["findings"]
    assert [s["sources"] for s in doc["measured"]["slots"]] == [[s] for s in RECORDED]

"""Capture from the real engine (CPU testbed, EAGLE-3, the hs_tracer plugin inside) and replay it.

The suite's shared engines (tests/engine_runs.py): the testbed draft as configured (``correct``) and
a copy miswired by its config.json only (``ids_shifted``), both with ``HS_TRACER_CAPTURE_DIR``; and
an engine with tracing on but no capture dir. Then ``hs-tracer replay`` and ``hs-tracer diagnose`` on
what the scheduler wrote; diagnose says what the engine's live report said.
"""

from __future__ import annotations

import json
import stat
from typing import Any

import pytest

from hs_tracer.cli import main as cli

pytestmark = [pytest.mark.engine, pytest.mark.timeout(1800)]

CAPTURED = {"correct": "correct", "miswired": "ids_shifted"}  # the shared engines that capture


@pytest.fixture(scope="module")
def replays(engines, testbed, testbed_profile) -> dict[str, Any]:
    import contextlib
    import io

    out = {}
    for name, engine in CAPTURED.items():
        run = engines[engine]
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            code = cli(["replay", str(run.work / "capture"), "--draft", str(run.work / "draft")
                        if engine != "correct" else str(testbed.draft), "--target",
                        str(testbed.target), "--training-data", str(testbed.specforge_data), "--profile",
                        str(testbed_profile), "--json"])
        out[name] = (code, json.loads(buf.getvalue()))
    return out


def test_live_capture_is_private_and_holds_the_prompts(engines) -> None:
    from hs_tracer.profile.capture_format import read_manifest
    from hs_tracer.replay.data import load_capture
    from hs_tracer_testbed.target import encode

    run = engines["correct"]
    cap = run.work / "capture"
    assert stat.S_IMODE(cap.stat().st_mode) == 0o700
    files = list(cap.iterdir())
    assert any(f.suffix == ".safetensors" for f in files)
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)
    assert sum("captures contain user data" in ln for ln in run.log.splitlines()) == 1

    m = read_manifest(cap)
    assert m.rows == "prefill_draft_extend" and m.sample_rate == 1.0 and m.sglang_version == "0.5.23"
    assert m.sources == m.wiring["sources"] and m.wiring["layers_to_capture"] == m.layers_to_capture
    _manifest, seqs, accept = load_capture(cap)
    prompts = [p for w in run.workloads.values() for p in w["prompts"]]
    encoded = [list(ids) for ids in encode(prompts, add_eos=False)]
    for seq in seqs:  # every captured request is one prompt's tokens (after any cached prefix)
        ids = seq.ids.tolist()
        assert any(p[seq.first_position:] == ids for p in encoded), ids
    assert len(seqs) == len(prompts)
    assert accept.size > 0 and accept.min() >= 1


def test_capture_off_writes_nothing(engines) -> None:
    run = engines["d2t_regenerated"]  # traced, no capture dir; its working directory is run.work
    assert "HS_TRACER_CAPTURE_DIR" not in dict(run.spec.env) and not run.spec.capture
    written = [p for p in run.work.rglob("*") if p.is_file() and (p.suffix == ".safetensors"
                                                                  or p.name == "manifest.json")]
    assert all("draft" in p.relative_to(run.work).parts for p in written), written
    assert not any("captures contain user data" in ln for ln in run.log.splitlines())


def test_replay_correct_wiring_is_at_training_level(replays) -> None:
    code, r = replays["correct"]
    assert (code, r["status"]) == (0, "ok")
    assert r["capture"]["slot_sources"] == r["trained_sources"]
    assert r["capture"]["agreement"] >= r["training_level"]
    assert r["capture"]["agreement"] > 3 * r["baselines"]["most_frequent_token"]
    assert r["fix"] == {}


def test_replay_miswired_falls_short_and_names_the_fix(replays, testbed) -> None:
    code, r = replays["miswired"]
    _c, ok = replays["correct"]
    assert (code, r["status"]) == (1, "miswired")
    served, good = r["capture"]["agreement"], ok["capture"]["agreement"]
    n1, n2 = r["capture"]["tokens"], ok["capture"]["tokens"]
    stderr = (served * (1 - served) / n1 + good * (1 - good) / n2) ** 0.5
    assert served < r["training_level"]
    assert good - served > 2 * stderr, (good, served, stderr)  # measured gap, not a fixed number

    assert r["capture"]["slot_sources"][0] == "embedding"  # ids_shifted puts the embedding in slot 0
    assert r["capture"]["slot_evidence"][0] == "equals embed_tokens(ids)"
    trained_ids = json.loads((testbed.draft / "config.json").read_text())["eagle_config"][
        "eagle_aux_hidden_state_layer_ids"]
    fix = r["fix"]
    assert fix["eagle_aux_hidden_state_layer_ids"] == trained_ids
    assert fix["configured_layer_ids"] == [i - 1 for i in trained_ids]
    assert fix["sources"] == r["trained_sources"] != r["capture"]["slot_sources"]
    best = r["alternatives"][0]
    assert best["name"] != "as served" and best["agreement"] > served


@pytest.fixture(scope="module")
def diagnosed(engines, testbed_profile) -> dict[str, tuple[int, dict[str, Any]]]:
    """``hs-tracer diagnose CAPTURE --profile P --json`` on each shared engine's capture: exit code and
    report."""
    import contextlib
    import io

    out = {}
    for name, engine in CAPTURED.items():
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            code = cli(["diagnose", str(engines[engine].work / "capture"), "--profile", str(testbed_profile),
                        "--json"])
        out[name] = (code, json.loads(buf.getvalue()))
    return out


def test_diagnose_reads_the_live_capture(diagnosed) -> None:
    verdicts = diagnosed
    code, ok = verdicts["correct"]
    assert code == 0 and ok["acceptance"]["steps"] > 0
    code, bad = verdicts["miswired"]
    assert bad["acceptance"]["mean_accept_length"] < ok["acceptance"]["mean_accept_length"]
    assert code == 1 and bad["status"] == "miswired"
    assert bad["slots"][0]["index"] == 0 and bad["slots"][0]["observed_source"] == "embedding"
    assert [s["observed_source"] for s in ok["slots"]] == [s["expected_source"] for s in ok["slots"]]


def _fed_by_critical(report: dict[str, Any]) -> dict[int, set[str]]:
    """Per slot, the sources its critical findings say it is fed (live: the startup check of SGLang's
    layers_to_capture and the window; on the capture: its manifest's record and its rows)."""
    out: dict[int, set[str]] = {}
    for f in report["findings"]:
        if f["severity"] == "critical" and f.get("slot") is not None:
            out.setdefault(f["slot"], set()).add(f.get("observed"))
    return out


@pytest.mark.parametrize("name", sorted(CAPTURED))
def test_diagnose_on_the_capture_agrees_with_the_live_report(engines, diagnosed, name: str) -> None:
    """What the running engine reported and what ``hs-tracer diagnose`` says of its capture: one
    status and exit code; per slot the same source, or, where the capture's statistics alone cannot
    exclude a neighbouring layer, the live (measured) source among the sources the capture names; the
    same slots flagged critical, the live fed source among what the capture's findings name."""
    from hs_tracer.diagnosis.report import Report

    run = engines[CAPTURED[name]]
    live = run.diagnosis
    code, offline = diagnosed[name]
    assert (offline["status"], code) == (live["status"], Report.from_json(live).exit_code)
    assert live["status"] == ("ok" if name == "correct" else "miswired")

    assert len(offline["slots"]) == len(live["slots"])
    for on, off in zip(live["slots"], offline["slots"], strict=True):
        assert (off["index"], off["expected_source"]) == (on["index"], on["expected_source"])
        assert off["observed_source"] == on["observed_source"] or (
            off["observed_source"] == "unknown" and on["observed_source"] in off["candidates"]), (on, off)
    fed = run.report["wiring"]["sources"]  # SGLang's own layers_to_capture, resolved
    assert [s["observed_source"] for s in live["slots"]] == fed
    critical, offline_critical = _fed_by_critical(live), _fed_by_critical(offline)
    assert set(critical) == set(offline_critical)
    for k, sources in critical.items():
        named = offline_critical[k] | set(offline["slots"][k].get("candidates") or ())
        assert sources <= named, (k, sources, named)
    assert critical == {s["index"]: {s["observed_source"]} for s in live["slots"]
                        if s["observed_source"] != s["expected_source"]}


@pytest.fixture(scope="module")
def measured(engines, testbed, testbed_profile) -> dict[str, tuple[int, dict[str, Any]]]:
    """``hs-tracer diagnose CAPTURE --profile P --target T --json`` on each shared engine's capture."""
    import contextlib
    import io

    out = {}
    for name, engine in CAPTURED.items():
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            code = cli(["diagnose", str(engines[engine].work / "capture"), "--profile", str(testbed_profile),
                        "--target", str(testbed.target), "--json", "--no-progress"])
        out[name] = (code, json.loads(buf.getvalue()))
    return out


@pytest.mark.parametrize("name", sorted(CAPTURED))
def test_diagnose_target_measures_what_sglang_fed(engines, measured, name: str) -> None:
    """The target recomputed by transformers in float32 on the captured requests' tokens names each
    slot as SGLang's own layers_to_capture fed it: the engine's bf16 rows sit well inside the
    tolerance of their source and far from every other."""
    run = engines[CAPTURED[name]]
    code, doc = measured[name]
    fed = run.report["wiring"]["sources"]
    m = doc["measured"]
    assert [s["sources"] for s in m["slots"]] == [[s] for s in fed]
    assert all(s["error"] < m["tolerance"] / 2 < s["runner_up_error"] / 2 for s in m["slots"]), m["slots"]
    assert [s["observed_source"] for s in doc["slots"]] == fed
    assert code == (0 if name == "correct" else 1)

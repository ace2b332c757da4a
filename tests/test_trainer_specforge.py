"""SpecForge 0.2.0 itself, run on the CPU on the real SmolLM2-135M target (capture through SGLang
0.5.14's model runner, 3 training steps, its SGLang export; cached by recipe in the testbed cache),
and hs_tracer on what it really wrote.

Cost on a fresh clone: building ``.venv-specforge`` (about 1 minute) and the run (about 4 minutes on
a shared 2-core machine); later runs read the cache.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hs_tracer_testbed.smollm import ensure_target
from hs_tracer_testbed.trainers import specforge
from tests.engine_runs import Engines, EngineSpec

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def run() -> specforge.SpecForgeRun:
    return specforge.ensure_run()


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hs_tracer.cli", *args], capture_output=True, text=True,
                          timeout=600)


def test_the_pinned_release_needs_every_glue_it_gets() -> None:
    assert specforge.glue_status() == {g.name: "needed" for g in specforge.GLUE}


def test_what_specforge_writes(run: specforge.SpecForgeRun) -> None:
    """Its files, keys and shapes; no layer ids anywhere in them; its own capture layers [1, 14, 26]
    (C_out: outputs of blocks 1, 14, 26), which are HF ``hidden_states[2, 15, 27]``."""
    from transformers import AutoModelForCausalLM

    manifest = run.load_manifest()
    assert manifest["layer_ids"] == [1, 14, 26]
    files = sorted((run.data / "rows_0-2000").glob("data_*.ckpt"))
    assert len(files) == manifest["recipe"]["samples"]
    rec = torch.load(files[0], weights_only=True)
    assert set(rec) == {"input_ids", "loss_mask", "hidden_state", "aux_hidden_state"}
    t = rec["input_ids"].shape[0]
    assert rec["aux_hidden_state"].shape == (1, t, 3 * 576)
    assert rec["aux_hidden_state"].dtype == torch.bfloat16
    assert rec["hidden_state"].shape == (1, t, 576)
    mapping = torch.load(run.data / "vocab_mapping" / "vocab_mapping.pt", weights_only=True)
    assert mapping["d2t"].shape == (32000,) and int(mapping["t2d"].sum()) == 32000

    model = AutoModelForCausalLM.from_pretrained(ensure_target(), dtype=torch.float32).eval()
    with torch.no_grad():
        hs = model(input_ids=rec["input_ids"][None], output_hidden_states=True).hidden_states
    aux = rec["aux_hidden_state"][0].float().view(t, 3, 576)
    for slot, k in enumerate((2, 15, 27)):
        ref = hs[k][0]
        err = ((aux[:, slot] - ref).norm(dim=-1) / ref.norm(dim=-1)).median()
        assert err < 0.02, (slot, k, float(err))

    cfg = json.loads((run.draft / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == 32000
    assert "eagle_config" not in cfg and "eagle_aux_hidden_state_layer_ids" not in cfg


@pytest.fixture(scope="module")
def profile(run: specforge.SpecForgeRun, tmp_path_factory: pytest.TempPathFactory) -> str:
    out = str(tmp_path_factory.mktemp("specforge") / "profile.safetensors")
    done = _cli("profile", "build", str(run.data), "--target", str(ensure_target()), "--draft",
                str(run.draft), "-o", out, "--no-progress", "--producer-version", "specforge 0.2.0")
    assert done.returncode == 0, done.stderr
    return out


def test_profile_build_on_its_dump_measures_its_layers_and_acceptance(profile: str) -> None:
    """No ids in the files or the export: the producer's default [1, 14, 26] (recorded as such), and
    the rows measured against the target on the same tokens agree; expected acceptance measured."""
    from hs_tracer.profile.model import Profile

    loaded = Profile.load(profile)
    meta = loaded.meta
    assert meta["producer"] == "specforge" and meta["producer_version"] == "specforge 0.2.0"
    assert meta["convention"] == "specforge"
    assert meta["layer_ids"] == [1, 14, 26] and meta["ids_origin"] == "default"
    assert meta["sources"] == ["block:1", "block:14", "block:26"]
    assert loaded.expected_acceptance is not None and loaded.expected_acceptance.rows > 0


@pytest.mark.parametrize("engine", ["sglang==0.5.23", "vllm==0.32.0"])
def test_check_its_export_without_ids(run: specforge.SpecForgeRun, profile: str, engine: str) -> None:
    """The export names no layer ids: each engine feeds its default, which is what SpecForge trained on."""
    done = _cli("check", "--draft", str(run.draft), "--target", str(ensure_target()), "--profile", profile,
                "--engine", engine, "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["status"] == "ok"
    assert [s["observed_source"] for s in report["slots"]] == ["block:1", "block:14", "block:26"]
    assert "layer_ids_ignored" in {f["code"] for f in report["findings"]}


def test_diagnose_its_dump(run: specforge.SpecForgeRun, profile: str) -> None:
    done = _cli("diagnose", str(run.data), "--profile", profile, "--target", str(ensure_target()), "--json",
                "--no-progress")
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["status"] == "ok"


def test_a_claim_its_rows_contradict_is_named_at_build_time(run: specforge.SpecForgeRun, tmp_path) -> None:
    """Ids stated in the C_in sense but read as SpecForge's (the mix-up between the two tools'
    conventions): the rows measured on the target name the layers they really hold."""
    done = _cli("profile", "build", str(run.data), "--target", str(ensure_target()), "--layer-ids", "2,15,27",
                "--convention", "specforge", "-o", str(tmp_path / "p.safetensors"), "--no-progress",
                "--expected-sequences", "0")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "training_record_mismatch" in done.stdout
    assert "block:1, block:14, block:26" in done.stdout


def test_its_export_served_in_sglang_is_fed_what_it_was_trained_on(
        run: specforge.SpecForgeRun, profile: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The export as SpecForge users serve it: real SGLang 0.5.23, traced, no layer ids in the config.
    SGLang's default for a Llama target feeds the outputs of blocks 1, 14, 26 — what SpecForge captured
    — and the engine measures it on the same tokens (same-token identity), so the report says so."""
    pair = SimpleNamespace(target=ensure_target(), draft=run.draft)
    harness = Engines(pair, Path(profile), tmp_path_factory.mktemp("specforge-served"))
    served = harness.run("specforge", EngineSpec("testbed", ("real",)))
    live = served.diagnosis
    trained = ["block:1", "block:14", "block:26"]
    assert served.report["wiring"]["sources"] == trained
    assert [s["observed_source"] for s in live["slots"]] == trained, live["slots"]
    assert all("measured_error" in s for s in live["slots"]), live["slots"]
    assert not [f for f in live["findings"] if f["severity"] == "critical"], live["findings"]

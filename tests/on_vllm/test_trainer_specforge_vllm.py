"""SpecForge 0.2.0's SGLang export (the run of tests/test_trainer_specforge.py, cached by recipe in the
testbed cache) served as-is by vLLM, traced: vLLM reads the export without conversion, feeds its
default layers, which are the ones SpecForge captured, and hs_tracer says so, live and beforehand.

The run is built by the project's venv (SpecForge's capture needs SGLang): ``make trainer-runs``
builds it beside the suite; a checkout without it builds it here through ``.venv`` (about 5 min).
With it cached the file takes one profile build and one vLLM engine start (docs/testing.md).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from hs_tracer_testbed.smollm import ensure_target
from hs_tracer_testbed.trainers import REPO, specforge, tool_env
from tests.on_vllm.engines import cli, diagnosis, serve_traced

TRAINED = ["block:1", "block:14", "block:26"]


@pytest.fixture(scope="module")
def run() -> specforge.SpecForgeRun:
    from hs_tracer_testbed.build import default_cache_root

    root = default_cache_root() / f"specforge-run-{specforge.SpecForgeRecipe().digest()}"
    if not (root / "manifest.json").exists():
        build = "from hs_tracer_testbed.trainers import specforge; specforge.ensure_run()"
        subprocess.run([str(REPO / ".venv" / "bin" / "python"), "-c", build], check=True, env=tool_env())
    return specforge.SpecForgeRun.under(root)


@pytest.fixture(scope="module")
def profile(run: specforge.SpecForgeRun, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("specforge-vllm") / "profile.safetensors"
    done = cli("profile", "build", str(run.data), "--target", str(ensure_target()), "--draft", str(run.draft),
               "-o", str(out), "--no-progress", "--producer-version", "specforge 0.2.0")
    assert done.returncode == 0, done.stdout + done.stderr
    return out


def test_vllm_serves_its_export_as_trained(run: specforge.SpecForgeRun, profile: Path) -> None:
    """The export names no layer ids: vLLM's default for a Llama target, inputs of layers 2, 15, 27,
    is what SpecForge captured (outputs of blocks 1, 14, 26); the engine measures each slot on the
    same tokens and the report agrees. `hs-tracer check --engine vllm` predicts the same wiring. The
    profile carries the export's expected acceptance (mean accept length 1.07 on its training data):
    served, the 3-step draft reaches about that, so no finding is critical."""
    prompts = [torch.load(run.data / "rows_0-2000" / f"data_{i}.ckpt", weights_only=True)["input_ids"][:24]
               .tolist() for i in range(run.load_manifest()["recipe"]["samples"])]
    served = serve_traced(ensure_target(), run.draft, profile, prompts)
    wiring = served["reports"][0]["wiring"]
    assert wiring["layers_to_capture"] == [2, 15, 27] and wiring["sources"] == TRAINED, wiring
    d = diagnosis(served)
    assert [s["expected_source"] for s in d["slots"]] == TRAINED
    assert [s["observed_source"] for s in d["slots"]] == TRAINED, d["slots"]
    assert all("measured_error" in s for s in d["slots"]), d["slots"]
    assert not [f for f in d["findings"] if f["severity"] == "critical"], d["findings"]
    assert served["workloads"]["main"]["spec"]["num_drafts"] > 0

    done = cli("check", "--draft", str(run.draft), "--target", str(ensure_target()), "--profile",
               str(profile), "--engine", "vllm", "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["status"] == "ok", report["findings"]
    assert report["preflight"]["engine"]["sources"] == wiring["sources"]
    assert [s["observed_source"] for s in report["slots"]] == TRAINED

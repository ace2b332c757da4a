"""speculators 0.9.0's data of the real SmolLM2-135M target, made as speculators makes it (vLLM's
``extract_hidden_states`` with its hidden-states connector, here in vLLM's CPU build; cached by recipe
in the testbed cache), and hs_tracer on what it really wrote.

Cost on a fresh clone: building ``.venv-speculators`` (under a minute) and the capture (about 50 s
with the vLLM start); later runs read the cache.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hs_tracer_testbed.smollm import ensure_target
from hs_tracer_testbed.trainers import speculators


@pytest.fixture(scope="module")
def data() -> Path:
    return speculators.ensure_data()


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hs_tracer.cli", *args], capture_output=True, text=True,
                          timeout=600)


def test_the_pinned_release_needs_every_glue_it_gets() -> None:
    assert speculators.glue_status() == {g.name: "needed" for g in speculators.GLUE}


def test_what_speculators_writes(data: Path) -> None:
    """``hs_{i}.safetensors`` with ``token_ids`` [T] and ``hidden_states`` [T, 4, H]: its ids
    [2, 15, 27] (input of layer k) plus 30, the last layer's output; the first three are HF
    ``hidden_states[2, 15, 27]``, the same tensors SpecForge's [1, 14, 26] name."""
    from transformers import AutoModelForCausalLM

    manifest = json.loads((data / "manifest.json").read_text())
    assert manifest["layer_ids"] == [2, 15, 27, 30]
    files = sorted((data / "data" / "hidden_states").glob("hs_*.safetensors"))
    assert len(files) == manifest["recipe"]["samples"]
    rec = load_file(files[0])
    assert set(rec) == {"token_ids", "hidden_states"}
    t = rec["token_ids"].shape[0]
    assert rec["hidden_states"].shape == (t, 4, 576) and rec["hidden_states"].dtype == torch.bfloat16

    model = AutoModelForCausalLM.from_pretrained(ensure_target(), dtype=torch.float32).eval()
    with torch.no_grad():
        hs = model(input_ids=rec["token_ids"][None], output_hidden_states=True).hidden_states
    for slot, k in enumerate((2, 15, 27)):
        ref = hs[k][0]
        err = ((rec["hidden_states"][:, slot].float() - ref).norm(dim=-1) / ref.norm(dim=-1)).median()
        assert err < 0.02, (slot, k, float(err))


def test_profile_build_and_diagnose_on_its_data(data: Path, tmp_path: Path) -> None:
    """Its ids are not in the files: speculators' default in its own convention, the rows measured on
    the same tokens agree, the appended last layer is an extra candidate (block:29, pre-norm)."""
    from hs_tracer.profile.model import Profile

    out = tmp_path / "profile.safetensors"
    done = _cli("profile", "build", str(data / "data"), "--target", str(ensure_target()), "-o", str(out),
                "--no-progress", "--producer-version", "speculators 0.9.0")
    assert done.returncode == 0, done.stdout + done.stderr
    meta = Profile.load(out).meta
    assert meta["producer"] == "speculators" and meta["producer_version"] == "speculators 0.9.0"
    assert meta["convention"] == "speculators" and meta["layer_ids"] == [2, 15, 27]
    assert meta["sources"] == ["block:1", "block:14", "block:26"]
    assert "extra candidates from the data: block:29" in done.stdout
    done = _cli("diagnose", str(data / "data"), "--profile", str(out), "--target", str(ensure_target()),
                "--json", "--no-progress")
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads(done.stdout)["status"] == "ok"

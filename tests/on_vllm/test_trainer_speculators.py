"""speculators 0.9.0's data of the real SmolLM2-135M target, made as speculators makes it (vLLM's
``extract_hidden_states`` with its hidden-states connector, here in vLLM's CPU build), its trainer's
checkpoint after 3 steps on that data (both cached by recipe in the testbed cache), hs_tracer on what
they really wrote, vLLM serving the checkpoint as the target's EAGLE-3 draft, traced, and SGLang 0.5.23
(the project's ``.venv``) serving it traced after the conversion users make for SGLang.

Cost on a fresh clone: building ``.venv-speculators`` (under a minute), the capture (about 50 s with
the vLLM start) and the training (4 to 8 minutes on the shared 2-core machine); later runs read the
cache and spend their time on the profile build, one vLLM engine and one SGLang engine (about a
minute each; docs/testing.md).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hs_tracer_testbed.smollm import ensure_target
from hs_tracer_testbed.trainers import REPO, speculators, tool_env
from tests.on_vllm.engines import cli, diagnosis, serve_traced

TRAINED = ["block:1", "block:14", "block:26"]
# the findings that say a slot is fed, or may be fed, another layer than the trained one
LAYER_CODES = ("layer_ids_ignored", "layer_id_convention", "draft_input_width_mismatch",
               "slot_source_mismatch", "slot_source_unresolved", "capture_record_mismatch", "feature_drift")


@pytest.fixture(scope="module")
def data() -> Path:
    return speculators.ensure_data()


@pytest.fixture(scope="module")
def checkpoint() -> Path:
    return speculators.ensure_checkpoint()


@pytest.fixture(scope="module")
def profile(data: Path, checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The profile of speculators' data with its trainer's checkpoint as ``--draft`` (its expected
    acceptance) and the build's output."""
    out = tmp_path_factory.mktemp("speculators") / "profile.safetensors"
    done = cli("profile", "build", str(data / "data"), "--target", str(ensure_target()), "--draft",
               str(checkpoint), "-o", str(out), "--no-progress", "--producer-version", "speculators 0.9.0")
    assert done.returncode == 0, done.stdout + done.stderr
    return out, done.stdout


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


def test_profile_build_and_diagnose_on_its_data(data: Path, profile: tuple[Path, str]) -> None:
    """Its ids are not in the files: speculators' default in its own convention, the rows measured on
    the same tokens agree, the appended last layer is an extra candidate (block:29, pre-norm)."""
    from hs_tracer.profile.model import Profile

    out, stdout = profile
    meta = Profile.load(out).meta
    assert meta["producer"] == "speculators" and meta["producer_version"] == "speculators 0.9.0"
    assert meta["convention"] == "speculators" and meta["layer_ids"] == [2, 15, 27]
    assert meta["sources"] == TRAINED
    assert "extra candidates from the data: block:29" in stdout
    done = cli("diagnose", str(data / "data"), "--profile", str(out), "--target", str(ensure_target()),
               "--json", "--no-progress")
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads(done.stdout)["status"] == "ok"


def test_what_its_trainer_writes(checkpoint: Path) -> None:
    """``Eagle3DraftModel`` with ``speculators_config``, the ids at the top level in its convention
    (input of layer k: the rows it trained on), the model dimensions under
    ``transformer_layer_config``, the three norm flags on and ``input_norm`` over the 3 x 576 input;
    the full vocabulary (no ``d2t``/``t2d``: no token frequencies given)."""
    from safetensors import safe_open

    cfg = json.loads((checkpoint / "config.json").read_text())
    assert cfg["architectures"] == ["Eagle3DraftModel"] and cfg["speculators_model_type"] == "eagle3"
    assert cfg["speculators_version"] == "0.9.0" and cfg["speculators_config"]["algorithm"] == "eagle3"
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == str(ensure_target())
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27] and "eagle_config" not in cfg
    assert (cfg["norm_before_fc"], cfg["norm_before_residual"], cfg["norm_output"], cfg["fc_norm"]) == (
        True, True, True, False)
    layer = cfg["transformer_layer_config"]
    assert (layer["model_type"], layer["hidden_size"], layer["num_hidden_layers"]) == ("llama", 576, 1)
    assert cfg["draft_vocab_size"] == layer["vocab_size"] == 49152
    with safe_open(checkpoint / "model.safetensors", "pt") as f:
        shapes = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
    assert shapes["input_norm.weight"] == [3 * 576] and shapes["fc.weight"] == [576, 3 * 576]
    assert shapes["layers.0.hidden_norm.weight"] == [576] and shapes["norm.weight"] == [576]
    assert not {"d2t", "t2d"} & set(shapes)
    assert json.loads((checkpoint / "training_state.json").read_text())["global_step"] == 3


def test_hs_tracers_draft_forward_is_speculators_own_on_its_checkpoint(data: Path, checkpoint: Path,
                                                                       tmp_path: Path) -> None:
    """The plain-torch draft that measures expected acceptance, on speculators' layout (dims under
    ``transformer_layer_config``, ``norm_before_fc``, ``norm_before_residual``, ``norm_output``),
    against speculators' own ``Eagle3DraftModel`` on the checkpoint it saved: the same first-step
    logits on a real sequence of its data. Each of the two flags SGLang's class lacks moves them by
    far more than that, so both are exercised."""
    from hs_tracer.draft.model import Eagle3Draft

    rec = load_file(data / "data" / "hidden_states" / "hs_0.safetensors")
    feats, ids = rec["hidden_states"][:, :3].flatten(1).float(), rec["token_ids"]
    ref = speculators.reference_logits(checkpoint, feats, ids, tmp_path / "forward")
    draft = Eagle3Draft.from_pretrained(checkpoint, target_dir=ensure_target()).eval()
    assert draft.config.norm_before_fc and draft.config.norm_before_residual and draft.config.norm_output

    def error() -> float:
        with torch.no_grad():
            ours = draft(feats, ids, torch.arange(ids.shape[0])).logits
        return float(((ours - ref).norm(dim=-1) / ref.norm(dim=-1)).max())

    assert error() < 1e-5
    draft.config.norm_before_residual = False
    assert error() > 1e-2
    draft.config.norm_before_residual, draft.input_norm = True, None
    assert error() > 1e-3


def test_its_profile_carries_the_expected_acceptance_of_its_checkpoint(profile: tuple[Path, str]) -> None:
    """``profile build --draft CKPT`` measures it, the checkpoint's flags recorded: the 3-step draft
    accepts nothing on its own training data (mean accept length 1.00), what vLLM serves it at."""
    from hs_tracer.profile.model import Profile

    out, stdout = profile
    exp = Profile.load(out).expected_acceptance
    assert exp is not None and exp.rows > 0 and exp.sequences == 8, stdout
    assert exp.draft_flags == {"norm_before_fc": True, "fc_norm": False, "norm_output": True,
                               "norm_before_residual": True}
    assert exp.per_position_rate == [0.0, 0.0, 0.0]


def test_check_its_checkpoint_on_vllm(checkpoint: Path, profile: tuple[Path, str]) -> None:
    """vLLM reads the top-level ids, feeds block:1, block:14, block:26, the trained layers: ok, and no
    advice to move the ids anywhere (the format is the one vLLM reads)."""
    done = cli("check", "--draft", str(checkpoint), "--target", str(ensure_target()), "--profile",
               str(profile[0]), "--engine", "vllm==0.32.0", "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["status"] == "ok", report["findings"]
    engine = report["preflight"]["engine"]
    assert engine["layer_ids_key"] == "eagle_aux_hidden_state_layer_ids"
    assert engine["layer_ids"] == [2, 15, 27]
    assert engine["sources"] == report["preflight"]["trained_sources"] == TRAINED
    assert [s["observed_source"] for s in report["slots"]] == TRAINED
    assert not [f for f in report["findings"] if "eagle_config" in f["fix"]], report["findings"]


def test_check_its_checkpoint_on_sglang(checkpoint: Path, profile: tuple[Path, str]) -> None:
    """SGLang 0.5.23 has no reader for speculators' format (it refuses ``Eagle3DraftModel``, and has no
    ``norm_before_residual`` branch): critical, and against the profile's expected acceptance, which
    was measured with that flag on, a critical ``norm_flags``. Its layer ids sit where SGLang never
    looks, so a converted draft that left them there would be fed SGLang's default, which on this
    target is the trained block:1, block:14, block:26: a warning, whose fix moves them into
    ``eagle_config`` in SGLang's spelling [1, 14, 26]."""
    done = cli("check", "--draft", str(checkpoint), "--target", str(ensure_target()), "--profile",
               str(profile[0]), "--engine", "sglang==0.5.23", "--json")
    assert done.returncode == 1, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["status"] == "miswired"
    fmt = [f for f in report["findings"] if f["code"] == "draft_format"]
    assert {f["severity"] for f in fmt} == {"critical"}
    assert any("no speculators reader" in f["message"] for f in fmt), fmt
    assert any("norm_before_residual" in f["message"] for f in fmt), fmt
    assert report["preflight"]["engine"]["sources"] == TRAINED
    assert [s["observed_source"] for s in report["slots"]] == TRAINED
    ids = [f for f in report["findings"] if f["code"] == "layer_ids_ignored"]
    assert [f["severity"] for f in ids] == ["warning"], ids
    assert ids[0]["details"]["top_level_ids"] == [2, 15, 27]
    assert "into eagle_config" in ids[0]["fix"] and "as [1, 14, 26]" in ids[0]["fix"]
    assert not [f for f in report["findings"] if f["code"] == "layer_id_convention"], report["findings"]
    flags = [f for f in report["findings"] if f["code"] == "norm_flags"]
    assert [f["details"]["flag"] for f in flags] == ["norm_before_residual"], flags


def test_vllm_serves_it_as_trained(data: Path, checkpoint: Path, profile: tuple[Path, str]) -> None:
    """vLLM serves the real target with the checkpoint as its EAGLE-3 draft, traced with the profile of
    speculators' data and its checkpoint's expected acceptance: its wiring record is the trained
    layers, vLLM applies the norm flags the expectation was measured with (no ``norm_flags``), and
    the acceptance a 3-step draft earns (it proposes nothing the target accepts) is what it earns on
    its training data (mean accept length 1.00), so no finding is critical."""
    files = data / "data" / "hidden_states"
    prompts = [load_file(files / f"hs_{i}.safetensors")["token_ids"][:24].tolist() for i in range(8)]
    served = serve_traced(ensure_target(), checkpoint, profile[0], prompts)
    wiring = served["reports"][0]["wiring"]
    assert wiring["layer_ids_key"] == "eagle_aux_hidden_state_layer_ids"
    assert wiring["layers_to_capture"] == [2, 15, 27] and wiring["sources"] == TRAINED
    d = diagnosis(served)
    assert [s["expected_source"] for s in d["slots"]] == TRAINED
    assert not [f for f in d["findings"] if f["severity"] == "critical" or f["code"] == "norm_flags"], \
        d["findings"]
    assert served["workloads"]["main"]["spec"]["num_drafts"] > 0


# SGLang lives in the project's venv, not in vLLM's: its engine runs there, through the SGLang suite's
# harness (tests/engine_runs.py), and hands back the report of its scheduler.
_SERVE_IN_SGLANG = """
import json, sys
from pathlib import Path
from types import SimpleNamespace
from tests.engine_runs import Engines, EngineSpec
target, draft, profile, root = map(Path, sys.argv[1:5])
served = Engines(SimpleNamespace(target=target, draft=draft), profile, root).run(
    "speculators", EngineSpec("testbed", ("real",)))
(root / "served.json").write_text(json.dumps({"report": served.report, "diagnosis": served.diagnosis}))
"""


def test_sglang_serves_it_converted_as_trained_and_names_the_norm_it_drops(
        checkpoint: Path, profile: tuple[Path, str], tmp_path: Path) -> None:
    """Converted as docs/preflight.md says (``speculators.convert_for_sglang``: a
    ``LlamaForCausalLMEagle3`` config, the ids in ``eagle_config`` as SGLang spells them, the weights
    unchanged), the checkpoint is checked and then served by real SGLang 0.5.23 on the CPU, traced with
    the profile of its data and expected acceptance. Fed: the trained block:1, block:14, block:26, in
    the engine's record and measured on the same tokens; no layer finding. What SGLang cannot do is
    named as such: it has no ``norm_before_residual`` branch, which the draft was trained and measured
    with (``draft_format`` beforehand, ``norm_flags`` both beforehand and live, whose fix sets no flag)."""
    draft = speculators.convert_for_sglang(checkpoint, tmp_path / "sglang-draft")
    cfg = json.loads((draft / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and "target_hidden_size" not in cfg
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 14, 26]
    assert (cfg["norm_before_fc"], cfg["norm_output"], cfg["norm_before_residual"]) == (True, True, True)

    done = cli("check", "--draft", str(draft), "--target", str(ensure_target()), "--profile", str(profile[0]),
               "--engine", "sglang==0.5.23", "--json")
    assert done.returncode == 1, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["preflight"]["engine"]["sources"] == report["preflight"]["trained_sources"] == TRAINED
    assert [s["observed_source"] for s in report["slots"]] == TRAINED
    critical = [f for f in report["findings"] if f["severity"] == "critical"]
    assert {(f["code"], f.get("details", {}).get("flag")) for f in critical} == {
        ("draft_format", None), ("norm_flags", "norm_before_residual")}, report["findings"]
    assert all("norm_before_residual" in f["message"] for f in critical), critical
    assert not [f for f in report["findings"] if f["code"] in (*LAYER_CODES, "draft_weights_missing")], \
        report["findings"]

    root = tmp_path / "sglang"
    root.mkdir()
    env = {k: v for k, v in tool_env().items() if k != "OMP_NUM_THREADS"}  # the engine's own threads
    subprocess.run([str(REPO / ".venv" / "bin" / "python"), "-c", _SERVE_IN_SGLANG, str(ensure_target()),
                    str(draft), str(profile[0]), str(root)], check=True, cwd=REPO, env=env, timeout=1500)
    served = json.loads((root / "served.json").read_text())
    wiring, live = served["report"]["wiring"], served["diagnosis"]
    assert wiring["configured_layer_ids"] == [1, 14, 26] and wiring["layers_to_capture"] == [2, 15, 27]
    assert wiring["sources"] == TRAINED
    assert [s["expected_source"] for s in live["slots"]] == TRAINED
    assert [s["observed_source"] for s in live["slots"]] == TRAINED
    assert all(s["measured_error"] < 0.01 for s in live["slots"]), live["slots"]
    critical = [f for f in live["findings"] if f["severity"] == "critical"]
    flags = [(f["code"], f.get("details", {}).get("flag")) for f in critical]
    assert flags == [("norm_flags", "norm_before_residual")], live["findings"]
    assert not [f for f in live["findings"] if f["code"] in LAYER_CODES], live["findings"]
    assert [c["cause"] for c in live["root_causes"] if c["severity"] == "critical"] == ["norm_flags"]
    assert "no norm_before_residual branch" in critical[0]["fix"]
    assert live["acceptance"]["steps"] > 0

"""Same-token identity on the toy DeepSeek-V3 testbed target (8 layers, hidden 64, MLA + MoE), which
transformers loads from the testbed's per-expert checkpoint: the measurement is not Llama-only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hs_tracer.cli import main
from hs_tracer.profile.model import Profile
from hs_tracer.profile.target_forward import load_target

TRAINED = ["block:1", "block:3", "block:4"]


@pytest.fixture(scope="module")
def toy_states(testbed):
    from hs_tracer_testbed import corpus, rewired
    from hs_tracer_testbed.target import encode

    target = load_target(testbed.target)
    assert target.arch == "DeepseekV3ForCausalLM" and target.num_layers == 8
    return rewired.states_of(target.model, encode(corpus.documents(77, 6, "train")))


def test_a_toy_capture_fed_a_layer_early_in_slot_0_is_measured(testbed, testbed_profile, toy_states,
                                                                 capsys, tmp_path: Path) -> None:
    from hs_tracer_testbed.rewired import write_capture

    fed = ["block:0", "block:3", "block:4"]
    live = write_capture(tmp_path / "cap", toy_states, fed, TRAINED, 8)
    code = main(["diagnose", str(live), "--profile", str(testbed_profile), "--target", str(testbed.target),
                 "--min-tokens", "64", "--json", "--no-progress"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 1
    assert [s["sources"] for s in doc["measured"]["slots"]] == [[s] for s in fed]
    assert [s["observed_source"] for s in doc["slots"]] == fed


def test_toy_dump_described_with_ids_one_block_late_is_a_training_record_mismatch(testbed, capsys,
                                                                                   tmp_path: Path) -> None:
    out = tmp_path / "p.safetensors"
    code = main(["profile", "build", str(testbed.specforge_data), "-o", str(out), "--layer-ids", "2,4,5",
                 "--convention", "specforge", "--target", str(testbed.target), "--shard", "0/16",
                 "--expected-sequences", "0", "--no-progress"])
    text = capsys.readouterr().out
    assert code == 1
    for k, (got, said) in enumerate(zip(TRAINED, ["block:2", "block:4", "block:5"], strict=True)):
        assert f"training_record_mismatch: slot {k} holds {got}, not {said}" in text, text
    assert Profile.load(out).sources == TRAINED


def test_a_config_only_target_builds_as_before_and_says_it_measured_nothing(testbed, capsys,
                                                                             tmp_path: Path) -> None:
    config_only = tmp_path / "target"
    config_only.mkdir()
    (config_only / "config.json").write_text((testbed.target / "config.json").read_text())
    out = tmp_path / "p.safetensors"
    code = main(["profile", "build", str(testbed.specforge_data), "-o", str(out), "--draft",
                 str(testbed.draft), "--target", str(config_only), "--shard", "0/16", "--no-progress"])
    assert code == 0
    assert "sources not measured: --target" in capsys.readouterr().err
    meta = Profile.load(out).meta
    assert "source_measurement" not in meta and meta["sources"] == TRAINED

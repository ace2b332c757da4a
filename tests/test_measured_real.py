"""Same-token identity on the real pretrained target (SmolLM2-135M, 30 layers): ``diagnose --target`` and
``profile build --target`` recompute the target on a dump's own tokens and name the layer each slot's
rows hold, whatever the dump's record says.

The captures and dumps are written from the target's own hidden states (``hs_tracer_testbed.rewired``)
with the trained wiring in their record and the rows of other layers: the case the record alone
decides wrongly and window statistics cannot always settle on a real model's deep layers.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hs_tracer.cli import main
from hs_tracer.findings import Severity
from hs_tracer.profile.model import Profile
from hs_tracer.profile.target_forward import load_target
from hs_tracer.profile.token_rows import PREFIX_NOT_HELD
from hs_tracer.sources import EMBEDDING

TRAINED = ["block:1", "block:14", "block:26"]
SHIFTS = {
    "all_slots_one_layer_late": ["block:2", "block:15", "block:27"],
    "deep_slots_one_layer_late": ["block:1", "block:15", "block:27"],
    "last_slot_two_layers_late": ["block:1", "block:14", "block:28"],
    "embedding_first": [EMBEDDING, "block:1", "block:14"],
}
SEQUENCES, TOKENS = 4, 96  # per sequence
MEASURE = ["--sequences", "3", "--tokens", "240", "--no-progress"]


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    """The target, its states on a few training-domain documents and a profile of the trained wiring
    built from them (through the CLI, which measures the trained sources: the build's control)."""
    from transformers import AutoTokenizer

    from hs_tracer_testbed import realtext, rewired, smollm

    target_dir = smollm.ensure_target()
    target = load_target(target_dir)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    seqs = smollm.encode(tokenizer, realtext.documents("docs")[:SEQUENCES], TOKENS)
    states = rewired.states_of(target.model, seqs)
    root = tmp_path_factory.mktemp("measured-real")
    dump = rewired.write_specforge_dump(root / "train", states, TRAINED)
    profile = root / "profile.safetensors"
    code = main(["profile", "build", str(dump), "-o", str(profile), "--layer-ids", "1,14,26", "--convention",
                 "specforge", "--target", str(target_dir), "--measure-sequences", "3", "--no-progress"])
    assert code == 0
    return {"target_dir": target_dir, "target": target, "states": states, "root": root, "profile": profile}


def _diagnose(capsys, live: Path, real, *extra: str) -> tuple[int, dict]:
    code = main(["diagnose", str(live), "--profile", str(real["profile"]), "--json", *extra])
    return code, json.loads(capsys.readouterr().out)


def test_the_recomputed_sources_are_transformers_hidden_states_where_those_name_them(real) -> None:
    """transformers 5.19's ``hidden_states``: [0] the embedding, [j+1] block j's output, and the last
    entry the final norm's output, not the last block's: the hooks give every source, that one too."""
    target, ids = real["target"], real["states"][0].input_ids
    states = target.states(ids)
    with torch.no_grad():
        hs = target.model(ids[None], output_hidden_states=True).hidden_states
    n = target.num_layers
    assert len(hs) == n + 1 and len(states) == n + 2
    torch.testing.assert_close(states[EMBEDDING], hs[0][0])
    for j in range(n - 1):
        torch.testing.assert_close(states[f"block:{j}"], hs[j + 1][0])
    torch.testing.assert_close(states["final_norm"], hs[n][0])
    assert not torch.allclose(states[f"block:{n - 1}"], hs[n][0])
    with torch.no_grad():
        torch.testing.assert_close(states["final_norm"], target.decoder.norm(states[f"block:{n - 1}"]))


def test_profile_build_recorded_the_measured_sources(real) -> None:
    meta = Profile.load(real["profile"]).meta
    assert meta["sources"] == meta["stated_sources"] == meta["measured_sources"] == TRAINED
    assert meta["source_measurement"]["sequences"] == 3


def test_a_capture_wired_as_trained_is_healthy(real, capsys, tmp_path: Path) -> None:
    from hs_tracer_testbed.rewired import write_capture

    live = write_capture(tmp_path / "cap", real["states"], TRAINED, TRAINED, real["target"].num_layers)
    code, doc = _diagnose(capsys, live, real, "--target", str(real["target_dir"]), *MEASURE)
    assert code == 0, doc
    assert [s["sources"] for s in doc["measured"]["slots"]] == [[s] for s in TRAINED]
    assert [s["observed_source"] for s in doc["slots"]] == TRAINED
    assert not [f for f in doc["findings"] if f["severity"] == "critical"]


@pytest.mark.parametrize("shift", sorted(SHIFTS))
def test_a_capture_recording_the_trained_wiring_over_other_rows_is_named_slot_by_slot(
        real, capsys, tmp_path: Path, shift: str) -> None:
    from hs_tracer_testbed.rewired import write_capture

    fed = SHIFTS[shift]
    layers = real["target"].num_layers
    live = write_capture(tmp_path / "cap", real["states"], fed, TRAINED, layers, prefixed=1)
    code, doc = _diagnose(capsys, live, real, "--target", str(real["target_dir"]), *MEASURE)
    assert code == 1, doc
    measured = doc["measured"]
    assert [s["sources"] for s in measured["slots"]] == [[s] for s in fed]
    assert measured["sequences"] == 3 and measured["left_out"] == {PREFIX_NOT_HELD: 1}
    assert [s["observed_source"] for s in doc["slots"]] == fed
    critical = {(f["slot"], f.get("observed")) for f in doc["findings"]
                if f["severity"] == Severity.CRITICAL.value and f.get("slot") is not None}
    for k, (want, got) in enumerate(zip(TRAINED, fed, strict=True)):
        assert ((k, got) in critical) == (want != got), (k, critical)


def test_without_target_the_deep_slots_one_layer_late_pass_as_statistics_and_say_so(real, capsys,
                                                                                  tmp_path: Path) -> None:
    """The gap the measurement closes: this profile (no atlas) and the training domain's statistics
    read the deep slots one layer late as trained; the report says it only judged statistics."""
    from hs_tracer_testbed.rewired import write_capture

    fed = SHIFTS["deep_slots_one_layer_late"]
    live = write_capture(tmp_path / "cap", real["states"], fed, TRAINED, real["target"].num_layers)
    assert main(["diagnose", str(live), "--profile", str(real["profile"])]) == 0
    assert "statistical: pass --target to measure which layer each slot carries" in capsys.readouterr().out


@pytest.mark.parametrize("layout", ["specforge", "speculators"])
def test_a_training_dump_is_measured_on_its_token_ids(real, capsys, tmp_path: Path, layout: str) -> None:
    from hs_tracer_testbed import rewired

    fed = SHIFTS["embedding_first"]
    write = rewired.write_specforge_dump if layout == "specforge" else rewired.write_speculators_dump
    dump = write(tmp_path / layout, real["states"], fed)
    code, doc = _diagnose(capsys, dump, real, "--target", str(real["target_dir"]), *MEASURE)
    assert code == 1
    assert [s["sources"] for s in doc["measured"]["slots"]] == [[s] for s in fed]


def test_profile_build_names_the_slots_whose_rows_are_not_what_the_ids_say(real, capsys,
                                                                          tmp_path: Path) -> None:
    from hs_tracer_testbed.rewired import write_specforge_dump

    fed = SHIFTS["deep_slots_one_layer_late"]
    dump = write_specforge_dump(tmp_path / "sf", real["states"], fed)
    common = [str(dump), "--layer-ids", "1,14,26", "--convention", "specforge", "--target",
              str(real["target_dir"]), "--measure-sequences", "2", "--no-progress"]
    out = tmp_path / "p.safetensors"
    assert main(["profile", "build", *common, "-o", str(out)]) == 1
    text = capsys.readouterr().out
    named = [line for line in text.splitlines() if "[critical] training_record_mismatch" in line]
    assert len(named) == 2, text
    assert "slot 1 holds block:15, not block:14" in named[0]
    assert "slot 2 holds block:27, not block:26" in named[1]
    meta = Profile.load(out).meta  # written all the same, with the measured sources as trained
    assert meta["sources"] == fed and meta["stated_sources"] == TRAINED

    # sharded: shard 0 measures for the build, the merge keeps it and repeats the finding
    shards = [tmp_path / f"s{i}.safetensors" for i in range(2)]
    assert main(["profile", "build", *common, "--shard", "0/2", "-o", str(shards[0])]) == 1
    assert main(["profile", "build", *common, "--shard", "1/2", "-o", str(shards[1])]) == 0
    capsys.readouterr()
    merged = tmp_path / "merged.safetensors"
    assert main(["profile", "merge", str(shards[1]), str(shards[0]), "-o", str(merged)]) == 1
    assert capsys.readouterr().out.count("[critical] training_record_mismatch") == 2
    assert Profile.load(merged).sources == fed


@pytest.mark.parametrize("make", ["missing", "config_only"])
def test_a_target_that_cannot_be_recomputed_is_an_input_error(real, capsys, tmp_path: Path,
                                                              make: str) -> None:
    from hs_tracer_testbed.rewired import write_capture

    live = write_capture(tmp_path / "cap", real["states"][:1], TRAINED, TRAINED, real["target"].num_layers)
    target = tmp_path / "target"
    if make == "config_only":
        target.mkdir()
        (target / "config.json").write_text((real["target_dir"] / "config.json").read_text())
    code = main(["diagnose", str(live), "--profile", str(real["profile"]), "--target", str(target)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and str(target) in err[0], err


CHANNEL_FAULTS = ["residual_left_out", "input_norm"]


@pytest.mark.parametrize("fault", CHANNEL_FAULTS)
def test_a_capture_channel_that_hands_over_a_value_no_layer_has_is_named_as_such(
        real, capsys, tmp_path: Path, fault: str) -> None:
    """Slots 1 and 2 carry the right layers' neighbourhood but not their value (the residual left out,
    the next layer's input norm applied) while the record says the trained wiring: each is measured
    as fed none of the target's layers, with the transform that explains it, never named as a layer
    (not by the statistics either), and the fix points at the capture channel's code."""
    from hs_tracer_testbed.rewired import channel_rows, write_capture

    seqs = real["states"]
    replaced = {k: channel_rows(real["target"].model, seqs, TRAINED[k], fault) for k in (1, 2)}
    layers = real["target"].num_layers
    live = write_capture(tmp_path / "cap", seqs, TRAINED, TRAINED, layers, replaced=replaced)
    code, doc = _diagnose(capsys, live, real, "--target", str(real["target_dir"]), *MEASURE)
    assert code == 1, doc
    slots = doc["measured"]["slots"]
    assert slots[0]["sources"] == [TRAINED[0]] and not slots[0]["fed_none"]
    for k in (1, 2):
        assert slots[k]["sources"] == [] and slots[k]["fed_none"], slots[k]
        assert slots[k]["transform"]["transform"] == fault and slots[k]["transform"]["source"] == TRAINED[k]
        row = doc["slots"][k]
        assert row["observed_source"] == "unknown" and row["fed_none"] and "candidates" not in row
        assert row["transform"]["transform"] == fault
    assert doc["slots"][0]["observed_source"] == TRAINED[0]
    named = [f for f in doc["findings"] if f.get("slot") in (1, 2) and f["severity"] == "critical"]
    assert {f["slot"] for f in named} == {1, 2}
    for f in named:
        assert f["observed"] == "unknown" and "none of the target's layers" in f["message"]
        assert "capture channel" in f["fix"] and "eagle_aux_hidden_state_layer_ids" not in f["fix"]
    assert {r["cause"] for r in doc["root_causes"] if r["severity"] == "critical"} == {"capture_channel"}


def test_two_slots_in_each_others_place_are_named_exactly_and_fixed_in_the_concatenation_order(
        real, capsys, tmp_path: Path) -> None:
    from hs_tracer_testbed.rewired import write_capture

    fed = [TRAINED[0], TRAINED[2], TRAINED[1]]
    live = write_capture(tmp_path / "cap", real["states"], fed, TRAINED, real["target"].num_layers)
    code, doc = _diagnose(capsys, live, real, "--target", str(real["target_dir"]), *MEASURE)
    assert code == 1
    assert [s["observed_source"] for s in doc["slots"]] == fed
    named = [f for f in doc["findings"] if f.get("slot") in (1, 2) and f["severity"] == "critical"]
    assert named and all("order" in f["fix"] and f["details"]["cause"] == "capture_order" for f in named)
    assert all("eagle_aux_hidden_state_layer_ids" not in f["fix"] for f in named)

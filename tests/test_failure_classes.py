"""The failure classes reported since the catalogue: a failing and a passing case each, on testbed
variants of the trained draft, checked the way ``hs-tracer check --profile`` checks them."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hs_tracer.findings import Code, Severity
from hs_tracer.preflight.runner import run_check
from hs_tracer_testbed.miswire import regenerated_d2t, write_vocab_variant


def _variant(testbed, tmp_path: Path, name: str, edit: Callable[[dict[str, Any]], None]) -> Path:
    out = tmp_path / name
    out.mkdir()
    for item in testbed.draft.iterdir():
        if item.name != "config.json":
            (out / item.name).symlink_to(item.resolve())
    cfg = json.loads((testbed.draft / "config.json").read_text())
    edit(cfg)
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def _ids(ids):
    def edit(cfg):
        cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = ids
    return edit


def _codes(report, severity=Severity.CRITICAL) -> set[Code]:
    return {f.code for f in report.findings if f.severity is severity}


# 1. normalisation flags ---------------------------------------------------------------------------

@pytest.mark.parametrize("flag", ["norm_output", "norm_before_fc"])
def test_norm_flag_the_draft_was_not_measured_with_is_critical(testbed, testbed_profile, tmp_path, flag):
    draft = _variant(testbed, tmp_path, flag, lambda c: c.__setitem__(flag, True))
    report = run_check(draft, testbed.target, profile=testbed_profile).report
    norm = [f for f in report.findings if f.code is Code.NORM_FLAGS]
    assert [f.details["flag"] for f in norm] == [flag] and norm[0].severity is Severity.CRITICAL
    assert report.root_causes()[0].cause in ("norm_flags", "draft_weights_missing")


def test_norm_flags_as_measured_pass(testbed, testbed_profile):
    report = run_check(testbed.draft, testbed.target, profile=testbed_profile).report
    assert Code.NORM_FLAGS not in {f.code for f in report.findings} and report.exit_code == 0


# 2. vocabulary maps -------------------------------------------------------------------------------

def test_d2t_regenerated_after_training_is_critical(testbed, testbed_profile, tmp_path):
    draft = write_vocab_variant(testbed.draft, tmp_path / "regen", regenerated_d2t(testbed))
    report = run_check(draft, testbed.target, profile=testbed_profile).report
    assert report.exit_code == 1
    roots = report.root_causes()
    assert roots[0].cause == "vocabulary_map" and "training data" in roots[0].summary


def test_d2t_missing_is_critical_and_the_shipped_map_passes(testbed, testbed_profile, tmp_path):
    missing = write_vocab_variant(testbed.draft, tmp_path / "missing", None)
    report = run_check(missing, testbed.target, profile=testbed_profile).report
    assert report.root_causes()[0].cause == "vocabulary_map" and report.exit_code == 1
    same = write_vocab_variant(testbed.draft, tmp_path / "same", _shipped_d2t(testbed))
    assert Code.D2T_INVALID not in _codes(run_check(same, testbed.target, profile=testbed_profile).report)


def _shipped_d2t(testbed):
    from safetensors.torch import load_file

    return load_file(str(testbed.draft / "model.safetensors"))["d2t"]


# 3. layer ids at and past the range boundary, negative ids ------------------------------------------

@pytest.mark.parametrize("ids,word", [([1, 3, 8], "boundary"), ([1, 3, 9], "boundary"),
                                      ([-1, 3, 4], "negative id")])
def test_ids_out_of_range_are_critical_with_one_root_cause(testbed, tmp_path, ids, word):
    draft = _variant(testbed, tmp_path, "v", _ids(ids))
    report = run_check(draft, testbed.target).report
    assert report.exit_code == 1
    out_of_range = [f for f in report.findings if "outside the 8-layer" in f.message]
    assert out_of_range and word in out_of_range[0].message
    wiring = [r for r in report.root_causes() if r.cause == "layer_ids"]
    assert len(wiring) == 1


def test_ids_inside_the_range_pass(testbed, tmp_path):
    draft = _variant(testbed, tmp_path, "v", _ids([1, 3, 4]))
    assert run_check(draft, testbed.target).report.exit_code == 0


# 4. no ids at all ---------------------------------------------------------------------------------

def _no_ids(cfg):
    cfg["eagle_config"].pop("eagle_aux_hidden_state_layer_ids")


def test_no_ids_states_both_defaults(testbed, tmp_path):
    draft = _variant(testbed, tmp_path, "v", _no_ids)
    report = run_check(draft, testbed.target).report
    msg = next(f.message for f in report.findings if f.code is Code.LAYER_IDS_IGNORED)
    assert "[2, N//2, N-3]" in msg and "layers_to_capture [2, 4, 5]" in msg
    assert "SpecForge trainer's default ids [1, 3, 4]" in msg and "the same layers" in msg
    assert report.exit_code == 0  # without a profile nothing says the draft was trained elsewhere


def test_no_ids_with_a_draft_trained_elsewhere_is_critical(testbed, tmp_path):
    draft = _variant(testbed, tmp_path, "v", _no_ids)
    report = run_check(draft, testbed.target, trained_sources=["block:0", "block:2", "block:3"]).report
    assert report.exit_code == 1 and report.root_causes()[0].cause == "layer_ids"


# severity follows what is served --------------------------------------------------------------------

def test_top_level_ids_served_right_is_a_warning_with_the_profile(testbed, testbed_profile, tmp_path):
    def top(cfg):
        cfg["eagle_aux_hidden_state_layer_ids"] = cfg["eagle_config"].pop("eagle_aux_hidden_state_layer_ids")
    draft = _variant(testbed, tmp_path, "v", top)
    report = run_check(draft, testbed.target, profile=testbed_profile).report
    assert report.exit_code == 0 and report.status == "warning"
    f = next(f for f in report.findings if f.code is Code.LAYER_IDS_IGNORED)
    assert f.severity is Severity.WARNING and "bites" in f.message
    # without the profile, the ids read in their producer's (speculators) convention differ: critical
    assert run_check(draft, testbed.target).report.exit_code == 1


def test_one_wrong_id_list_is_one_root_cause_with_its_fix(testbed, testbed_profile, tmp_path):
    draft = _variant(testbed, tmp_path, "v", _ids([0, 2, 3]))
    report = run_check(draft, testbed.target, profile=testbed_profile).report
    roots = [r for r in report.root_causes() if r.severity is Severity.CRITICAL]
    assert len(roots) == 1 and roots[0].cause == "layer_ids"
    assert roots[0].fix == "set eagle_config.eagle_aux_hidden_state_layer_ids to [1, 3, 4]"
    assert "[embedding, block:1, block:2]" in roots[0].summary
    assert len(roots[0].findings) == len([f for f in report.findings if f.severity is not Severity.INFO])
    assert report.human().startswith("[critical] root cause: the draft config's layer ids [0, 2, 3]")

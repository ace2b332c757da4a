"""``hs-tracer replay`` on captures made from the testbed's own training features (no engine).

The training features are the ground truth, so a capture built from them with a known wiring fault
has a known answer: as served it falls short, and the rewiring by source gets back exactly the
agreement of the correct wiring. The engine end-to-end test is tests/test_replay_engine.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from hs_tracer import sources as S
from hs_tracer.cli import main as cli
from hs_tracer.profile.capture_format import CaptureManifest, CaptureWriter
from hs_tracer.profile.readers import SpecForgeReader
from hs_tracer.replay.analysis import config_ids_for, replay

RECORDS = slice(900, 940)  # held-out-ish records of the training dump (replay reads the first ones)


@pytest.fixture(scope="module")
def records(testbed) -> list[tuple[torch.Tensor, torch.Tensor]]:
    reader = SpecForgeReader(testbed.specforge_data)
    out = []
    for file in reader.files()[RECORDS]:
        data = reader.load(file)
        ids = reader._squeeze(data["input_ids"]).reshape(-1)
        out.append((reader._squeeze(data["aux_hidden_state"]), ids))
    return out


@pytest.fixture(scope="module")
def plan(testbed) -> dict[str, Any]:
    return testbed.load_manifest()["layers"]


def _capture(path: Path, records, plan: dict, slots: list[int | str], claimed: list[str], testbed,
             roll: int = 0) -> Path:
    """A capture whose slot i holds training slot ``slots[i]`` (or the token embedding); ``roll``
    shifts the feature rows against the ids across the whole batch (rows of other requests)."""
    from hs_tracer.draft.model import load_target_embedding

    emb = load_target_embedding(testbed.target)
    feats, ids, lens = [], [], []
    for aux, tok in records:
        h = aux.shape[-1] // 3
        parts = [emb[tok].to(aux.dtype) if s == "embedding" else aux[:, s * h:(s + 1) * h] for s in slots]
        feats.append(torch.cat(parts, dim=-1))
        ids.append(tok)
        lens.append(len(tok))
    n = plan["num_hidden_layers"]
    manifest = CaptureManifest(num_slots=3, hidden_size=feats[0].shape[-1] // 3, sources=claimed,
                               num_layers=n, target_arch="DeepseekV3ForCausalLM",
                               target_path=str(testbed.target),
                               wiring={"configured_layer_ids": plan["draft_config_ids"]})
    writer = CaptureWriter(path, manifest)
    positions = np.concatenate([np.arange(k) for k in lens])
    writer.write(torch.cat(feats).roll(roll, dims=0), torch.cat(ids), positions, accept_lengths=[1, 2],
                 extras={"extend_lens": lens})
    return path


def _run(capture: Path, testbed, profile: Path | None = None):
    return replay(capture, testbed.draft, training=testbed.specforge_data, profile_path=profile,
                  max_tokens=2000)


def test_correct_capture_is_at_training_level(tmp_path, records, plan, testbed) -> None:
    cap = _capture(tmp_path / "ok", records, plan, [0, 1, 2], plan["aux_sources"], testbed)
    r = _run(cap, testbed)
    assert r.status == "ok" and r.exit_code == 0
    assert r.as_served.result.rate >= r.level
    assert r.as_served.result.rate > 3 * r.baseline
    assert r.tokens_only.rate < r.as_served.result.rate  # the features carry information
    assert r.fix == {}
    assert r.trained_sources == plan["aux_sources"]


def test_features_of_other_requests_are_named(tmp_path, records, plan, testbed, testbed_profile) -> None:
    ok = _run(_capture(tmp_path / "ok", records, plan, [0, 1, 2], plan["aux_sources"], testbed), testbed,
              testbed_profile)
    assert ok.cause is None
    cap = _capture(tmp_path / "rolled", records, plan, [0, 1, 2], plan["aux_sources"], testbed, roll=517)
    r = _run(cap, testbed, testbed_profile)
    assert r.slot_sources == plan["aux_sources"]  # per slot the statistics are right
    assert r.status == "miswired" and r.cause.code.value == "features_from_other_requests"
    assert "features_from_other_requests" in [f["code"] for f in r.to_json()["findings"]]


def test_permuted_slots_are_found_and_rewired_by_source(tmp_path, records, plan, testbed) -> None:
    good = _run(_capture(tmp_path / "ok", records, plan, [0, 1, 2], plan["aux_sources"], testbed), testbed)
    srcs = plan["aux_sources"]
    cap = _capture(tmp_path / "perm", records, plan, [2, 0, 1], [srcs[2], srcs[0], srcs[1]], testbed)
    r = _run(cap, testbed)
    assert r.status == "miswired" and r.exit_code == 1
    assert r.as_served.result.rate < r.level
    by_source = next(c for c in r.candidates if c.name == "by source")
    assert by_source.wiring == (1, 2, 0) and by_source.sources == srcs
    assert by_source.result.correct == good.as_served.result.correct  # the same features, the same answers
    assert r.recovered_by() is not None and r.recovered_by().result.rate >= r.level
    assert r.fix["fed_sources"] == [srcs[2], srcs[0], srcs[1]]
    assert "by source" in r.fix["verified"] and "training level" in r.fix["verified"]
    assert r.fix["missing_from_capture"] == []


def test_embedding_in_a_slot_is_detected_exactly(tmp_path, records, plan, testbed) -> None:
    srcs = plan["aux_sources"]
    cap = _capture(tmp_path / "emb", records, plan, ["embedding", 1, 2], list(srcs), testbed)  # manifest lies
    r = _run(cap, testbed)
    assert r.slot_sources == ["embedding", srcs[1], srcs[2]]
    assert r.slot_evidence[0] == "equals embed_tokens(ids)"
    # the testbed draft leans little on slot 0: whether agreement falls below training level is
    # measured, not assumed; the mismatch is reported either way
    assert r.status == ("miswired" if r.as_served.result.rate < r.level else "warning")
    assert r.exit_code == (r.status == "miswired")
    assert r.fix["missing_from_capture"] == [srcs[0]]
    assert r.fix["eagle_aux_hidden_state_layer_ids"] == plan["draft_config_ids"]
    assert f"slot 0 must carry {srcs[0]} (it is fed embedding)" in r.fix["message"]


def test_profile_names_the_trained_sources(tmp_path, records, plan, testbed, testbed_profile) -> None:
    cap = _capture(tmp_path / "ok", records, plan, [0, 1, 2], plan["aux_sources"], testbed)
    r = _run(cap, testbed, testbed_profile)
    assert (r.trained_sources, r.trained_from) == (plan["aux_sources"], "profile")


def test_cli_json_and_exit_codes(tmp_path, records, plan, testbed, capsys) -> None:
    srcs = plan["aux_sources"]
    cap = _capture(tmp_path / "perm", records, plan, [2, 0, 1], [srcs[2], srcs[0], srcs[1]], testbed)
    args = ["--draft", str(testbed.draft), "--training-data", str(testbed.specforge_data),
            "--max-tokens", "1500"]
    assert cli(["replay", str(cap), *args, "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["status"] == "miswired" and out["recovered_by"]["sources"] == srcs
    assert cli(["replay", str(cap), *args]) == 1
    text = capsys.readouterr().out
    level = out["training_level_rule"]
    assert f"training level for {level['tokens']} live tokens >= {level['value']:.3f}" in text
    assert "status: miswired" in text and "training level recovered by: by source" in text
    assert cli(["replay", str(tmp_path), *args]) == 2  # not a capture
    assert "HS_TRACER_CAPTURE_DIR" in capsys.readouterr().err
    assert cli(["replay", str(cap), "--draft", str(tmp_path)]) == 2  # no draft there
    assert "config.json" in capsys.readouterr().err


@pytest.mark.parametrize("trained,family_arch,expected", [
    (["block:1", "block:3", "block:4"], "DeepseekV3ForCausalLM", [1, 3, 4]),  # DeepSeek: +1 iff ids[0] == 1
    (["block:2", "block:4", "block:5"], "DeepseekV3ForCausalLM", [3, 5, 6]),  # written C_in: no +1
    (["block:0", "block:2", "block:3"], "DeepseekV3ForCausalLM", None),  # no id list yields these
    (["block:0", "block:2", "block:3"], "LlamaForCausalLM", [0, 2, 3]),  # Llama: always +1
])
def test_config_ids_follow_the_engine_rule(trained, family_arch, expected) -> None:
    ids = config_ids_for(trained, family_arch, 8)
    assert ids == expected
    if ids is not None:
        assert S.sglang_sources(ids, S.family_of(family_arch), 8).sources == trained

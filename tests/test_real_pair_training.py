"""Training the real pair's draft from scratch, at toy size on the CPU: what a GPU run does with the
full recipe (responses, SpecForge records, TTT training, held-out accuracy, committed assets)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from hs_tracer_testbed import smollm
from hs_tracer_testbed.draft_train import DraftRecipe


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[smollm.PairRecipe, smollm.TrainSet, Path, Path]:
    """A toy recipe, six of its prompts, and one run trained from them (about 15 s)."""
    recipe = replace(smollm.default_pair_recipe(), max_new_tokens=8, generate_batch=4, profile_records=3,
                     heldout_prompts=3,
                     draft=DraftRecipe(intermediate=768, heads=9, kv_heads=3, draft_vocab=3072, ttt_steps=3,
                                       train_steps=4, batch_size=4, lr=3e-3, token_dropout=0.1))
    full = smollm.TrainSet.of(recipe)
    texts = smollm.TrainSet(full.recipe, full.prompts[:: len(full.prompts) // 6][:6], full.heldout)
    root = tmp_path_factory.mktemp("tiny-train")
    run = smollm.train_draft_dir(root / "run", smollm.ensure_target(), recipe, texts, progress=False)
    return recipe, texts, root, run


def test_a_cpu_run_is_bit_reproducible_and_reports_held_out_accuracy(tiny) -> None:
    recipe, texts, root, run = tiny
    again = smollm.train_draft_dir(root / "again", smollm.ensure_target(), recipe, texts, progress=False,
                                   cache=root / "fresh-cache")  # responses generated anew too
    weights = [(r / "draft" / "model.safetensors").read_bytes() for r in (run, again)]
    assert weights[0] == weights[1]
    info = json.loads((run / "trained.json").read_text())
    assert info["recipe_hash"] == recipe.digest() and info["trained"]["records"] == 6
    held = info["draft"]["heldout"]
    assert held["prompts"] == 3 and all(0.0 <= held[f"acc{k}"] <= 1.0 for k in (1, 2, 3))
    assert len(json.loads((run / "responses.json").read_text())["responses"]) == recipe.profile_records
    cfg = json.loads((run / "draft" / "config.json").read_text())
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 14, 26]


def test_export_refuses_a_run_of_another_recipe(tiny, tmp_path: Path) -> None:
    recipe, _, _, run = tiny
    with pytest.raises(ValueError, match=recipe.digest()):
        smollm.export_assets(run, smollm.default_pair_recipe(), dest=tmp_path / "assets")
    out = smollm.export_assets(run, recipe, dest=tmp_path / "assets")
    meta = json.loads((out / "prebuilt.json").read_text())
    assert meta["recipe_hash"] == recipe.digest() and meta["trained"]["device"] == "cpu"

"""The real-model pair's parts that need no model: its layer plan, the shift catalogue and the draft
copies that make a real engine shift, and its text domains (deterministic)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from hs_tracer import sources
from hs_tracer_testbed import miswire, realtext, smollm


def test_the_draft_config_ids_are_what_sglangs_llama_rule_feeds_as_trained() -> None:
    plan = smollm.layer_plan(30)
    assert plan["draft_config_ids"] == [1, 14, 26]  # SpecForge's default for 30 layers
    assert plan["sglang_layers_to_capture"] == [2, 15, 27]
    assert plan["sglang_fed_sources"] == plan["aux_sources"] == ["block:1", "block:14", "block:26"]


def test_every_shift_feeds_what_sglang_captures_for_its_ids() -> None:
    shifts = miswire.layer_shifts([1, 14, 26], 30)
    assert shifts["correct"]["fed"] == [1, 14, 26]
    assert shifts["all_slots_one_layer_late"]["fed"] == [2, 15, 27]
    assert shifts["deep_slots_one_layer_early"]["fed"] == [1, 13, 25]
    assert shifts["last_slot_two_layers_late"]["fed"] == [1, 14, 28]
    assert shifts["embedding_in_slot_0"]["ids"] == [-1, 1, 14]
    for v in shifts.values():
        fed = sources.sglang_sources(v["ids"], sources.Family.LLAMA, 30).sources
        assert fed == [str(sources.Source.block_output(b)) for b in v["fed"]]


def _draft(tmp: Path) -> Path:
    d = tmp / "draft"
    d.mkdir()
    cfg = {"architectures": ["LlamaForCausalLMEagle3"],
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 14, 26], "use_aux_hidden_state": True}}
    (d / "config.json").write_text(json.dumps(cfg))
    fc = torch.cat([torch.full((2, 3), float(k)) for k in range(3)], dim=1)
    save_file({"fc.weight": fc, "norm.weight": torch.ones(2)}, str(d / "model.safetensors"))
    return d


def test_a_swap_is_the_fc_blocks_permuted_with_the_ids(tmp_path: Path) -> None:
    draft = _draft(tmp_path)
    v = miswire.layer_shifts([1, 14, 26], 30)["slots_1_and_2_swapped"]
    out = miswire.write_ids_variant(draft, tmp_path / "swapped", v["ids"], v["slot_order"])
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 26, 14]
    fc = load_file(str(out / "model.safetensors"))["fc.weight"]
    assert [float(b[0, 0]) for b in fc.chunk(3, dim=1)] == [0.0, 2.0, 1.0]
    assert json.loads((draft / "config.json").read_text())["eagle_config"][
        "eagle_aux_hidden_state_layer_ids"] == [1, 14, 26]  # the original is untouched
    plain = miswire.write_ids_variant(draft, tmp_path / "late", [2, 15, 27])
    assert (plain / "model.safetensors").is_symlink()  # weights shared when only the ids change


def test_text_domains_are_deterministic_and_the_heldout_topics_apart() -> None:
    for domain in realtext.DOMAINS:
        docs = realtext.documents(domain)
        assert docs and docs == realtext.documents(domain), domain
    heldout, train = set(realtext.documents("docs_heldout")), set(realtext.documents("docs"))
    assert len(heldout & train) < len(heldout) // 10  # other topics (a few chunks, e.g. tables, recur)
    prompts = smollm.prompts(8)  # chat prompts of the training domain about held-out subjects
    assert len(prompts) == 8 and all(p.endswith("<|im_start|>assistant\n") for p in prompts)
    assert not set(realtext.documents("instruct_heldout")) & set(realtext.documents("instruct"))
    assert prompts == smollm.prompts(8)
    plain = smollm.prompts(8, domain="docs_heldout")
    assert all(0 < len(p) <= 240 for p in plain)


def test_member_prompts_ask_about_training_side_modules_only() -> None:
    members = realtext.documents("instruct_members")
    heldout_modules = [name for i, (name, _) in enumerate(realtext._module_summaries())
                       if i % realtext.HELDOUT_EVERY == realtext.HELDOUT_EVERY - 1]
    assert len(members) > 3000  # thousands of subjects: variety the draft generalises from
    asked = {p.split("What does ", 1)[1].split(" do in Python?", 1)[0] for p in members if "What does " in p}
    assert not {q for q in asked if q.rsplit(".", 1)[0] in heldout_modules}
    assert not set(members) & set(realtext.documents("instruct_heldout"))


def test_a_train_set_carries_its_recipe_and_refuses_another(tmp_path: Path) -> None:
    recipe = smollm.default_pair_recipe()
    texts = smollm.TrainSet.of(recipe)
    assert texts.prompts == smollm.train_prompts(recipe) and len(texts.heldout) == recipe.heldout_prompts
    texts.save(tmp_path / "set.json")
    back = smollm.TrainSet.load(tmp_path / "set.json")
    assert (back.prompts, back.heldout, back.pair_recipe) == (texts.prompts, texts.heldout, recipe)
    other = smollm.PairRecipe(**{**recipe.__dict__, "max_new_tokens": 8})
    try:
        smollm.train_draft_dir(tmp_path / "out", tmp_path / "no-target", other, back)
    except ValueError as exc:
        assert recipe.digest() in str(exc)
    else:
        raise AssertionError("a train set made for another recipe was accepted")
    assert not (tmp_path / "out").exists()


def test_the_pair_profile_expects_what_held_out_text_reaches(real_pair) -> None:
    """The demo's profile measures the expected acceptance on the held-out prompts' records (the
    training data overstates live text): close to the held-out teacher-forced estimate, below the
    training one."""
    from hs_tracer.profile.model import Profile
    from hs_tracer_testbed.demo import real_pair_profile

    exp = Profile.load(real_pair_profile(real_pair)).expected_acceptance
    draft = real_pair.load_manifest()["draft"]
    assert exp is not None and exp.data == "held-out" and exp.sequences == draft["heldout"]["prompts"]
    assert abs(exp.mean_accept_length - draft["heldout"]["expected_accept_length"]) < 0.3
    assert exp.mean_accept_length < draft["expected_accept_length"] - 0.3

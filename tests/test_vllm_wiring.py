"""vLLM's layer-id rules (hs_tracer.sources) and ``hs-tracer check --engine vllm`` on the config
shapes of real public EAGLE-3 drafts (tests/fixtures/vllm_drafts, listed in docs/vllm.md): what vLLM
0.32 feeds each draft, and the configs it would crash on refused with the ids to write."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hs_tracer.cli import main as cli
from hs_tracer.integrations.vllm import layer_ids as vl

FIXTURES = Path(__file__).parent / "fixtures" / "vllm_drafts"


def test_vllm_ids_mean_layer_inputs_with_n_the_last_pre_norm_state() -> None:
    cap = vl.vllm_capture([0, 4, 8], 8)
    assert cap.sources == ["embedding", "block:3", "block:7"]  # id N: the last layer, before the norm


def test_vllm_captures_each_id_once_in_layer_order() -> None:
    cap = vl.vllm_capture([7, 1, 4, 4, 9], 8)
    assert cap.captured == [1, 4, 7] and cap.duplicates == [4] and cap.unreachable == [9]


@pytest.mark.parametrize(("cfg", "ids", "key"), [
    ({}, None, vl.VLLM_DEFAULT),
    ({"eagle_aux_hidden_state_layer_ids": [1, 4, 7]}, [1, 4, 7], vl.VLLM_TOP_LEVEL),
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 5, 6]}}, [2, 5, 6], vl.VLLM_NESTED),
    # top level first
    ({"eagle_aux_hidden_state_layer_ids": [1, 4, 7],
      "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2]}}, [1, 4, 7], vl.VLLM_TOP_LEVEL),
    # DFlash counts from the other end of a layer: vLLM adds one
    ({"dflash_config": {"target_layer_ids": [0, 3, 6]}}, [1, 4, 7], vl.VLLM_DFLASH),
    # an eagle_config without ids discards the DFlash ids
    ({"dflash_config": {"target_layer_ids": [0, 3, 6]}, "eagle_config": {"use_aux_hidden_state": True}},
     None, vl.VLLM_DEFAULT),
    # an empty list is no ids
    ({"eagle_aux_hidden_state_layer_ids": []}, None, vl.VLLM_DEFAULT),
])
def test_where_vllm_reads_the_ids(cfg, ids, key) -> None:
    assert vl.vllm_configured_ids(cfg) == (ids, key)


def test_the_fc_counts_nested_ids_but_not_top_level_ones_on_the_llama_class() -> None:
    top = {"architectures": ["LlamaForCausalLMEagle3"], "eagle_aux_hidden_state_layer_ids": [1, 2, 3, 4]}
    assert vl.vllm_draft_aux_states(top) == 3
    assert vl.vllm_draft_aux_states({**top, "architectures": ["Qwen3ForCausalLM"]}) == 4  # Eagle3Qwen3
    assert vl.vllm_draft_aux_states({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2]}}) == 2
    assert vl.vllm_draft_aux_states({"eagle_config": {"use_aux_hidden_state": False}}) is None


def test_unknown_vllm_release_is_refused() -> None:
    with pytest.raises(ValueError, match="not supported"):
        vl.vllm_layer_id_rules("0.11.0")


def check(capsys, draft: Path, target: Path, *extra: str) -> tuple[int, dict]:
    code = cli(["check", "--engine", "vllm", "--draft", str(draft), "--target", str(target), "--json",
                *extra])
    return code, json.loads(capsys.readouterr().out)


# What vLLM 0.32 feeds the public drafts whose config shapes tests/fixtures/vllm_drafts holds.
PUBLIC = {
    "llama-3.1-8b-eagle3": ("default", [2, 16, 29], ["block:1", "block:15", "block:28"], "ok"),
    "llama-3.3-70b-eagle3-modelopt": (vl.VLLM_NESTED, [1, 39, 75], ["block:0", "block:38", "block:74"],
                                      "warning"),
    "qwen3-8b-eagle3": ("default", [2, 18, 33], ["block:1", "block:17", "block:32"], "ok"),
    "qwen3-8b-eagle3-speculators": (vl.VLLM_TOP_LEVEL, [2, 18, 33], ["block:1", "block:17", "block:32"],
                                    "ok"),
    "deepseek-v3-eagle3-specforge": (vl.VLLM_NESTED, [1, 29, 57], ["block:0", "block:28", "block:56"],
                                     "warning"),
}


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_check_predicts_vllms_wiring_of_public_drafts(capsys, name: str) -> None:
    key, captured, sources, status = PUBLIC[name]
    code, out = check(capsys, FIXTURES / name / "draft", FIXTURES / name / "target")
    engine = out["preflight"]["engine"]
    assert (engine["layer_ids_key"], engine["captured"], engine["sources"]) == (key, captured, sources)
    assert out["status"] == status and code == 0


def test_the_specforge_deepseek_draft_is_flagged_one_block_early(capsys) -> None:
    name = "deepseek-v3-eagle3-specforge"
    _code, out = check(capsys, FIXTURES / name / "draft", FIXTURES / name / "target")
    (f,) = [f for f in out["findings"] if f["code"] == "layer_id_convention"]
    assert f["details"]["sglang_sources"] == ["block:1", "block:29", "block:57"]
    assert '"eagle_aux_hidden_state_layer_ids": [2, 30, 58]' in f["fix"]


def _write(path: Path, cfg: dict) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def test_a_wiring_vllm_crashes_on_is_refused_with_the_fix(capsys, tmp_path: Path) -> None:
    """A 4-layer target and a draft without ids: vLLM's default (2, 2, 1) captures two states, the
    draft's fc takes three: vLLM fails at the first request."""
    target = _write(tmp_path / "t", {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 4,
                                     "hidden_size": 128, "num_attention_heads": 4, "vocab_size": 336})
    draft = _write(tmp_path / "d", {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 128,
                                    "num_attention_heads": 4, "num_hidden_layers": 1, "vocab_size": 336,
                                    "draft_vocab_size": 256})
    code, out = check(capsys, draft, target)
    assert code == 1 and out["status"] == "miswired"
    (f,) = [f for f in out["findings"] if f["code"] == "draft_input_width_mismatch"]
    assert (f["expected"], f["observed"]) == ("384", "256")
    assert "eagle_aux_hidden_state_layer_ids" in f["fix"]


def _one_block_early(tmp_path: Path):
    """`check --engine vllm` of a draft whose ids [0, 3, 6] are one block early against its training."""
    from hs_tracer.integrations.vllm.preflight import run_vllm_check

    target = _write(tmp_path / "t", {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 8,
                                     "hidden_size": 128, "num_attention_heads": 4, "vocab_size": 336})
    draft = _write(tmp_path / "d", {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 128,
                                    "num_attention_heads": 4, "num_hidden_layers": 1, "vocab_size": 336,
                                    "draft_vocab_size": 256, "eagle_aux_hidden_state_layer_ids": [0, 3, 6]})
    return run_vllm_check(draft, target, trained_sources=["block:0", "block:3", "block:6"])


def test_check_with_a_profile_names_each_slot(capsys, tmp_path: Path) -> None:
    """Ids one block early against the training provenance: each slot named (no profile file needed:
    the runner takes the trained sources)."""
    result = _one_block_early(tmp_path)
    slots = [(f.slot, f.expected, f.observed) for f in result.report.findings
             if f.code.value == "slot_source_mismatch"]
    assert slots == [(0, "block:0", "embedding"), (1, "block:3", "block:2"), (2, "block:6", "block:5")]
    assert all('"eagle_aux_hidden_state_layer_ids": [1, 4, 7]' in f.fix for f in result.report.findings
               if f.code.value == "slot_source_mismatch")


def test_check_on_vllm_names_vllms_rule_for_the_slots_it_reads_from_the_config(tmp_path: Path) -> None:
    """Each slot of `check --engine vllm` is what vLLM's layer-id rule reads from the config: the human
    output says so, in the slot's JSON too (``rule``), and never names SGLang's rule."""
    from hs_tracer.integrations.vllm.preflight import human

    result = _one_block_early(tmp_path)
    text = human(result)
    slot_lines = [line for line in text.splitlines() if line.lstrip().startswith("slot ")]
    assert len(slot_lines) == 3
    assert all("(vLLM's layer-id rule read from the config; nothing measured)" in line for line in slot_lines)
    assert "SGLang's layer-id rule" not in text
    assert [s["rule"] for s in result.report.to_json()["slots"]] == ["vLLM"] * 3


SPECULATORS_FLAGS = {"norm_before_fc": True, "fc_norm": False, "norm_output": True,
                     "norm_before_residual": True}


def test_norm_flags_are_read_as_vllm_reads_them() -> None:
    """vLLM has the ``norm_before_residual`` branch SGLang lacks (true by default in its reader of
    speculators' format) and reads a nested ``norm_before_fc`` first: a speculators checkpoint served
    as trained on vLLM is no finding there, and the one finding on SGLang names SGLang."""
    from hs_tracer import engines
    from hs_tracer.static_checks.norm_flags import check_norm_flags

    served_flags = engines.get("vllm").served_flags
    ckpt = {"speculators_model_type": "eagle3", "norm_before_fc": True, "norm_output": True}
    assert served_flags(ckpt) == SPECULATORS_FLAGS
    assert served_flags({**ckpt, "norm_before_residual": False})["norm_before_residual"] is False
    nested = {"norm_before_fc": True, "eagle_config": {"norm_before_fc": False}}
    assert served_flags(nested)["norm_before_fc"] is False
    assert check_norm_flags(ckpt, SPECULATORS_FLAGS, "vllm", "0.32.0") == []
    (f,) = check_norm_flags(ckpt, SPECULATORS_FLAGS)
    assert f.details["flag"] == "norm_before_residual" and f.message.startswith("SGLang ")
    (f,) = check_norm_flags({"norm_output": True}, {"norm_output": False}, "vllm", "0.32.0")
    assert f.message.startswith("vLLM 0.32.0 serves the draft with norm_output=true")
    assert "where vLLM reads it" in f.fix and "SGLang" not in f.message + f.fix

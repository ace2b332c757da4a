"""Weight checks (what SGLang 0.5.23 loads, drops, leaves random, rejects, replaces) and the readers."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from test_check_drafts import DRAFT_VOCAB, H, codes, draft_state, problems, specforge_draft, target_config

from hs_tracer.preflight.checkpoint import CheckpointError, read_checkpoint, select_weight_files
from hs_tracer.preflight.runner import run_check
from hs_tracer.preflight.safetensors_header import SafetensorsError, read_header, read_tensor

IDS = [1, 3, 4]


@pytest.fixture
def target(tmp_path: Path) -> Path:
    return target_config(tmp_path / "target")


def _finding(res, code: str):
    return [f for f in res.report.findings if f.code.value == code]


def test_missing_lm_head_with_draft_vocab(tmp_path: Path, target: Path) -> None:
    """F18 (sglang PR #27908): no lm_head but draft_vocab_size declared -> random head."""
    st = draft_state()
    del st["lm_head.weight"]
    res = run_check(specforge_draft(tmp_path / "bad", layer_ids=IDS, state=st), target)
    miss = _finding(res, "draft_weights_missing")
    assert miss and miss[0].severity.value == "critical" and miss[0].details["params"] == ["lm_head.weight"]
    # the same checkpoint without a declared draft vocab borrows the target head: nothing missing,
    # but then d2t (128 entries) no longer matches the 512-row head
    res2 = run_check(specforge_draft(tmp_path / "borrow", layer_ids=IDS, state=st, draft_vocab=None), target)
    assert not _finding(res2, "draft_weights_missing")
    assert codes(res2)["d2t_invalid"] == "critical"


def test_partial_qkv_is_missing(tmp_path: Path, target: Path) -> None:
    st = draft_state()
    del st["midlayer.self_attn.v_proj.weight"]
    res = run_check(specforge_draft(tmp_path / "d", layer_ids=IDS, state=st), target)
    missing = _finding(res, "draft_weights_missing")[0].details["params"]
    assert missing == ["model.layers.0.self_attn.qkv_proj.weight"]


def test_dropped_keys(tmp_path: Path, target: Path) -> None:
    st = draft_state()
    st["fc_norm.0.weight"] = torch.ones(H)  # trained with per-slot norms but the flag is not set
    st["midlayers.1.mlp.down_proj.weight"] = torch.ones(H, 8)  # a second layer the config does not declare
    st["verifier_lm_head.weight"] = torch.zeros(8, H)
    res = run_check(specforge_draft(tmp_path / "d", layer_ids=IDS, state=st), target)
    unused = _finding(res, "draft_weights_unused")
    crit = [f for f in unused if f.severity.value == "critical"]
    assert crit and set(crit[0].details["keys"]) == {"fc_norm.0.weight", "midlayers.1.mlp.down_proj.weight"}
    assert any(
        f.severity.value == "info" and f.details["keys"] == ["verifier_lm_head.weight"] for f in unused
    )


def test_fc_norm_weights_load_when_flag_set(tmp_path: Path, target: Path) -> None:
    st = draft_state()
    for i in range(3):
        st[f"fc_norm.{i}.weight"] = torch.ones(H)
    res = run_check(
        specforge_draft(tmp_path / "d", layer_ids=IDS, state=st, config_extra={"fc_norm": True}), target
    )
    assert problems(res) == []
    # legacy names (aux_norm_low/mid/high) map to fc_norm.0/1/2
    st2 = draft_state()
    for name in ("aux_norm_low", "aux_norm_mid", "aux_norm_high"):
        st2[f"{name}.weight"] = torch.ones(H)
    d2 = specforge_draft(tmp_path / "d2", layer_ids=IDS, state=st2, config_extra={"fc_norm": True})
    res2 = run_check(d2, target)
    assert problems(res2) == []


def test_fc_width_vs_aux_count(tmp_path: Path, target: Path) -> None:
    """F12: an fc trained on 4 states while SGLang builds 3 from the config."""
    res = run_check(specforge_draft(tmp_path / "bad", layer_ids=IDS, state=draft_state(n_aux=4)), target)
    widths = _finding(res, "draft_input_width_mismatch")
    assert any("[64, 256]" in f.message for f in widths)
    ok_draft = specforge_draft(tmp_path / "ok", layer_ids=[0, 1, 3, 4], state=draft_state(n_aux=4))
    ok = run_check(ok_draft, target)
    assert problems(ok) == []


def test_shape_mismatch_qkv_and_lm_head(tmp_path: Path, target: Path) -> None:
    st = draft_state()
    st["midlayer.self_attn.q_proj.weight"] = torch.zeros(64, H)  # H wide instead of 2H
    st["lm_head.weight"] = torch.zeros(DRAFT_VOCAB * 2, H)
    res = run_check(specforge_draft(tmp_path / "d", layer_ids=IDS, state=st), target)
    shapes = _finding(res, "draft_shape_mismatch")
    assert {f.details["key"] for f in shapes} == {"midlayer.self_attn.q_proj.weight", "lm_head.weight"}
    assert all(f.severity.value == "critical" for f in shapes)


def test_embedding_replaced_by_target(tmp_path: Path, target: Path) -> None:
    d = specforge_draft(tmp_path / "d", layer_ids=IDS, state=draft_state(with_embed=True))
    res = run_check(d, target)
    emb = _finding(res, "draft_weights_unused")
    assert emb and emb[0].severity.value == "info" and "replaces" in emb[0].message
    trained = specforge_draft(
        tmp_path / "t",
        layer_ids=IDS,
        state=draft_state(with_embed=True),
        config_extra={"embed_requires_grad": True},
    )
    assert _finding(run_check(trained, target), "draft_weights_unused")[0].severity.value == "warning"


def test_own_lm_head_replaced_when_no_draft_vocab(tmp_path: Path, target: Path) -> None:
    st = draft_state(draft_vocab=512)
    st["d2t"] = torch.zeros(512, dtype=torch.int64)
    st["t2d"] = torch.ones(512, dtype=torch.bool)
    res = run_check(specforge_draft(tmp_path / "d", layer_ids=IDS, state=st, draft_vocab=None), target)
    assert any("replaces it with the target's lm_head" in f.message for f in res.report.findings)


def test_specforge_and_speculators_key_names_both_load(tmp_path: Path, target: Path) -> None:
    for prefix in ("midlayer", "layers.0", "model.layers.0"):
        d = specforge_draft(tmp_path / prefix, layer_ids=IDS, state=draft_state(prefix=prefix))
        res = run_check(d, target)
        assert problems(res) == [], prefix


# ---- readers ---------------------------------------------------------------------------------


def test_header_reader_reads_names_shapes_and_small_tensors(tmp_path: Path) -> None:
    st = {
        "a": torch.arange(10, dtype=torch.int64),
        "b": torch.ones(3, 4, dtype=torch.bfloat16),
        "m": torch.tensor([True, False, True]),
    }
    save_file(st, str(tmp_path / "x.safetensors"), metadata={"format": "pt"})
    entries, meta = read_header(tmp_path / "x.safetensors")
    assert meta == {"format": "pt"}
    assert {k: e.shape for k, e in entries.items()} == {"a": (10,), "b": (3, 4), "m": (3,)}
    assert read_tensor(entries["a"]).tolist() == list(range(10))
    assert read_tensor(entries["m"]).tolist() == [True, False, True]
    with pytest.raises(SafetensorsError):
        read_tensor(entries["b"])  # bf16 is never read


def test_header_reader_rejects_garbage(tmp_path: Path) -> None:
    (tmp_path / "bad.safetensors").write_bytes(struct.pack("<Q", 10) + b"not json!!")
    with pytest.raises(SafetensorsError):
        read_header(tmp_path / "bad.safetensors")


def test_weight_file_selection_follows_sglang(tmp_path: Path) -> None:
    d = tmp_path / "d"
    d.mkdir()
    save_file({"x": torch.zeros(1)}, str(d / "model.safetensors"))
    torch.save({"x": torch.zeros(1)}, d / "training_state.pt")
    assert [p.name for p in select_weight_files(d)] == ["model.safetensors"]
    save_file({"y": torch.zeros(1)}, str(d / "stale.safetensors"))
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "model.safetensors"}}))
    assert [p.name for p in select_weight_files(d)] == ["model.safetensors"]


def test_bin_draft_read_with_weights_only(tmp_path: Path, target: Path) -> None:
    d = specforge_draft(tmp_path / "d", layer_ids=IDS)
    state = {k: v for k, v in read_safetensors(d / "model.safetensors").items()}
    (d / "model.safetensors").unlink()
    torch.save(state, d / "pytorch_model.bin")
    res = run_check(d, target)
    assert problems(res) == []
    assert res.summary["draft"]["weight_files"] == ["pytorch_model.bin"]


def test_legacy_torch_save_format_is_read(tmp_path: Path) -> None:
    d = tmp_path / "d"
    d.mkdir()
    torch.save(
        {"d2t": torch.zeros(4, dtype=torch.int64), "fc.weight": torch.zeros(2, 6)},
        d / "pytorch_model.bin",
        _use_new_zipfile_serialization=False,
    )
    ckpt = read_checkpoint(d)
    assert ckpt.shapes == {"d2t": (4,), "fc.weight": (2, 6)} and ckpt.load_small("d2t").tolist() == [0] * 4


def test_pickled_objects_are_refused(tmp_path: Path) -> None:
    d = tmp_path / "d"
    d.mkdir()
    torch.save({"w": torch.zeros(1), "obj": Path("x")}, d / "pytorch_model.bin")  # not weights-only
    with pytest.raises(CheckpointError, match="weights_only=True"):
        read_checkpoint(d)


def test_no_weights_is_an_input_error(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    with pytest.raises(CheckpointError, match="Cannot find any model weights"):
        read_checkpoint(tmp_path / "d")


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def test_kimi_mla_draft(tmp_path: Path) -> None:
    """The Kimi MLA draft class: clean passes; no lm_head and a lone q_a/kv_a half are caught."""
    from test_check_drafts import mla_draft, mla_state

    target = target_config(tmp_path / "t", arch="KimiK25ForConditionalGeneration")
    assert problems(run_check(mla_draft(tmp_path / "ok"), target)) == []
    st = mla_state()
    del st["lm_head.weight"]
    del st["layers.0.self_attn.kv_a_proj_with_mqa.weight"]
    res = run_check(mla_draft(tmp_path / "bad", state=st), target)
    assert set(_finding(res, "draft_weights_missing")[0].details["params"]) == {
        "lm_head.weight",
        "model.midlayer.self_attn.fused_qkv_a_proj_with_mqa.weight",
    }
    # MLA counts top-level ids for its fc (LlamaForCausalLMEagle3 does not), but the target still
    # captures only the nested ids: 3 states sent to a 4-state fc
    top4 = mla_draft(
        tmp_path / "top4",
        layer_ids=None,
        state=mla_state(n_aux=4),
        config_extra={"eagle_aux_hidden_state_layer_ids": [0, 1, 3, 4]},
    )
    res4 = run_check(top4, target)
    assert not _finding(res4, "draft_shape_mismatch")
    assert any("fc takes 256" in f.message for f in _finding(res4, "draft_input_width_mismatch"))

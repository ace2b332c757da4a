"""Draft format and config-flag checks: each with a failing and a passing draft."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_check_drafts import codes, eagle_draft, problems, specforge_draft, speculators_draft, target_config

from hs_tracer.preflight.config import DraftFormat, detect_format, read_draft_config
from hs_tracer.preflight.runner import run_check


def _edit(path: Path, **changes: object) -> None:
    cfg_file = path / "config.json"
    cfg = json.loads(cfg_file.read_text())
    for key, value in changes.items():
        if value is KeyError:
            del cfg[key]
        else:
            cfg[key] = value
    cfg_file.write_text(json.dumps(cfg, indent=2))


@pytest.fixture
def target(tmp_path: Path) -> Path:
    return target_config(tmp_path / "target")


def test_formats_are_told_apart(tmp_path: Path) -> None:
    sf = specforge_draft(tmp_path / "sf", layer_ids=[1, 3, 4])
    assert read_draft_config(sf).format is DraftFormat.SGLANG
    assert read_draft_config(speculators_draft(tmp_path / "sp")).format is DraftFormat.SPECULATORS
    assert read_draft_config(eagle_draft(tmp_path / "eg")).format is DraftFormat.EAGLE
    assert detect_format({"architectures": ["LlamaForCausalLMEagle"]}) is DraftFormat.EAGLE1
    assert detect_format({"architectures": ["Qwen3ForCausalLM"]}) is DraftFormat.UNKNOWN
    assert detect_format({"architectures": ["Eagle3DraftModel"]}) is DraftFormat.SPECULATORS


def test_speculators_draft_needs_conversion(tmp_path: Path, target: Path) -> None:
    res = run_check(speculators_draft(tmp_path / "sp", layer_ids=[2, 4, 5]), target)
    fmt = [f for f in res.report.findings if f.code.value == "draft_format"]
    assert len(fmt) == 1 and fmt[0].severity.value == "critical" and "speculators" in fmt[0].message
    # its top-level ids are ignored by SGLang; here they name the default layers, so only a warning,
    # and the fix names the SGLang draft-config ids for the same layers
    ignored = [f for f in res.report.findings if f.code.value == "layer_ids_ignored"]
    assert ignored and ignored[0].severity.value == "warning"
    assert "[1, 3, 4]" in ignored[0].fix
    # the speculators weights (layers.0.*, embed_tokens) themselves load in SGLang 0.5.23
    assert "draft_weights_missing" not in codes(res)
    assert res.report.exit_code == 1


def test_original_eagle_architecture(tmp_path: Path, target: Path) -> None:
    res = run_check(eagle_draft(tmp_path / "eg"), target)
    f = next(f for f in res.report.findings if f.code.value == "draft_format")
    assert f.severity.value == "critical" and "LlamaForCausalLMEagle3" in f.fix


def test_unknown_and_eagle1_architectures(tmp_path: Path, target: Path) -> None:
    for arch in ("LlamaForCausalLMEagle", "MysteryDraft"):
        d = specforge_draft(tmp_path / arch, layer_ids=[1, 3, 4])
        _edit(d, architectures=[arch])
        res = run_check(d, target)
        assert codes(res)["draft_format"] == "critical", arch


def test_missing_draft_vocab_size_key(tmp_path: Path, target: Path) -> None:
    d = specforge_draft(tmp_path / "d", layer_ids=[1, 3, 4])
    _edit(d, draft_vocab_size=KeyError)
    res = run_check(d, target)
    assert any(
        "draft_vocab_size" in f.message and f.severity.value == "critical" for f in res.report.findings
    )


def test_norm_before_residual_is_not_honoured(tmp_path: Path, target: Path) -> None:
    bad = specforge_draft(tmp_path / "bad", layer_ids=[1, 3, 4], config_extra={"norm_before_residual": True})
    good = specforge_draft(
        tmp_path / "good", layer_ids=[1, 3, 4], config_extra={"norm_before_residual": False}
    )
    assert any("norm_before_residual" in f.message for f in run_check(bad, target).report.findings)
    assert problems(run_check(good, target)) == []


def test_top_level_only_flags_inside_eagle_config(tmp_path: Path, target: Path) -> None:
    nested = {"eagle_aux_hidden_state_layer_ids": [1, 3, 4], "norm_output": True}
    bad = specforge_draft(tmp_path / "bad", eagle_config=nested)
    res = run_check(bad, target)
    assert any("norm_output" in f.message and f.code.value == "draft_format" for f in res.report.findings)
    good = specforge_draft(tmp_path / "good", layer_ids=[1, 3, 4], config_extra={"norm_output": True})
    assert problems(run_check(good, target)) == []


def test_target_hidden_size_null(tmp_path: Path, target: Path) -> None:
    bad = specforge_draft(tmp_path / "bad", layer_ids=[1, 3, 4], config_extra={"target_hidden_size": None})
    assert any("target_hidden_size is null" in f.message for f in run_check(bad, target).report.findings)
    good = specforge_draft(tmp_path / "good", layer_ids=[1, 3, 4], config_extra={"target_hidden_size": 64})
    assert problems(run_check(good, target)) == []


def test_tied_head_with_reduced_vocab(tmp_path: Path, target: Path) -> None:
    bad = specforge_draft(tmp_path / "bad", layer_ids=[1, 3, 4], config_extra={"tie_word_embeddings": True})
    assert any("tie_word_embeddings" in f.message for f in run_check(bad, target).report.findings)


def test_known_draft_architectures_match_installed_sglang() -> None:
    """The architecture lists in preflight/config.py are SGLang 0.5.23's registered EAGLE draft classes."""
    import importlib.util
    import re

    from hs_tracer.preflight.config import SGLANG_EAGLE3_DRAFT_ARCHS, SGLANG_EAGLE_DRAFT_ARCHS

    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.submodule_search_locations
    models = Path(next(iter(spec.submodule_search_locations))) / "srt" / "models"
    registered: set[str] = set()
    for path in models.glob("*.py"):
        for m in re.finditer(r"^EntryClass\s*=\s*\[?([^\]\n]*)", path.read_text(), re.M):
            registered |= {n.strip() for n in m.group(1).split(",") if n.strip()}
    eagle = {n for n in registered if "Eagle" in n}
    assert {n for n in eagle if "Eagle3" in n} == SGLANG_EAGLE3_DRAFT_ARCHS
    assert {n for n in eagle if "Eagle3" not in n} == SGLANG_EAGLE_DRAFT_ARCHS


def test_mla_draft_has_no_input_norm(tmp_path: Path) -> None:
    from test_check_drafts import mla_draft

    target = target_config(tmp_path / "t", arch="DeepseekV3ForCausalLM")
    bad = mla_draft(tmp_path / "bad", config_extra={"norm_before_fc": True})
    assert any("norm_before_fc" in f.message for f in run_check(bad, target).report.findings)
    assert problems(run_check(mla_draft(tmp_path / "ok"), target)) == []

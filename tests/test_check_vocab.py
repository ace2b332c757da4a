"""d2t / t2d invariants, on arrays and end to end on checkpoints written as SpecForge writes them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from test_check_drafts import (
    DRAFT_VOCAB,
    VOCAB,
    codes,
    draft_state,
    problems,
    specforge_draft,
    target_config,
    vocab_mapping,
)

from hs_tracer.preflight.runner import run_check
from hs_tracer.preflight.vocab_map import check_vocab_mapping

D2T, T2D = (t.numpy() for t in vocab_mapping())


def _codes(findings) -> list[tuple[str, str]]:
    return [(f.code.value, f.severity.value) for f in findings]


def test_specforge_mapping_is_clean() -> None:
    assert check_vocab_mapping(D2T, T2D, DRAFT_VOCAB, VOCAB) == []


def test_full_vocab_all_zero_d2t_is_identity_and_fine() -> None:
    """EAGLE issue #222: all-zero d2t with draft vocab == vocab (Vicuna) is correct."""
    assert check_vocab_mapping(np.zeros(VOCAB, np.int64), np.ones(VOCAB, bool), VOCAB, VOCAB) == []


@pytest.mark.parametrize("case, d2t, t2d, words", [
    ("missing with reduced vocab", None, None, "no d2t"),
    ("all zeros with reduced vocab", np.zeros(DRAFT_VOCAB, np.int64), None, "all zeros"),
    ("arange instead of diffs", np.arange(DRAFT_VOCAB), None, "2*i"),
    ("absolute ids (t2d agrees with d2t)", np.flatnonzero(T2D), T2D, "absolute"),
    ("absolute ids overflowing", np.arange(DRAFT_VOCAB) * 3 + 100, None, "absolute"),
    ("out of range", np.full(DRAFT_VOCAB, VOCAB), None, "outside"),
    ("wrong length", D2T[:-8], T2D, "len(d2t)"),
    ("float dtype", D2T.astype(np.float32), T2D, "dtype"),
    ("t2d for another vocab", D2T, np.concatenate([T2D, np.zeros(8, bool)]), "another tokenizer"),
    ("t2d disagrees", D2T, np.roll(T2D, 1), "disagree"),
])
def test_broken_mappings_are_critical(case: str, d2t, t2d, words: str) -> None:
    findings = check_vocab_mapping(d2t, t2d, DRAFT_VOCAB, VOCAB)
    crit = [f for f in findings if f.severity.value == "critical"]
    assert crit and all(f.code.value == "d2t_invalid" for f in crit), case
    assert words in " ".join(f.message for f in crit), (case, [f.message for f in crit])


def test_duplicate_targets_warn() -> None:
    d2t = D2T.copy()
    d2t[5] = d2t[4] - 1  # draft ids 4 and 5 map to the same target id
    assert ("d2t_invalid", "warning") in _codes(check_vocab_mapping(d2t, None, DRAFT_VOCAB, VOCAB))


def _with(**replace: torch.Tensor | None) -> dict[str, torch.Tensor]:
    st = draft_state()
    for k, v in replace.items():
        if v is None:
            del st[k]
        else:
            st[k] = v
    return st


def test_end_to_end_through_checkpoints(tmp_path: Path) -> None:
    target = target_config(tmp_path / "t")
    absolute = torch.tensor(np.flatnonzero(T2D), dtype=torch.int64)
    cases = {
        "absolute": _with(d2t=absolute),
        "side_file_only": _with(d2t=None, t2d=None),  # mapping kept in vocab_mapping.pt: never read
        "zeros": _with(d2t=torch.zeros(DRAFT_VOCAB, dtype=torch.int64)),
    }
    for name, st in cases.items():
        d = specforge_draft(tmp_path / name, layer_ids=[1, 3, 4], state=st)
        if name == "side_file_only":
            (d / "vocab_mapping").mkdir()
            torch.save({"d2t": torch.tensor(D2T), "t2d": torch.tensor(T2D)},
                       d / "vocab_mapping" / "vocab_mapping.pt")
        res = run_check(d, target)
        assert codes(res).get("d2t_invalid") == "critical", name
        assert res.report.status == "miswired" and res.report.exit_code == 1
    ok = run_check(specforge_draft(tmp_path / "ok", layer_ids=[1, 3, 4]), target)
    assert problems(ok) == []


def test_target_vocab_mismatch(tmp_path: Path) -> None:
    target = target_config(tmp_path / "t", vocab=VOCAB + 64)
    res = run_check(specforge_draft(tmp_path / "d", layer_ids=[1, 3, 4]), target)
    assert codes(res)["d2t_invalid"] == "critical"  # t2d built for a 512-token vocabulary
    assert codes(res)["draft_shape_mismatch"] == "warning"  # the draft config's vocab_size differs

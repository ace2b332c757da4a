"""Serving args: parsing, the values SGLang 0.5.23 will use, refusals (the mirror; the comparison with
SGLang's own resolution pipeline is in test_check_sglang_real.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_check_drafts import codes, specforge_draft, target_config

from hs_tracer.findings import Severity
from hs_tracer.preflight.runner import run_check
from hs_tracer.preflight.spec_args import ServerArgsError, parse_server_args, resolve_spec_args, spec_findings


def test_parse_whole_command_line() -> None:
    got = parse_server_args(
        "python -m sglang.launch_server --model-path /m --tp 8 --speculative-algorithm eagle3 "
        "--speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4 "
        "--speculative-draft-model-path /d --mem-fraction-static 0.8"
    )
    assert got["speculative_algorithm"] == "eagle3" and got["speculative_num_steps"] == 3
    assert got["speculative_eagle_topk"] == 1 and got["speculative_num_draft_tokens"] == 4
    assert got["speculative_adaptive"] is False


def test_parse_errors() -> None:
    with pytest.raises(ServerArgsError):
        parse_server_args("--speculative-num-steps three")
    with pytest.raises(ServerArgsError):
        parse_server_args("--speculative-algorithm 'EAGLE3")


def test_topk1_forces_draft_tokens() -> None:
    res = resolve_spec_args(
        {
            "speculative_algorithm": "EAGLE3",
            "speculative_num_steps": 1,
            "speculative_eagle_topk": 1,
            "speculative_num_draft_tokens": 5,
        },
        "LlamaForCausalLM",
    )
    assert res.used()["speculative_num_draft_tokens"] == 2 and res.rejected is None
    f = spec_findings(res)
    assert [x.severity for x in f] == [Severity.WARNING] and f[0].expected == "5" and f[0].observed == "2"


def test_auto_params_by_target() -> None:
    assert (
        resolve_spec_args({"speculative_algorithm": "EAGLE3"}, "LlamaForCausalLM").used()[
            "speculative_num_steps"
        ]
        == 5
    )
    ds = resolve_spec_args({"speculative_algorithm": "EAGLE3"}, "DeepseekV3ForCausalLM")
    assert (ds.num_steps, ds.topk, ds.num_draft_tokens) == (3, 1, 4)
    assert [x.severity for x in spec_findings(ds)] == [Severity.INFO]


def test_refusals() -> None:
    # topk without steps: SGLang asserts
    assert resolve_spec_args({"speculative_algorithm": "EAGLE3", "speculative_eagle_topk": 4}, "X").rejected
    # rejection sampling needs topk 1
    assert resolve_spec_args(
        {
            "speculative_algorithm": "EAGLE3",
            "speculative_num_steps": 2,
            "speculative_eagle_topk": 2,
            "speculative_num_draft_tokens": 4,
            "speculative_use_rejection_sampling": True,
        },
        "X",
    ).rejected
    # more draft tokens than tree candidates: torch.topk raises at the first decode
    over = resolve_spec_args(
        {
            "speculative_algorithm": "EAGLE3",
            "speculative_num_steps": 1,
            "speculative_eagle_topk": 2,
            "speculative_num_draft_tokens": 8,
        },
        "X",
    )
    assert over.rejected and "candidates" in over.rejected
    assert spec_findings(over)[0].severity is Severity.CRITICAL
    fits = resolve_spec_args(
        {
            "speculative_algorithm": "EAGLE3",
            "speculative_num_steps": 2,
            "speculative_eagle_topk": 2,
            "speculative_num_draft_tokens": 7,
        },
        "X",
    )
    assert fits.rejected is None and spec_findings(fits) == []


def test_nextn_is_eagle_and_adaptive() -> None:
    assert resolve_spec_args({"speculative_algorithm": "NEXTN"}, "X").algorithm == "EAGLE"
    ad = resolve_spec_args({"speculative_algorithm": "EAGLE3", "speculative_adaptive": True}, "X")
    assert ad.topk == 1 and ad.rejected is None


def test_through_run_check(tmp_path: Path) -> None:
    target = target_config(tmp_path / "t")
    draft = specforge_draft(tmp_path / "d", layer_ids=[1, 3, 4])
    eagle = run_check(draft, target, server_args=parse_server_args("--speculative-algorithm EAGLE"))
    assert codes(eagle)["draft_input_width_mismatch"] == "critical"
    # rejection sampling with a reduced draft vocabulary: SGLang refuses at startup
    rs = run_check(
        draft,
        target,
        server_args=parse_server_args(
            "--speculative-algorithm EAGLE3 --speculative-num-steps 3 --speculative-eagle-topk 1 "
            "--speculative-num-draft-tokens 4 --speculative-use-rejection-sampling"
        ),
    )
    assert any("share one vocabulary" in f.message for f in rs.report.findings)
    clean = run_check(
        draft,
        target,
        server_args=parse_server_args(
            "--speculative-algorithm EAGLE3 --speculative-num-steps 3 --speculative-eagle-topk 1 "
            "--speculative-num-draft-tokens 4"
        ),
    )
    # nothing but the note that no profile was given (so the ids were not compared with training)
    assert [f.code.value for f in clean.report.findings] == ["insufficient_data"]
    assert clean.summary["engine"]["spec_args"]["speculative_num_steps"] == 3

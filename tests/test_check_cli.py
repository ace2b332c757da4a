"""``hs-tracer check`` end to end: the testbed draft (clean) and variants of it, human and JSON output,
exit codes, and ``--profile`` with a profile built from the testbed's SpecForge training data."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from test_check_drafts import specforge_draft, target_config

from hs_tracer.cli import main
from hs_tracer_testbed import build as tb


@pytest.fixture(scope="module")
def testbed() -> tb.TestbedPaths:
    """The small testbed for the variants: builds in seconds, cached."""
    return tb.ensure_testbed(recipe=tb.Recipe.small(), progress=False)


@pytest.fixture(scope="module")
def full_testbed() -> tb.TestbedPaths:
    """The testbed itself (default recipe): built once into the shared cache, also used by other tests."""
    return tb.ensure_testbed(progress=False)


def _build_profile(testbed: tb.TestbedPaths, out: Path) -> Path:
    """A reference profile of the testbed draft's training data, built by hs_tracer's profile builder."""
    from hs_tracer.profile.build import build_profile, ids_from_draft, open_dump, read_target

    dump = open_dump(
        testbed.specforge_data, ids=ids_from_draft(testbed.draft), target=read_target(testbed.target)
    )
    return build_profile([dump], progress=False).save(out)


@pytest.fixture(scope="module")
def profile(testbed: tb.TestbedPaths, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build_profile(testbed, tmp_path_factory.mktemp("profile") / "ref.profile")


def _variant(testbed: tb.TestbedPaths, dst: Path, **config: object) -> Path:
    """The testbed draft with its config.json changed (weights shared)."""
    shutil.copytree(testbed.draft, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(config)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(["check", *map(str, argv)])
    out = capsys.readouterr()
    return code, out.out + out.err


def test_testbed_draft_passes_clean(
    full_testbed: tb.TestbedPaths, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    profile = _build_profile(full_testbed, tmp_path / "ref.profile")
    code, out = run_cli(
        capsys,
        "--draft",
        full_testbed.draft,
        "--target",
        full_testbed.target,
        "--profile",
        profile,
        "--json",
        "--server-args",
        "--speculative-algorithm EAGLE3 --speculative-num-steps 3 --speculative-eagle-topk 1 "
        "--speculative-num-draft-tokens 4",
    )
    assert code == 0, out
    report = json.loads(out)
    assert report["status"] == "ok"
    assert report["findings"] == []
    assert set(report) >= {"status", "slots", "acceptance", "findings", "preflight"}
    assert [(s["expected_source"], s["observed_source"]) for s in report["slots"]] == [
        ("block:1", "block:1"),
        ("block:3", "block:3"),
        ("block:4", "block:4"),
    ]
    assert report["preflight"]["target"]["family"] == "deepseek"


def test_human_output_leads_with_one_block_per_root_cause(
    testbed: tb.TestbedPaths, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The cause and its fix first; the findings under it only with --verbose (always in the JSON)."""
    args = ("--draft", testbed.draft, "--target", testbed.target / "config.json", "--server-args",
            "--speculative-algorithm EAGLE --speculative-num-steps 3 "
            "--speculative-eagle-topk 1 --speculative-num-draft-tokens 4")
    code, out = run_cli(capsys, *args)
    assert code == 1
    first, second = out.splitlines()[:2]
    assert first.startswith("[critical] root cause: --speculative-algorithm EAGLE")
    assert second.startswith("  fix: ")
    assert "draft_input_width_mismatch" not in out and "status: miswired" in out
    code, verbose = run_cli(capsys, *args, "--verbose")
    assert code == 1 and verbose.splitlines()[:2] == [first, second]
    (finding,) = [x for x in verbose.splitlines() if "[critical] draft_input_width_mismatch" in x]
    assert finding.startswith("  - ") and "fix:" in finding
    assert verbose.index(finding) < verbose.index("status: miswired")


def test_variant_ids_shift_against_profile(
    testbed: tb.TestbedPaths, profile: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The testbed target is DeepSeek-V3: [0,3,4] are taken as-is -> embedding, block 2, block 3."""
    variant = _variant(
        testbed,
        tmp_path / "shifted",
        eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 3, 4], "use_aux_hidden_state": True},
    )
    code, out = run_cli(
        capsys, "--draft", variant, "--target", testbed.target, "--profile", profile, "--json",
        "--sglang-version", "0.5.23",
    )
    assert code == 1
    report = json.loads(out)
    assert report["status"] == "miswired"
    assert report["preflight"]["engine"]["name"] == "sglang==0.5.23"
    mism = [
        (f["slot"], f["expected"], f["observed"])
        for f in report["findings"]
        if f["code"] == "layer_id_convention" and "slot" in f and f["severity"] == "critical"
    ]
    assert mism == [(0, "block:1", "embedding"), (1, "block:3", "block:2"), (2, "block:4", "block:3")]
    assert any("[1, 3, 4]" in f["fix"] for f in report["findings"] if f["code"] == "layer_id_convention")


def test_variant_ids_shift_on_an_older_release(
    testbed: tb.TestbedPaths, profile: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """SGLang 0.5.12 adds 1 to every DeepSeek id: the same [0,3,4] feed block 0, 3, 4 there."""
    variant = _variant(
        testbed,
        tmp_path / "shifted",
        eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 3, 4], "use_aux_hidden_state": True},
    )
    code, out = run_cli(
        capsys, "--draft", variant, "--target", testbed.target, "--profile", profile, "--json",
        "--sglang-version", "0.5.12",
    )
    assert code == 1
    report = json.loads(out)
    assert report["preflight"]["engine"]["name"] == "sglang==0.5.12"
    assert report["preflight"]["engine"]["support"] == \
        "sglang 0.5.12: supported, tested (release family 0.5.12)"
    assert report["preflight"]["engine"]["layers_to_capture"] == [1, 4, 5]
    mism = [
        (f["slot"], f["expected"], f["observed"])
        for f in report["findings"]
        if f["code"] == "layer_id_convention" and "slot" in f and f["severity"] == "critical"
    ]
    assert mism == [(0, "block:1", "block:0")]
    assert any("[1, 3, 4]" in f["fix"] for f in report["findings"] if f["code"] == "layer_id_convention")
    # the first-id warning belongs to releases with that rule only
    assert not any("only when the first id is 1" in f["message"] for f in report["findings"])


@pytest.mark.parametrize("version", ["0.5.13", "0.5.13.post1", "0.5.14"])
def test_a_captured_layer_0_is_refused_where_sglangs_deepseek_loop_crashes_on_it(
    testbed: tb.TestbedPaths, profile: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    version: str,
) -> None:
    """[0,3,4] on the DeepSeek-V3 testbed target make SGLang capture layer 0: 0.5.13's model loop adds
    the (still None) residual to it and fails at the first forward; 0.5.14 captures inside the layer."""
    variant = _variant(
        testbed,
        tmp_path / "shifted",
        eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 3, 4], "use_aux_hidden_state": True},
    )
    code, out = run_cli(capsys, "--draft", variant, "--target", testbed.target, "--profile", profile,
                        "--json", "--sglang-version", version)
    assert code == 1  # the slots are miswired on every release
    report = json.loads(out)
    assert report["preflight"]["engine"]["layers_to_capture"] == [0, 3, 4]
    raises = [f for f in report["findings"] if f["code"] == "capture_raises"]
    if version == "0.5.14":
        assert raises == []
        return
    (finding,) = raises
    assert finding["severity"] == "critical"
    assert f"SGLang {version} will crash at the first forward" in finding["message"]
    assert "0.5.14 or newer" in finding["fix"] and "layer 0" in finding["fix"]
    # it leads: serving this config kills the server before any layer question matters
    first = report["root_causes"][0]
    assert first["cause"] == "capture_raises" and first["fix"] == finding["fix"]
    # the per-slot fix names ids that feed the trained layers without capturing layer 0
    assert any("[1, 3, 4]" in f["fix"] for f in report["findings"] if f["code"] == "layer_id_convention")


@pytest.mark.parametrize(("version", "exit_code"), [("0.5.13", 1), ("0.5.14", 0)])
def test_the_default_ids_of_a_three_layer_deepseek_target_crash_0_5_13_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], version: str, exit_code: int
) -> None:
    """No ids on a 3-layer target: SGLang's default [2, N//2, N-3] = [2, 1, 0] captures layer 0, the
    embedding: a warning on 0.5.14, a crash at the first forward on 0.5.13."""
    target = target_config(tmp_path / "target", arch="DeepseekV3ForCausalLM", layers=3)
    draft = specforge_draft(tmp_path / "draft", layer_ids=None, eagle_config=None)
    code, out = run_cli(capsys, "--draft", draft, "--target", target, "--sglang-version", version)
    assert code == exit_code, out
    assert ("[critical] root cause: SGLang 0.5.13 will crash at the first forward" in out) == (
        version == "0.5.13")
    assert "embedding" in out


def test_variant_top_level_ids(
    testbed: tb.TestbedPaths, profile: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ids moved to the top level (speculators style): ignored; SGLang's default happens to match here."""
    variant = _variant(
        testbed, tmp_path / "top", eagle_config=None, eagle_aux_hidden_state_layer_ids=[1, 3, 4]
    )
    code, out = run_cli(
        capsys, "--draft", variant, "--target", testbed.target, "--profile", profile, "--json"
    )
    report = json.loads(out)
    ignored = [f for f in report["findings"] if f["code"] == "layer_ids_ignored"]
    # [1,3,4] read as C_in would be other layers, but what SGLang serves is what the profile trained on:
    # a latent fault, a warning that says when it bites
    assert ignored and ignored[0]["severity"] == "warning" and "bites" in ignored[0]["message"]
    assert report["preflight"]["engine"]["sources"] == ["block:1", "block:3", "block:4"]
    assert code == 0 and report["status"] == "warning"
    code, _ = run_cli(capsys, "--draft", variant, "--target", testbed.target)
    assert code == 1  # without the profile, the ids in their producer's convention are the evidence


def test_usage_errors_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = target_config(tmp_path / "t")
    (tmp_path / "empty").mkdir()
    code, out = run_cli(capsys, "--draft", tmp_path / "empty", "--target", target)
    assert code == 2 and "config.json" in out
    draft = specforge_draft(tmp_path / "d", layer_ids=[1, 3, 4])
    code, out = run_cli(capsys, "--draft", draft, "--target", target, "--engine", "vllm==0.11")
    assert code == 2 and "not supported" in out
    code, out = run_cli(capsys, "--draft", draft, "--target", target, "--sglang-version", "0.5.8")
    assert code == 2 and "has not read SGLang 0.5.8" in out
    code, out = run_cli(capsys, "--draft", draft, "--target", target, "--engine", "sglang==0.5.12",
                        "--sglang-version", "0.5.23")
    assert code == 2 and "disagree" in out
    code, out = run_cli(capsys, "--draft", draft, "--target", target, "--profile", tmp_path / "nope.profile")
    assert code == 2 and "profile" in out
    code, out = run_cli(
        capsys, "--draft", draft, "--target", target, "--server-args", "--speculative-num-steps x"
    )
    assert code == 2


def test_profile_from_another_target(
    testbed: tb.TestbedPaths, profile: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # a profile of another model judges nothing here: one line naming it, no finding about the draft
    other = target_config(tmp_path / "other", arch="DeepseekV3ForCausalLM", layers=12, hidden=32, vocab=336)
    code, out = run_cli(capsys, "--draft", testbed.draft, "--target", other, "--profile", profile, "--json")
    assert code == 2 and out.count("\n") == 1, out
    assert "the profile is of another model (" in out and "layers, this model has 12" in out
    assert "use the profile built for this target's training data" in out

"""Layer-id conventions, case by case from the tools' own code (SpecForge, speculators, vLLM, SGLang
0.5.23's per-family capture rule), plus the real SGLang 0.5.23 family rules."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hs_tracer.integrations.sglang.releases import NEWEST_RELEASE, layer_id_rules
from hs_tracer.sources import (
    EMBEDDING,
    FINAL_NORM,
    Convention,
    Family,
    Source,
    all_sources,
    default_ids,
    family_of,
    from_sources,
    id_to_source,
    sglang_capture,
    sglang_layers_to_capture,
    sglang_sources,
    source_sort_key,
    text_config,
    to_sources,
)


def blocks(*js: int) -> list[str]:
    return [f"block:{j}" for j in js]


# --- canonical names ---------------------------------------------------------------------------------


def test_source_parse_format_roundtrip_and_order() -> None:
    names = ["final_norm", "block:10", "embedding", "block:2", "block:0"]
    parsed = [Source.parse(n) for n in names]
    assert [str(s) for s in parsed] == names
    assert [str(s) for s in sorted(parsed)] == ["embedding", "block:0", "block:2", "block:10", "final_norm"]
    assert sorted(names, key=source_sort_key) == ["embedding", "block:0", "block:2", "block:10", "final_norm"]
    assert Source.block_output(-1) == Source.embedding()
    assert all_sources(3) == ["embedding", "block:0", "block:1", "block:2", "final_norm"]


@pytest.mark.parametrize("bad", ["block:-1", "block:x", "layer:3", "Block:1", "", "block:"])
def test_source_parse_rejects(bad: str) -> None:
    with pytest.raises(ValueError, match="canonical source"):
        Source.parse(bad)


def test_convention_parse_names_the_choices() -> None:
    assert Convention.parse("SpecForge") is Convention.SPECFORGE
    assert Convention.parse("sglang-draft-config") is Convention.SGLANG_DRAFT_CONFIG
    with pytest.raises(ValueError, match="specforge"):
        Convention.parse("c_out")


# --- the two default triples select the same tensors ------------------------------------------------


@pytest.mark.parametrize(
    ("model", "n", "c_out", "c_in"),
    [
        ("Llama-3.1-8B", 32, [1, 15, 28], [2, 16, 29]),
        ("Qwen3-8B", 36, [1, 17, 32], [2, 18, 33]),
        ("DeepSeek-V3 / Kimi-K2", 61, [1, 29, 57], [2, 30, 58]),
        ("Qwen3-235B", 94, [1, 46, 90], [2, 47, 91]),
    ],
)
def test_default_triples(model: str, n: int, c_out: list[int], c_in: list[int]) -> None:
    assert default_ids(Convention.SPECFORGE, n) == c_out
    for conv in (Convention.SPECULATORS, Convention.VLLM, Convention.EAGLE, Convention.SGLANG_CAPTURE):
        assert default_ids(conv, n) == c_in
    expected = blocks(*c_out)
    assert to_sources(c_out, "specforge", n) == expected
    for conv in ("speculators", "vllm", "eagle", "sglang_capture"):
        assert to_sources(c_in, conv, n) == expected
        assert to_sources(None, conv, n) == expected
    assert to_sources(None, "specforge", n) == expected
    for fam in Family:
        if fam is not Family.PLUS_ONE_ALWAYS:
            assert to_sources(None, "sglang_draft_config", n, family=fam) == expected
            assert to_sources(c_out, "sglang_draft_config", n, family=fam) == expected
    assert from_sources(expected, "specforge", n) == c_out
    assert from_sources(expected, "vllm", n) == c_in


def test_c_in_zero_is_embedding_and_n_is_last_block_output() -> None:
    n = 8
    assert str(id_to_source(0, "vllm", n)) == EMBEDDING
    assert str(id_to_source(n, "speculators", n)) == f"block:{n - 1}"  # speculators' appended N: pre-norm
    assert str(id_to_source(-1, "specforge", n)) == EMBEDDING
    with pytest.raises(ValueError, match="outside"):
        id_to_source(n + 1, "vllm", n)
    with pytest.raises(ValueError, match="outside"):
        id_to_source(n, "specforge", n)
    with pytest.raises(ValueError, match="outside"):
        id_to_source(-1, "eagle", n)


def test_hf_hidden_states_index() -> None:
    n = 4
    assert to_sources([0, 1, 3, 4], "hf_hidden_states", n) == ["embedding", "block:0", "block:2", FINAL_NORM]
    assert from_sources(["embedding", "block:2", FINAL_NORM], "hf_hidden_states", n) == [0, 3, 4]
    with pytest.raises(ValueError, match="final norm"):
        from_sources(["block:3"], "hf_hidden_states", n)
    with pytest.raises(ValueError, match="final_norm"):
        from_sources([FINAL_NORM], "vllm", n)


# --- SGLang 0.5.23's capture rule per family (L = 61) -------------------------------------------------

L = 61


@pytest.mark.parametrize(
    ("draft_ids", "llama_ltc", "llama_src", "ds_ltc", "ds_src"),
    [
        (None, [2, 30, 58], blocks(1, 29, 57), [2, 30, 58], blocks(1, 29, 57)),
        ([1, 29, 57], [2, 30, 58], blocks(1, 29, 57), [2, 30, 58], blocks(1, 29, 57)),
        ([2, 30, 58], [3, 31, 59], blocks(2, 30, 58), [2, 30, 58], blocks(1, 29, 57)),
        ([-1, 3, 31], [0, 4, 32], ["embedding", "block:3", "block:31"], [-1, 3, 31], blocks(2, 30)),
        ([0, 3, 31], [1, 4, 32], blocks(0, 3, 31), [0, 3, 31], ["embedding", "block:2", "block:30"]),
    ],
)
def test_sglang_family_table(draft_ids, llama_ltc, llama_src, ds_ltc, ds_src) -> None:
    assert sglang_layers_to_capture(draft_ids, Family.LLAMA, L) == llama_ltc
    assert sglang_layers_to_capture(draft_ids, Family.DEEPSEEK, L) == ds_ltc
    assert to_sources(draft_ids, "sglang_draft_config", L, family="llama") == llama_src
    assert to_sources(draft_ids, "sglang_draft_config", L, family="deepseek") == ds_src


def test_deepseek_unmatched_id_fails_at_forward_llama_drops_silently() -> None:
    ds = sglang_sources([-1, 3, 31], Family.DEEPSEEK, L)
    assert ds.unreachable == [-1] and ds.fails_at_forward  # packer: "captured 2 of 3"
    llama = sglang_sources([1, 29, 60], Family.LLAMA, L)  # 60+1 = 61 is past the last layer
    assert llama.layers_to_capture == [2, 30, 61]
    assert llama.sources == blocks(1, 29) and llama.unreachable == [61] and not llama.fails_at_forward


def test_sglang_slot_order_is_ascending_and_duplicates_capture_once() -> None:
    cap = sglang_capture([58, 2, 30], L, Family.LLAMA)
    assert cap.sources == blocks(1, 29, 57)
    dup = sglang_capture([2, 2, 3], L, Family.DEEPSEEK)  # [1,1,1]-style degenerate lists
    assert dup.sources == blocks(1, 2) and dup.duplicates == [2] and dup.fails_at_forward


def test_gpt_oss_boundary_ids() -> None:
    n = 36
    # nvidia/gpt-oss-120b-Eagle3-v3 [24,30,36]: kept as-is, 36 = captured at the final norm (pre-norm)
    assert sglang_layers_to_capture([24, 30, 36], Family.GPT_OSS, n) == [24, 30, 36]
    assert to_sources([24, 30, 36], "sglang_draft_config", n, family="gpt_oss") == blocks(23, 29, 35)
    # SpecForge gpt-oss-120B config [1,17,33]: the legacy +1
    assert sglang_layers_to_capture([1, 17, 33], Family.GPT_OSS, n) == [2, 18, 34]
    assert to_sources([1, 17, 33], "sglang_draft_config", n, family="gpt_oss") == blocks(1, 17, 33)
    # the same boundary ids on a Llama-family target: +1 pushes 36 -> 37, never captured (before the fix)
    assert sglang_sources([24, 30, 36], Family.LLAMA, n).unreachable == [37]


def test_plus_one_always_shifts_the_default_too() -> None:
    assert sglang_layers_to_capture(None, Family.PLUS_ONE_ALWAYS, L) == [3, 31, 59]
    assert family_of("MiniMaxM3SparseForConditionalGeneration") is Family.PLUS_ONE_ALWAYS


@pytest.mark.parametrize(
    ("arch", "family"),
    [
        ("LlamaForCausalLM", Family.LLAMA),
        ("Qwen3MoeForCausalLM", Family.LLAMA),
        ("Glm4MoeForCausalLM", Family.LLAMA),
        ("DeepseekV3ForCausalLM", Family.DEEPSEEK),
        ("DeepseekV2ForCausalLM", Family.DEEPSEEK),
        ("KimiK25ForConditionalGeneration", Family.DEEPSEEK),
        ("Glm4MoeLiteForCausalLM", Family.DEEPSEEK),
        ("GlmMoeDsaForCausalLM", Family.DEEPSEEK),
        ("MistralLarge3ForCausalLM", Family.DEEPSEEK),
        ("GptOssForCausalLM", Family.GPT_OSS),
        ("SomethingNew", Family.LLAMA),
        (None, Family.LLAMA),
    ],
)
def test_family_of(arch: str | None, family: Family) -> None:
    assert family_of(arch) is family


# --- Kimi-K2.5: delegation to the DeepSeek rule, layer count from text_config ---


def test_kimi_k25_hazard() -> None:
    cfg = {"architectures": ["KimiK25ForConditionalGeneration"], "text_config": {"num_hidden_layers": 61}}
    n = text_config(cfg)["num_hidden_layers"]
    fam = family_of(cfg["architectures"][0])
    # AQ-MedAI/Kimi-K25-eagle3 ships [2,30,58]: SpecForge training capture (C_out) = blocks 2,30,58 ...
    trained = to_sources([2, 30, 58], "specforge", n)
    # ... but SGLang 0.5.23 on a DeepSeek-family target keeps the ids (first != 1): blocks 1,29,57.
    served = to_sources([2, 30, 58], "sglang_draft_config", n, family=fam)
    assert trained == blocks(2, 30, 58) and served == blocks(1, 29, 57)
    assert text_config({"num_hidden_layers": 4}) == {"num_hidden_layers": 4}


# --- vLLM / speculators cases ----------------------------------------------------------------------


def test_speculators_extraction_list_and_vllm_heuristic() -> None:
    n = 32
    # launch_vllm.py extracts [2, N//2, N-3, N]: the last one is the verifier's pre-norm last hidden state
    assert to_sources([2, 16, 29, 32], "speculators", n) == blocks(1, 15, 28, 31)
    # Llama-3.3-70B (80 layers) heuristic (2,40,77) in vLLM
    assert to_sources([2, 40, 77], "vllm", 80) == blocks(1, 39, 76)
    # SpecForge C_out [1,46,90] copied to a top-level (C_in) field is one block early in vLLM
    assert to_sources([1, 46, 90], "vllm", 94) == blocks(0, 45, 89)
    assert to_sources([1, 46, 90], "specforge", 94) == blocks(1, 46, 90)


def test_errors_name_the_fix() -> None:
    with pytest.raises(ValueError, match="family="):
        to_sources([1, 2, 3], "sglang_draft_config", 8)
    with pytest.raises(ValueError, match="family"):
        Family.parse("mamba")
    with pytest.raises(ValueError, match="num_layers"):
        default_ids("vllm", 0)


# --- the installed SGLang 0.5.23 methods agree with the table ---


def _run_real(cls: type, draft_ids: list[int] | None, n: int) -> list[int]:
    """Call SGLang's own ``set_eagle3_layers_to_capture`` on a minimal ``self`` (no model weights needed)."""
    inner = SimpleNamespace(layers_to_capture=[], set_eagle3_layers_to_capture=None)

    def _set(ids: list[int]) -> None:  # the Qwen-MoE style forwards to model.set_eagle3_layers_to_capture
        inner.layers_to_capture = list(ids)

    inner.set_eagle3_layers_to_capture = _set
    fake_self = SimpleNamespace(
        pp_group=SimpleNamespace(is_last_rank=True),
        config=SimpleNamespace(num_hidden_layers=n),
        model=inner,
        capture_aux_hidden_states=False,
    )
    cls.set_eagle3_layers_to_capture(fake_self, draft_ids)
    return inner.layers_to_capture


@pytest.mark.parametrize(
    ("module", "cls_name", "family"),
    [
        ("sglang.srt.models.llama", "LlamaForCausalLM", Family.LLAMA),
        ("sglang.srt.models.qwen3", "Qwen3ForCausalLM", Family.LLAMA),
        ("sglang.srt.models.deepseek_v2", "DeepseekV3ForCausalLM", Family.DEEPSEEK),
        ("sglang.srt.models.gpt_oss", "GptOssForCausalLM", Family.GPT_OSS),
    ],
)
def test_rules_match_installed_sglang(module: str, cls_name: str, family: Family) -> None:
    """The rules of the installed release (make test runs this on every supported release)."""
    import importlib
    import importlib.metadata

    version = importlib.metadata.version("sglang")
    cls = getattr(importlib.import_module(module), cls_name)
    for n, cases in (
        (61, [None, [1, 29, 57], [2, 30, 58], [0, 3, 31], [-1, 3, 31]]),
        (36, [[24, 30, 36], [1, 17, 33]]),
    ):
        for ids in cases:
            want = sglang_layers_to_capture(ids, family, n, engine_version=version)
            assert _run_real(cls, ids, n) == want, (cls_name, version, ids)


def _captures_before_the_layer_with_the_residual(forward: object) -> bool:
    """Whether a model loop's source captures ``hidden_states + residual`` under ``if i in
    self.layers_to_capture:`` (before the layer runs) while its residual starts as None."""
    import ast
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(forward)))
    starts_none = any(
        isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant) and n.value.value is None
        and any(getattr(t, "id", None) == "residual" for t in n.targets) for n in ast.walk(tree))

    def is_capture_test(test: ast.expr) -> bool:
        return (isinstance(test, ast.Compare) and isinstance(test.ops[0], ast.In)
                and isinstance(test.comparators[0], ast.Attribute)
                and test.comparators[0].attr == "layers_to_capture")

    def appends_sum(node: ast.AST) -> bool:
        return any(isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute) and c.func.attr == "append"
                   and c.args and isinstance(c.args[0], ast.BinOp) and isinstance(c.args[0].op, ast.Add)
                   and {getattr(c.args[0].left, "id", None), getattr(c.args[0].right, "id", None)}
                   == {"hidden_states", "residual"} for c in ast.walk(node))

    captures = any(isinstance(n, ast.If) and is_capture_test(n.test) and any(map(appends_sum, n.body))
                   for n in ast.walk(tree))
    return starts_none and captures


def test_layer_0_rule_matches_the_installed_deepseek_loop() -> None:
    """The installed release's real ``DeepseekV2Model.forward`` crashes on a captured layer 0 exactly
    where its rules say so (make test runs this on every supported release)."""
    import importlib.metadata

    from sglang.srt.models.deepseek_v2 import DeepseekV2Model

    version = importlib.metadata.version("sglang")
    crashes = _captures_before_the_layer_with_the_residual(DeepseekV2Model.forward)
    assert layer_id_rules(version).deepseek_layer_0_raises is crashes, (version, crashes)
    assert sglang_capture([0, 3, 5], 8, Family.DEEPSEEK, engine_version=version).raises_at_layer_0 is crashes
    assert not sglang_capture([1, 3, 5], 8, Family.DEEPSEEK, engine_version=version).raises_at_layer_0


# --- the layer-id rules by SGLang release (read from each release's set_eagle3_layers_to_capture) -------


@pytest.mark.parametrize(
    ("version", "ids", "ltc"),
    [
        # DeepSeek family, first id not 1: 0.5.9-0.5.12 add 1 to every id, 0.5.13+ take the ids as they are
        ("0.5.10", [0, 3, 5], [1, 4, 6]),
        ("0.5.12", [0, 3, 5], [1, 4, 6]),
        ("0.5.12.post1", [0, 3, 5], [1, 4, 6]),
        ("0.5.13", [0, 3, 5], [0, 3, 5]),
        ("0.5.23", [0, 3, 5], [0, 3, 5]),
        # first id 1: every release adds 1
        ("0.5.12", [1, 3, 5], [2, 4, 6]),
        ("0.5.23", [1, 3, 5], [2, 4, 6]),
    ],
)
def test_deepseek_rule_by_release(version: str, ids: list[int], ltc: list[int]) -> None:
    assert sglang_layers_to_capture(ids, Family.DEEPSEEK, 8, engine_version=version) == ltc


def test_the_same_draft_config_feeds_different_layers_on_0_5_12_and_0_5_23() -> None:
    ids = [0, 3, 5]  # a DeepSeek draft config whose first id is not 1
    old = sglang_sources(ids, Family.DEEPSEEK, 8, engine_version="0.5.12")
    new = sglang_sources(ids, Family.DEEPSEEK, 8, engine_version="0.5.23")
    assert old.sources == blocks(0, 3, 5)
    assert new.sources == ["embedding", "block:2", "block:4"]
    fed = to_sources(ids, "sglang_draft_config", 8, family="deepseek", engine_version="0.5.12")
    assert fed == old.sources
    assert sglang_sources(ids, Family.LLAMA, 8, engine_version="0.5.12").sources == old.sources


def test_gpt_oss_final_boundary_and_deepseek_packer_arrived_in_0_5_17() -> None:
    n = 36
    assert sglang_layers_to_capture([24, 30, 36], Family.GPT_OSS, n, engine_version="0.5.16") == [25, 31, 37]
    assert sglang_sources([24, 30, 36], Family.GPT_OSS, n, engine_version="0.5.16").unreachable == [37]
    assert sglang_layers_to_capture([24, 30, 36], Family.GPT_OSS, n, engine_version="0.5.17") == [24, 30, 36]
    old = sglang_sources([1, 3, 60], Family.DEEPSEEK, L, engine_version="0.5.16")
    assert old.unreachable == [61] and not old.fails_at_forward  # fewer states fed, no error
    assert sglang_sources([1, 3, 60], Family.DEEPSEEK, L, engine_version="0.5.17").fails_at_forward


@pytest.mark.parametrize(("version", "raises"), [
    ("0.5.12", True), ("0.5.13", True), ("0.5.13.post1", True), ("0.5.14", False), ("0.5.15", False),
    ("0.5.23", False),
])
def test_a_captured_layer_0_raises_on_deepseek_up_to_0_5_13(version: str, raises: bool) -> None:
    """The DeepSeek loop captured before each layer (the residual None before layer 0) up to 0.5.13;
    0.5.14 moved the capture into the layer, inside the 0.5.13-0.5.15 family."""
    # first id 0 on 0.5.13+ (as-is) and -1 on 0.5.12 (+1): layer 0 either way
    ids = [-1, 3, 5] if version == "0.5.12" else [0, 3, 5]
    cap = sglang_sources(ids, Family.DEEPSEEK, 8, engine_version=version)
    assert cap.layers_to_capture[0] == 0 and cap.raises_at_layer_0 is raises
    assert not sglang_sources([1, 3, 5], Family.DEEPSEEK, 8, engine_version=version).raises_at_layer_0


def test_release_defaults_to_the_newest_and_unknown_releases_are_refused() -> None:
    assert layer_id_rules() == layer_id_rules(NEWEST_RELEASE) == layer_id_rules("0.5.23.post2")
    for bad in ("0.5.8", "0.5.24", "0.6.0"):
        with pytest.raises(ValueError, match="has not read SGLang"):
            layer_id_rules(bad)
    with pytest.raises(ValueError, match="not an SGLang release number"):
        layer_id_rules("latest")

"""The testbed build: determinism, the SpecForge / speculators / atlas layouts, the target checkpoint,
and what the default testbed's draft is worth (offline accept length, right vs. wrong layers)."""

from __future__ import annotations

import hashlib
import json
import stat
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hs_tracer import cli
from hs_tracer import sources as S
from hs_tracer_testbed import corpus
from hs_tracer_testbed.build import Recipe, TestbedPaths, build, ensure_testbed, layer_plan
from hs_tracer_testbed.dumps import read_specforge, read_speculators

SMALL = Recipe.small()


def _digest_tree(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != "build_log.json"  # wall-clock timings only
    }


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> TestbedPaths:
    return build(tmp_path_factory.mktemp("tb") / "a", SMALL, progress=False, from_scratch=True)


def test_build_is_deterministic(small: TestbedPaths, tmp_path: Path) -> None:
    """Same recipe twice (once through the CLI) -> byte-identical files."""
    out = tmp_path / "b"
    assert cli.main(["testbed", "build", "--small", "--quiet", "--out", str(out)]) == 0
    first, second = _digest_tree(small.root), _digest_tree(out)
    assert len(first) > 20
    assert first == second


def test_cli_refuses_a_foreign_directory(tmp_path: Path) -> None:
    (tmp_path / "precious.txt").write_text("x")
    assert cli.main(["testbed", "build", "--small", "--quiet", "--out", str(tmp_path)]) == 2
    assert (tmp_path / "precious.txt").exists()


def test_specforge_layout(small: TestbedPaths) -> None:
    n, h = SMALL.target.num_layers, SMALL.target.hidden
    records = read_specforge(small.specforge_data)
    assert len(records) == SMALL.draft_docs
    assert sorted(p.parent.name for p in small.specforge_data.glob("rows_*/data_*.ckpt"))[0] == "rows_0-2000"
    atlas = read_speculators(small.atlas_data)
    c_out = layer_plan(n)["specforge_c_out"]
    for i, r in enumerate(records):
        assert set(r) == {"input_ids", "loss_mask", "hidden_state", "aux_hidden_state"}
        t = r["input_ids"].shape[0]
        assert r["input_ids"].dtype == torch.int64 and r["input_ids"][0] == 1  # BOS
        assert r["loss_mask"].shape == (t,) and r["loss_mask"][0] == 0
        assert r["hidden_state"].shape == (1, t, h) and r["hidden_state"].dtype == torch.bfloat16
        assert r["aux_hidden_state"].shape == (1, t, 3 * h)
        if i < SMALL.atlas_docs:
            # slot k is the output of block c_out[k] (atlas index j+1), hidden_state the final norm
            a = atlas[i]
            assert torch.equal(a["token_ids"], r["input_ids"])
            for k, j in enumerate(c_out):
                assert torch.equal(
                    r["aux_hidden_state"][0, :, k * h : (k + 1) * h], a["hidden_states"][:, j + 1]
                )
            assert torch.equal(r["hidden_state"][0], a["final_norm"])
    for p in small.specforge_data.glob("rows_*/data_*.ckpt"):
        assert stat.S_IMODE(p.stat().st_mode) == 0o600
    side = json.loads((small.specforge_data / "hs_tracer_data.json").read_text())
    assert side["layer_ids"] == c_out and side["convention"] == "C_out"
    assert side["sources"] == S.to_sources(c_out, S.Convention.SPECFORGE, n)


def test_vocab_mapping_is_specforge_style(small: TestbedPaths) -> None:
    vm = torch.load(small.specforge_data / "vocab_mapping" / "vocab_mapping.pt", weights_only=True)
    d2t, t2d = vm["d2t"], vm["t2d"]
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    assert d2t.shape == (SMALL.draft.draft_vocab,) and int(t2d.sum()) == SMALL.draft.draft_vocab
    target_ids = torch.arange(d2t.shape[0]) + d2t
    assert torch.equal(target_ids, t2d.nonzero().flatten())
    assert bool((d2t >= 0).all()) and bool((d2t[1:] >= d2t[:-1]).all())


def test_speculators_and_atlas_layouts(small: TestbedPaths) -> None:
    n, h = SMALL.target.num_layers, SMALL.target.hidden
    plan = layer_plan(n)
    spec = read_speculators(small.speculators_data)
    atlas = read_speculators(small.atlas_data)
    other = read_speculators(small.other_data)
    assert len(spec) == SMALL.draft_docs and len(atlas) == len(other) == SMALL.atlas_docs
    assert plan["speculators_c_in"] == [*S.default_ids(S.Convention.SPECULATORS, n), n]
    for i, a in enumerate(atlas):
        t = a["token_ids"].shape[0]
        assert a["hidden_states"].shape == (t, n + 1, h)
        assert set(a) == {"hidden_states", "token_ids", "final_norm"}
        # speculators' C_in id k is atlas index k (0 = embedding, N = last block output, pre-norm)
        assert torch.equal(spec[i]["hidden_states"], a["hidden_states"][:, plan["speculators_c_in"]])
        assert set(spec[i]) == {"hidden_states", "token_ids"}
    side = json.loads((small.atlas_data / "hs_tracer_data.json").read_text())
    assert side["sources"] == ["embedding", *[f"block:{j}" for j in range(n)]]
    assert json.loads((small.other_data / "hs_tracer_data.json").read_text())["domain"] == "other"
    # the other domain really is another distribution: its tokens are mostly absent from the train domain
    tok_train = {int(t) for a in atlas for t in a["token_ids"]}
    tok_other = {int(t) for a in other for t in a["token_ids"]}
    assert tok_other - tok_train


def test_manifest_and_draft_config(small: TestbedPaths) -> None:
    m = small.load_manifest()
    n = SMALL.target.num_layers
    assert m["recipe_hash"] == SMALL.digest() and m["weights"] == "trained"
    cfg = json.loads((small.draft / "config.json").read_text())
    ids = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    # The ids SGLang 0.5.23 applies to a DeepSeek target feed exactly the layers the data holds.
    assert (
        S.to_sources(ids, S.Convention.SGLANG_DRAFT_CONFIG, n, family=S.Family.DEEPSEEK)
        == m["layers"]["aux_sources"]
    )
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["eagle_config"]["use_aux_hidden_state"]
    w = load_file(str(small.draft / "model.safetensors"))
    h = SMALL.target.hidden
    assert w["fc.weight"].shape == (h, 3 * h)
    assert w["lm_head.weight"].shape == (SMALL.draft.draft_vocab, h)
    assert w["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * h
    assert not any("embed_tokens" in k for k in w)


def test_sglang_deepseek_rule_in_installed_sglang() -> None:
    """The installed SGLang's DeepSeek set_eagle3_layers_to_capture turns the draft ids into the +1 list."""
    import ast
    import importlib.util

    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.origin
    src = (Path(spec.origin).parent / "srt" / "models" / "deepseek_v2.py").read_text()
    fn = next(
        node
        for node in ast.walk(ast.parse(src))
        if isinstance(node, ast.FunctionDef) and node.name == "set_eagle3_layers_to_capture"
    )
    body = ast.unparse(fn)
    assert "layer_ids[0] == 1" in body and "val + 1" in body
    plan = layer_plan(8)
    assert plan["draft_config_ids"][0] == 1
    assert plan["sglang_layers_to_capture"] == [i + 1 for i in plan["draft_config_ids"]]


# ---- the default testbed (cached; built once per cache) -----------------------------------------


@pytest.fixture(scope="module")
def default() -> TestbedPaths:
    return ensure_testbed(progress=False)


def test_target_loads_with_transformers_and_is_predictable(default: TestbedPaths) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hs_tracer_testbed.accept import greedy_tokens
    from hs_tracer_testbed.target import load_target

    hf = AutoModelForCausalLM.from_pretrained(str(default.target), dtype=torch.float32)
    ours = load_target(default.target)
    tok = AutoTokenizer.from_pretrained(str(default.target))
    ids = tok("count from 40 : 40 41 42")["input_ids"]
    x = torch.tensor([ids])
    with torch.no_grad():
        assert torch.allclose(hf(x).logits, ours(x).logits, atol=1e-4)
    out = tok.decode(greedy_tokens(ours, ids, 5))
    assert out.split() == ["43", "44", "45", "46", "47"]


def test_offline_accept_length_right_vs_wrong_layers(default: TestbedPaths) -> None:
    """Re-measured here (fewer prompts than the build): correct wiring >= 2, other layers near 1."""
    from hs_tracer.draft.model import Eagle3Draft
    from hs_tracer_testbed.accept import greedy_tokens, simulate
    from hs_tracer_testbed.target import encode, load_target

    target = load_target(default.target)
    draft = Eagle3Draft.from_pretrained(default.draft, target_dir=default.target)
    prompts = encode(corpus.prompts(11, 8, "train"), add_eos=False)
    n = target.config.num_hidden_layers
    right = simulate(target, draft, prompts, layer_plan(n)["specforge_c_out"], 3, 16)
    wrong = simulate(target, draft, prompts, [n - 3, n - 2, n - 1], 3, 16)
    assert right.mean_accept_length >= 2.0
    assert wrong.mean_accept_length < right.mean_accept_length - 0.8
    # speculative decoding with a greedy target is lossless: same tokens as plain greedy decoding
    for p, got in zip(prompts[:3], right.tokens[:3], strict=True):
        assert got == greedy_tokens(target, p, len(got))


def test_one_miswiring_catalogue() -> None:
    """The offline accept-length measurement feeds the catalogue's wirings under the catalogue's names."""
    from hs_tracer_testbed.build import wiring_variants
    from hs_tracer_testbed.miswire import fed_sources

    n = 8
    catalogue = fed_sources(layer_plan(n)["aux_sources"])
    measured = wiring_variants(n)
    assert set(measured) == {k for k, v in catalogue.items() if S.FINAL_NORM not in v}
    for name, ids in measured.items():
        assert [str(S.Source.block_output(i)) for i in ids] == catalogue[name]

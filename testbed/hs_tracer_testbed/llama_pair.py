"""The vLLM testbed pair: a tiny Llama target and an EAGLE-3 draft trained on it, for vLLM on CPU.

vLLM's CPU attention needs a head size of at least 32, so this target is a Llama (hidden 128, four
heads of 32) rather than the SGLang testbed's DeepSeek-V3 (MLA heads of 24). It is trained on the same
synthetic corpus with the same loop (:func:`hs_tracer_testbed.target.train`), and the draft with the
same training-time-test loop (:func:`hs_tracer_testbed.draft_train.train_draft`) on SpecForge-layout
dumps of it.

The draft's config.json names its layers the way vLLM reads them: top-level
``eagle_aux_hidden_state_layer_ids`` in vLLM's convention (id ``k`` = the input of decoder layer
``k``). The ids are chosen away from vLLM's default ``(2, N//2, N-3)``, so a copy of the draft whose
ids vLLM does not find is served other features in two of its three slots.

``ensure_llama_pair()`` builds into the testbed cache on first use (keyed by the recipe, like
:func:`hs_tracer_testbed.build.ensure_testbed`) and returns the cached build afterwards. The default
recipe's weights are committed (:data:`ASSETS`, 3 MB; training them takes 10-25 minutes on a 2-core
machine), so a build from them only writes the data the reference profile is built from.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from contextlib import redirect_stdout
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hs_tracer.profile_builder import BuildRequest, build_profile_file
from hs_tracer_testbed import corpus
from hs_tracer_testbed.draft_train import DraftRecipe
from hs_tracer_testbed.tokenizer import BOS_ID, EOS_ID, PAD_ID, save_tokenizer

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM

# Bump when code changes alter the files a recipe produces (part of the cache key).
BUILD_FORMAT = 1
ASSETS = Path(__file__).resolve().parent / "assets_llama_pair"


@dataclass(frozen=True)
class LlamaPairRecipe:
    """Everything that determines the pair's files (hashed into the cache key). The training fields
    are the ones :func:`hs_tracer_testbed.target.train` reads."""

    num_layers: int = 8
    hidden: int = 128
    heads: int = 4  # head size 32: the least vLLM's CPU attention takes
    kv_heads: int = 2
    intermediate: int = 256
    max_position: int = 512
    rope_theta: float = 10000.0
    seed: int = 0
    train_steps: int = 400
    batch_size: int = 16
    seq_len: int = 64
    lr: float = 3e-3
    train_docs: int = 2000
    other_docs: int = 150
    dtype: str = "bfloat16"
    # vLLM ids (the input of layer k) of the states the draft is trained on: not vLLM's default.
    layer_ids: tuple[int, ...] = (1, 4, 7)
    draft_docs: int = 500  # the draft's training data
    profile_docs: int = 96  # of those, the ones a build from the committed weights writes again
    atlas_docs: int = 32
    draft: DraftRecipe = field(default_factory=lambda: DraftRecipe(train_steps=300))

    def digest(self) -> str:
        blob = json.dumps({"format": BUILD_FORMAT, "recipe": asdict(self)}, sort_keys=True)
        return "llama-" + hashlib.sha256(blob.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class LlamaPair:
    root: Path

    @property
    def target(self) -> Path:
        return self.root / "target"

    @property
    def draft(self) -> Path:
        return self.root / "draft"

    @property
    def specforge_data(self) -> Path:
        return self.root / "data" / "specforge"

    @property
    def atlas_data(self) -> Path:
        return self.root / "data" / "atlas"

    @property
    def manifest(self) -> Path:
        return self.root / "manifest.json"


def hf_config_dict(recipe: LlamaPairRecipe) -> dict[str, Any]:
    from hs_tracer_testbed.target import vocab_size

    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size(),
        "hidden_size": recipe.hidden,
        "intermediate_size": recipe.intermediate,
        "num_hidden_layers": recipe.num_layers,
        "num_attention_heads": recipe.heads,
        "num_key_value_heads": recipe.kv_heads,
        "head_dim": recipe.hidden // recipe.heads,
        "hidden_act": "silu",
        "max_position_embeddings": recipe.max_position,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-6,
        "use_cache": True,
        "pad_token_id": PAD_ID,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "rope_theta": recipe.rope_theta,
        "torch_dtype": recipe.dtype,
    }


def make_model(recipe: LlamaPairRecipe) -> LlamaForCausalLM:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = {k: v for k, v in hf_config_dict(recipe).items() if k not in ("architectures", "model_type",
                                                                          "torch_dtype")}
    config = LlamaConfig(**cfg)
    config._attn_implementation = "eager"
    torch.manual_seed(recipe.seed)
    model = LlamaForCausalLM(config).float()
    model.eval()
    return model


def _save_target(model: LlamaForCausalLM, recipe: LlamaPairRecipe, out: Path) -> None:
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    dtype = getattr(torch, recipe.dtype)
    weights = {k: v.detach().to(dtype).contiguous() for k, v in model.state_dict().items()
               if "rotary_emb" not in k}
    save_file(dict(sorted(weights.items())), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config_dict(recipe), indent=2, sort_keys=True) + "\n")
    gen = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    save_tokenizer(out)


def load_target(pair: LlamaPair, recipe: LlamaPairRecipe) -> LlamaForCausalLM:
    """The target as fp32 transformers model with the exact (rounded) weights on disk."""
    from safetensors.torch import load_file

    model = make_model(recipe)
    weights = {k: v.float() for k, v in load_file(str(pair.target / "model.safetensors")).items()}
    model.load_state_dict(weights, strict=False)
    return model


def draft_config(recipe: LlamaPairRecipe, target_cfg: dict[str, Any]) -> dict[str, Any]:
    """The draft's config.json: the testbed draft's, with the ids where and as vLLM reads them."""
    from hs_tracer_testbed.draft_train import draft_config_dict

    cfg = draft_config_dict(recipe.draft, target_cfg, list(recipe.layer_ids), EOS_ID, BOS_ID)
    cfg.pop("eagle_config")
    cfg["eagle_aux_hidden_state_layer_ids"] = list(recipe.layer_ids)
    return cfg


def prebuilt_assets(recipe: LlamaPairRecipe) -> Path | None:
    """The committed weights if they were trained by exactly ``recipe``."""
    meta = ASSETS / "prebuilt.json"
    if meta.exists() and json.loads(meta.read_text()).get("recipe_hash") == recipe.digest():
        return ASSETS
    return None


def build(out: Path, recipe: LlamaPairRecipe, progress: bool = False,
          from_scratch: bool = False) -> LlamaPair:
    """Write the pair under ``out``: the committed weights (unless ``from_scratch`` or another recipe)
    or a training run of target and draft; then the SpecForge-layout data and the all-layer atlas."""
    import torch

    from hs_tracer.draft.model import DraftConfig, Eagle3Draft
    from hs_tracer_testbed import dumps
    from hs_tracer_testbed.draft_train import save_vocab_mapping, train_draft
    from hs_tracer_testbed.target import deterministic, encode, train, vocab_size

    if out.exists():
        shutil.rmtree(out)
    pair = LlamaPair(out)
    assets = None if from_scratch else prebuilt_assets(recipe)
    n = recipe.num_layers
    with deterministic():
        if assets is None:
            model = make_model(recipe)
            losses = train(model, recipe, progress)  # type: ignore[arg-type]  # the fields train() reads
            _save_target(model, recipe, pair.target)
        else:
            shutil.copytree(assets / "target", pair.target)
            losses = []
        target = load_target(pair, recipe)
        c_out = [k - 1 for k in recipe.layer_ids]  # SpecForge data names the same tensors C_out
        seqs = encode(corpus.documents(1, recipe.draft_docs, "train"))
        written = seqs if assets is None else seqs[:recipe.profile_docs]
        for i, seq in enumerate(written):
            st = dumps.layer_states(target, torch.tensor(seq))  # type: ignore[arg-type]
            mask = torch.ones(len(seq), dtype=torch.long)
            mask[0] = 0
            dumps.write_specforge(pair.specforge_data, i, st, c_out, mask)
            if i < recipe.atlas_docs:
                dumps.write_speculators(pair.atlas_data, i, st, list(range(n + 1)), final_norm=True)
        mapping = dumps.vocab_mapping([s[1:] for s in seqs], vocab_size(), recipe.draft.draft_vocab)
        save_vocab_mapping(pair.specforge_data, mapping)
        from hs_tracer import sources as S

        common = {"target": "../../target", "num_hidden_layers": n, "dtype": "bfloat16"}
        dumps.write_sidecar(pair.specforge_data, {
            **common, "layout": "specforge", "layer_ids": c_out, "convention": "C_out",
            "sources": S.to_sources(c_out, S.Convention.SPECFORGE, n), "hidden_state": "final_norm",
            "records": len(written), "domain": "train"})
        atlas_ids = list(range(n + 1))
        dumps.write_sidecar(pair.atlas_data, {
            **common, "layout": "speculators", "layer_ids": atlas_ids, "convention": "C_in",
            "sources": S.to_sources(atlas_ids, S.Convention.SPECULATORS, n),
            "extra_keys": {"final_norm": "final_norm"}, "records": recipe.atlas_docs, "domain": "train"})
        if assets is None:
            cfg = draft_config(recipe, hf_config_dict(recipe))
            torch.manual_seed(recipe.draft.seed)
            draft = Eagle3Draft(DraftConfig.from_dict(cfg), target.model.embed_tokens.weight.detach())
            draft.d2t.copy_(mapping["d2t"])
            draft.t2d.copy_(mapping["t2d"])
            log = train_draft(draft, dumps.read_specforge(pair.specforge_data),
                              target.lm_head.weight.detach(), recipe.draft, progress)
            draft.save_pretrained(pair.draft)
            # save_pretrained writes the config the draft was built from: keep vLLM's keys exactly.
            (pair.draft / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
            (pair.draft / "train_log.json").write_text(json.dumps(log) + "\n")
        else:
            shutil.copytree(assets / "draft", pair.draft)
            log = json.loads((pair.draft / "train_log.json").read_text())
    tail = losses[-20:]
    manifest = {
        "format": BUILD_FORMAT,
        "recipe_hash": recipe.digest(),
        "recipe": asdict(recipe),
        "weights": "trained" if assets is None else "prebuilt",
        "target": {"architecture": "LlamaForCausalLM",
                   "final_train_loss": sum(tail) / len(tail) if tail else None},
        "draft": {"architecture": "LlamaForCausalLMEagle3", "train_log_tail": log[-3:]},
        "layers": {"vllm_layer_ids": list(recipe.layer_ids),
                   "sources": S.to_sources(list(recipe.layer_ids), S.Convention.VLLM, n)},
    }
    pair.manifest.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return pair


def export_assets(pair: LlamaPair, dest: Path = ASSETS) -> Path:
    """Copy a from-scratch build's weights into ``dest`` (the committed assets)."""
    manifest = json.loads(pair.manifest.read_text())
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(pair.target, dest / "target")
    shutil.copytree(pair.draft, dest / "draft")
    meta = {"recipe_hash": manifest["recipe_hash"], "recipe": manifest["recipe"]}
    (dest / "prebuilt.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return dest


def ensure_llama_pair(root: Path | None = None, recipe: LlamaPairRecipe | None = None,
                      progress: bool = False) -> LlamaPair:
    """The pair for ``recipe``, built on first use into the testbed cache (locked, renamed into place)."""
    from hs_tracer_testbed.build import _locked, default_cache_root

    recipe = recipe or LlamaPairRecipe()
    base = Path(root) if root is not None else default_cache_root()
    pair = LlamaPair(base / recipe.digest())
    if pair.manifest.exists():
        return pair
    with _locked(base / f".{recipe.digest()}.lock"):
        if pair.manifest.exists():
            return pair
        tmp = base / f".{recipe.digest()}.building"
        build(tmp, recipe, progress)
        tmp.rename(pair.root)
    return pair


def write_ids_missing(draft: Path, out: Path) -> Path:
    """A copy of the draft whose config.json lost its layer ids (as after re-saving the config with a
    tool that drops unknown keys): vLLM then feeds its default ``(2, N//2, N-3)``. The weights are
    shared by symlink."""
    out.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((draft / "config.json").read_text())
    cfg.pop("eagle_aux_hidden_state_layer_ids", None)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    for f in draft.glob("*.safetensors"):
        (out / f.name).symlink_to(f.resolve())
    return out


def profile(pair: LlamaPair) -> Path:
    """The reference profile of the draft's training data with the all-layer atlas (built once, next to
    the pair)."""
    out = pair.root.parent / f"{pair.root.name}.profile.safetensors"
    if not out.exists():
        with redirect_stdout(sys.stderr):  # progress, not the caller's answer
            code = build_profile_file(BuildRequest([pair.specforge_data], out, draft=pair.draft,
                                                   target=pair.target, atlas=pair.atlas_data,
                                                   no_progress=True))
        if code != 0:
            raise RuntimeError(f"building the vLLM testbed profile failed (exit {code})")
    return out

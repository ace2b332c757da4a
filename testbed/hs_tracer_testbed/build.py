"""Build the whole testbed (target, draft, training data, measurements) deterministically.

``build(out_dir)`` is what ``hs-tracer testbed build --out DIR`` runs; ``ensure_testbed()`` builds
into a shared cache on first use and returns the cached build afterwards, so tests, the demo and
teammates use one build. The cache key hashes the recipe (every knob that changes a file).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hs_tracer_testbed import corpus
from hs_tracer_testbed.draft_train import DraftRecipe
from hs_tracer_testbed.target import TargetRecipe

# Bump when code changes alter the files a recipe produces (it is part of the cache key).
BUILD_FORMAT = 1
MANIFEST = "manifest.json"
# Weights of the default recipe, trained once with ``build(..., from_scratch=True)`` and committed
# (1.5 MB) so a build on a 2-core CI machine only regenerates data and measurements.
ASSETS = Path(__file__).resolve().parent / "assets"


@dataclass(frozen=True)
class Recipe:
    """The full testbed recipe. ``small()`` is a seconds-long variant for tests of the machinery."""

    target: TargetRecipe = field(default_factory=TargetRecipe)
    draft: DraftRecipe = field(default_factory=DraftRecipe)
    data_seed: int = 1
    draft_docs: int = 1000
    atlas_docs: int = 64
    eval_seed: int = 2
    eval_prompts: int = 16
    eval_new_tokens: int = 24
    num_steps: int = 3

    @classmethod
    def small(cls) -> Recipe:
        """Tiny, barely trained: for determinism and layout tests (not for accept lengths)."""
        return cls(
            target=TargetRecipe(hidden=32, heads=2, q_lora_rank=16, kv_lora_rank=16, intermediate=64,
                                moe_intermediate=32, train_steps=4, batch_size=4, train_docs=64,
                                other_docs=8),
            draft=DraftRecipe(intermediate=64, heads=2, kv_heads=2, train_steps=4, batch_size=4),
            draft_docs=12, atlas_docs=4, eval_prompts=2, eval_new_tokens=6,
        )  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Recipe:
        d = dict(d)
        return cls(target=TargetRecipe(**d.pop("target")), draft=DraftRecipe(**d.pop("draft")), **d)

    def digest(self) -> str:
        """Cache key: the recipe plus the build format version."""
        blob = json.dumps({"format": BUILD_FORMAT, "recipe": self.to_dict()}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class TestbedPaths:
    """Where one built testbed lives."""

    __test__ = False  # not a pytest test class despite the name

    root: Path
    target: Path
    draft: Path
    kimi_target: Path  # the same target as Kimi-K2.5 ships it (hs_tracer_testbed.kimi)
    kimi_draft: Path  # the same draft in Kimi-K2.5's MLA draft format
    specforge_data: Path
    speculators_data: Path
    atlas_data: Path
    other_data: Path
    manifest: Path

    @classmethod
    def under(cls, root: Path) -> TestbedPaths:
        data = root / "data"
        return cls(
            root=root,
            target=root / "target",
            draft=root / "draft",
            kimi_target=root / "kimi" / "target",
            kimi_draft=root / "kimi" / "draft",
            specforge_data=data / "specforge",
            speculators_data=data / "speculators",
            atlas_data=data / "atlas",
            other_data=data / "other",
            manifest=root / MANIFEST,
        )

    def load_manifest(self) -> dict[str, Any]:
        return json.loads(self.manifest.read_text())


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("torch", "transformers", "safetensors", "tokenizers", "sglang"):
        with contextlib.suppress(PackageNotFoundError):
            out[pkg] = version(pkg)
    return out


def layer_plan(num_layers: int) -> dict[str, Any]:
    """Layer ids of the testbed in every convention, with the canonical sources they mean."""
    from hs_tracer import sources as S

    n = num_layers
    c_out = S.default_ids(S.Convention.SPECFORGE, n)  # SpecForge's default capture layers
    spec_c_in = [*S.default_ids(S.Convention.SPECULATORS, n), n]  # speculators adds the last block
    capture = S.sglang_sources(c_out, S.Family.DEEPSEEK, n)
    return {
        "num_hidden_layers": n,
        "specforge_c_out": c_out,
        "speculators_c_in": spec_c_in,
        "draft_config_ids": c_out,
        "sglang_layers_to_capture": capture.layers_to_capture,
        "aux_sources": S.to_sources(c_out, S.Convention.SPECFORGE, n),
        "sglang_fed_sources": capture.sources,
        "speculators_sources": S.to_sources(spec_c_in, S.Convention.SPECULATORS, n),
        "atlas_c_in": list(range(n + 1)),
        "atlas_sources": S.to_sources(list(range(n + 1)), S.Convention.SPECULATORS, n),
        "note": (
            "draft_config_ids are SpecForge C_out ids whose first id is 1, so SGLang 0.5.23's DeepSeek "
            "rule (+1 only when the first id is 1) sets layers_to_capture = ids + 1 (inputs of those "
            "layers), i.e. the outputs of blocks draft_config_ids: the tensors the draft was trained on."
        ),
    }


def _dump_data(paths: TestbedPaths, recipe: Recipe, target: Any, plan: dict[str, Any], progress: bool) -> Any:
    import torch
    from tqdm import tqdm

    from hs_tracer_testbed import dumps
    from hs_tracer_testbed.draft_train import save_vocab_mapping
    from hs_tracer_testbed.target import encode, vocab_size

    seqs = encode(corpus.documents(recipe.data_seed, recipe.draft_docs, "train"))
    c_out, spec_c_in, atlas_c_in = plan["specforge_c_out"], plan["speculators_c_in"], plan["atlas_c_in"]
    for i, seq in enumerate(tqdm(seqs, desc="dump hidden states", disable=not progress)):
        st = dumps.layer_states(target, torch.tensor(seq))
        mask = torch.ones(len(seq), dtype=torch.long)
        mask[0] = 0  # BOS is never a prediction target
        dumps.write_specforge(paths.specforge_data, i, st, c_out, mask)
        dumps.write_speculators(paths.speculators_data, i, st, spec_c_in)
        if i < recipe.atlas_docs:
            dumps.write_speculators(paths.atlas_data, i, st, atlas_c_in, final_norm=True)
    other = encode(corpus.documents(recipe.data_seed, recipe.atlas_docs, "other"))
    for i, seq in enumerate(other):
        dumps.write_speculators(
            paths.other_data, i, dumps.layer_states(target, torch.tensor(seq)), atlas_c_in, True
        )
    mapping = dumps.vocab_mapping([s[1:] for s in seqs], vocab_size(), recipe.draft.draft_vocab)
    save_vocab_mapping(paths.specforge_data, mapping)
    common = {"target": "../../target", "num_hidden_layers": plan["num_hidden_layers"], "dtype": "bfloat16"}
    dumps.write_sidecar(paths.specforge_data, {
        **common, "layout": "specforge", "layer_ids": c_out, "convention": "C_out",
        "sources": plan["aux_sources"], "hidden_state": "final_norm", "records": len(seqs), "domain": "train",
    })  # fmt: skip
    dumps.write_sidecar(paths.speculators_data, {
        **common, "layout": "speculators", "layer_ids": spec_c_in, "convention": "C_in",
        "sources": plan["speculators_sources"], "records": len(seqs), "domain": "train",
    })  # fmt: skip
    for d, n, domain in (
        (paths.atlas_data, recipe.atlas_docs, "train"),
        (paths.other_data, len(other), "other"),
    ):
        dumps.write_sidecar(d, {
            **common, "layout": "speculators", "layer_ids": atlas_c_in, "convention": "C_in",
            "sources": plan["atlas_sources"], "extra_keys": {"final_norm": "final_norm"}, "records": n,
            "domain": domain,
        })  # fmt: skip
    return mapping


def prebuilt_assets(recipe: Recipe) -> Path | None:
    """The committed weights directory if it was trained by exactly ``recipe``, else None."""
    meta = ASSETS / "prebuilt.json"
    if meta.exists() and json.loads(meta.read_text()).get("recipe_hash") == recipe.digest():
        return ASSETS
    return None


def export_assets(paths: TestbedPaths, dest: Path = ASSETS) -> Path:
    """Copy a from-scratch build's target and draft weights into ``dest`` (the committed assets)."""
    manifest = paths.load_manifest()
    if manifest.get("weights") != "trained":
        raise ValueError(f"{paths.root} reused prebuilt weights; export only a --from-scratch build")
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(paths.target, dest / "target")
    shutil.copytree(paths.draft, dest / "draft")
    meta = {
        "recipe_hash": manifest["recipe_hash"],
        "recipe": manifest["recipe"],
        "versions": manifest["versions"],
    }
    (dest / "prebuilt.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return dest


def _make_draft(paths: TestbedPaths, recipe: Recipe, target_cfg: dict[str, Any], plan: dict[str, Any],
                mapping: Any, target: Any, progress: bool) -> tuple[Any, list[dict[str, float]]]:  # fmt: skip
    import torch

    from hs_tracer.draft.model import DraftConfig, Eagle3Draft
    from hs_tracer_testbed.draft_train import draft_config_dict, train_draft
    from hs_tracer_testbed.dumps import read_specforge
    from hs_tracer_testbed.tokenizer import BOS_ID, EOS_ID

    cfg = draft_config_dict(recipe.draft, target_cfg, plan["draft_config_ids"], EOS_ID, BOS_ID)
    torch.manual_seed(recipe.draft.seed)
    draft = Eagle3Draft(DraftConfig.from_dict(cfg), target.model.embed_tokens.weight.detach())
    draft.d2t.copy_(mapping["d2t"])
    draft.t2d.copy_(mapping["t2d"])
    records = read_specforge(paths.specforge_data)
    log = train_draft(draft, records, target.lm_head.weight.detach(), recipe.draft, progress)
    draft.save_pretrained(paths.draft)
    (paths.draft / "train_log.json").write_text(json.dumps(log) + "\n")
    # Evaluate exactly what is on disk (bf16-rounded weights).
    return Eagle3Draft.from_pretrained(paths.draft, target_dir=paths.target), log


def wiring_variants(num_layers: int) -> dict[str, list[int]]:
    """The miswiring catalogue (:func:`hs_tracer_testbed.miswire.fed_sources`, its names) as the C_out
    ids the offline measurement feeds; wirings it cannot express as block outputs are left out."""
    from hs_tracer.sources import Source
    from hs_tracer_testbed.miswire import fed_sources

    out = {}
    for name, sources in fed_sources(layer_plan(num_layers)["aux_sources"]).items():
        depths = [Source.parse(s).depth for s in sources]
        if all(isinstance(d, int) for d in depths):
            out[name] = [int(d) for d in depths]
    return out


def measure(target: Any, draft: Any, recipe: Recipe, progress: bool = True) -> dict[str, Any]:
    """Offline mean accept length on held-out prompts for each wiring variant (and other domain)."""
    from tqdm import tqdm

    from hs_tracer_testbed.accept import simulate
    from hs_tracer_testbed.target import encode
    from hs_tracer_testbed.tokenizer import EOS_ID

    n = recipe.target.num_layers
    heldout = encode(corpus.prompts(recipe.eval_seed, recipe.eval_prompts, "train"), add_eos=False)
    other = encode(corpus.prompts(recipe.eval_seed, recipe.eval_prompts, "other"), add_eos=False)
    runs = [(name, ids, heldout) for name, ids in wiring_variants(n).items()]
    runs.append(("other_domain_correct", wiring_variants(n)["correct"], other))
    out: dict[str, Any] = {}
    for name, ids, prompts in tqdm(runs, desc="measure accept length", disable=not progress):
        st = simulate(target, draft, prompts, ids, recipe.num_steps, recipe.eval_new_tokens, EOS_ID)
        out[name] = {
            "c_out_ids": ids,
            "mean_accept_length": round(st.mean_accept_length, 4),
            "per_position_rate": [round(r, 4) for r in st.per_position_rate],
            "verify_steps": len(st.accept_lengths),
        }
    out["method"] = (
        f"offline greedy chain speculative decoding (hs_tracer_testbed.accept.simulate), num_steps="
        f"{recipe.num_steps}, topk=1, {recipe.eval_prompts} held-out prompts (corpus.prompts seed "
        f"{recipe.eval_seed}), up to {recipe.eval_new_tokens} new tokens each, fp32 compute on the "
        "bf16 checkpoints; accept length = accepted draft tokens + 1 per verify step"
    )
    return out


def build(
    out_dir: Path, recipe: Recipe | None = None, progress: bool | None = None, from_scratch: bool = False
) -> TestbedPaths:
    """Build the testbed into ``out_dir`` (replacing it). Same recipe, same machine -> same files.

    The default recipe reuses the committed weights (:data:`ASSETS`) unless ``from_scratch``; the
    data dumps and measurements are always computed. Progress bars (``progress``, default: only when
    stderr is a terminal) never go to a log file or a pipe.
    """
    from hs_tracer_testbed.target import deterministic

    with deterministic():
        return _build(Path(out_dir), recipe or Recipe(), _bars(progress), from_scratch)


def _bars(progress: bool | None) -> bool:
    return sys.stderr.isatty() if progress is None else progress


def _build(out_dir: Path, recipe: Recipe, progress: bool, from_scratch: bool) -> TestbedPaths:
    from hs_tracer_testbed.target import build_target, load_target

    if out_dir.exists():
        shutil.rmtree(out_dir)
    paths = TestbedPaths.under(out_dir)
    assets = None if from_scratch else prebuilt_assets(recipe)
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    if assets is not None:
        shutil.copytree(assets / "target", paths.target)
    else:
        build_target(paths.target, recipe=recipe.target, progress=progress)
    timings["target_s"] = time.perf_counter() - t0
    target = load_target(paths.target)
    target_cfg = json.loads((paths.target / "config.json").read_text())
    plan = layer_plan(recipe.target.num_layers)
    t1 = time.perf_counter()
    mapping = _dump_data(paths, recipe, target, plan, progress)
    timings["dumps_s"] = time.perf_counter() - t1
    t2 = time.perf_counter()
    if assets is not None:
        from hs_tracer.draft.model import Eagle3Draft

        shutil.copytree(assets / "draft", paths.draft)
        draft = Eagle3Draft.from_pretrained(paths.draft, target_dir=paths.target)
        draft_log = json.loads((paths.draft / "train_log.json").read_text())
    else:
        draft, draft_log = _make_draft(paths, recipe, target_cfg, plan, mapping, target, progress)
    timings["draft_s"] = time.perf_counter() - t2
    write_kimi(paths)
    t3 = time.perf_counter()
    measurements = measure(target, draft, recipe, progress)
    timings["measure_s"] = time.perf_counter() - t3
    target_log = (
        json.loads((paths.target / "train_log.json").read_text()) if recipe.target.train_steps else {}
    )
    manifest = {
        "format": BUILD_FORMAT,
        "recipe_hash": recipe.digest(),
        "recipe": recipe.to_dict(),
        "weights": "trained" if assets is None else "prebuilt",
        "versions": _versions(),
        "layers": plan,
        "paths": {k: str(Path(v).relative_to(out_dir)) for k, v in asdict(paths).items() if k != "root"},
        "target": {"architecture": "DeepseekV3ForCausalLM", "final_train_loss": target_log.get("final_loss")},
        "draft": {"architecture": "LlamaForCausalLMEagle3", "train_log_tail": draft_log[-3:]},
        "kimi": {"target": "KimiK25ForConditionalGeneration", "draft": "Eagle3DeepseekV2ForCausalLM"},
        "accept_length": measurements,
    }
    (paths.root / "build_log.json").write_text(json.dumps({"timings_s": timings}, indent=2) + "\n")
    paths.manifest.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return paths


def write_kimi(paths: TestbedPaths) -> None:
    """Write the Kimi-K2.5-format target and draft (derived from the built pair; seconds), through
    a temporary directory renamed into place."""
    from hs_tracer_testbed import kimi

    final = paths.kimi_target.parent
    tmp = final.with_name(f".{final.name}.building")
    if tmp.exists():
        shutil.rmtree(tmp)
    kimi.write_target(paths.target, tmp / paths.kimi_target.name)
    kimi.write_draft(paths.draft, paths.target, tmp / paths.kimi_draft.name)
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)


def default_cache_root() -> Path:
    """``$HS_TRACER_TESTBED_DIR``, else ``<repo>/.cache/testbed`` (or ``~/.cache/hs_tracer/testbed``)."""
    env = os.environ.get("HS_TRACER_TESTBED_DIR")
    if env:
        return Path(env)
    repo = Path(__file__).resolve().parents[2]
    if (repo / "pyproject.toml").exists():
        return repo / ".cache" / "testbed"
    return Path.home() / ".cache" / "hs_tracer" / "testbed"


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def ensure_testbed(
    root: Path | None = None, recipe: Recipe | None = None, progress: bool | None = None
) -> TestbedPaths:
    """The testbed for ``recipe`` (default recipe), built on first use into ``root/<recipe-hash>``.

    Concurrent callers (parallel tests, teammates) wait on a file lock; the build goes to a
    temporary directory and is renamed into place, so a half-built testbed is never returned.
    """
    recipe = recipe or Recipe()
    base = Path(root) if root is not None else default_cache_root()
    final = base / recipe.digest()
    paths = TestbedPaths.under(final)
    if paths.manifest.exists() and paths.kimi_draft.exists():
        return paths
    with _locked(base / f".{recipe.digest()}.lock"):
        if paths.manifest.exists():
            if not paths.kimi_draft.exists():  # cached before the Kimi-K2.5 pair existed
                write_kimi(paths)
            return paths
        tmp = base / f".{recipe.digest()}.building"
        build(tmp, recipe, progress)
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
    return paths

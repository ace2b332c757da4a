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

The CPU glue, all of it in :data:`GLUE` and :func:`apply_glue`: the connector copies through CUDA
streams and events into pinned memory; on the CPU the copy is plain.

Not yet here: speculators' training and its checkpoint (its trainer needs its own CPU glue).
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


GLUE = (
    Glue("CPU copies in vLLM's hidden-states connector", f"{CONNECTOR}:torch",
         _connector_copies_through_cuda),
)


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


if __name__ == "__main__":
    if sys.argv[1] == "glue":
        _glue_report()
    elif sys.argv[1] == "capture":
        _capture(Path(sys.argv[2]))
    else:
        raise SystemExit(f"unknown stage {sys.argv[1]!r}")

"""Start real SGLang 0.5.23 engines on a CUDA machine with the GPU testbed runtime applied.

The runtime is environment + flags: this module is the one place that sets them, for the engine
process and every process SGLang spawns (``pythonpath/sitecustomize.py`` re-applies the patches
there). Each engine is an ``sgl.Engine`` in a worker process (:mod:`.worker`) that takes SGLang's
own command-line arguments.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

PYTHONPATH_DIR = Path(__file__).resolve().parent / "pythonpath"
# Where hs_tracer_testbed itself is importable from (the ``sitecustomize`` imports it at interpreter
# start in every engine process).
PACKAGE_ROOT = Path(__file__).resolve().parents[3]
RUNTIME_FLAG = "HS_TRACER_TESTBED_GPU_RUNTIME"
REPLY = "HS-TRACER-WORKER "  # prefix of the worker's answer lines on its private stdout

# NVLink multicast can take a shared host's GPUs out of service: off in NCCL, PyTorch and NVSHMEM,
# in every process (SGLang's children inherit the environment).
NO_MULTICAST_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}

RUNTIME_ENV = {
    RUNTIME_FLAG: "1",
    # The stand-in is not the sglang-kernel distribution SGLang's launch check looks for.
    "SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK": "1",
    "SGLANG_ENABLE_JIT_DEEPGEMM": "0",
    # The wheel's compiled (Rust) radix TreeCore is built against torch 2.14's C++ ABI; under another
    # torch it misreads tensor dtypes ("insert value must be an int64 tensor, got Double"). SGLang's
    # own pure-Python TreeCore keeps the radix cache on. See docs/gpu.md.
    "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND": "python",
    **NO_MULTICAST_ENV,
}

# Flags that keep SGLang off every binary the runtime does not provide (FlashInfer, FlashMLA,
# sgl_kernel's attention/sampling/all-reduce kernels, symmetric memory).
SERVER_FLAGS = (
    "--attention-backend", "triton",
    "--sampling-backend", "pytorch",
    "--moe-runner-backend", "triton",
    "--disable-custom-all-reduce",
    "--enforce-disable-flashinfer-allreduce-fusion",
)


def runtime_env(extra: Mapping[str, str] | None = None,
                base: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The full environment for an engine process: ``base`` + the runtime's settings + ``extra``,
    with the stand-in directory first on PYTHONPATH and the testbed's package root last (where it is
    site-packages it must not shadow the caller's path)."""
    ours = (str(PYTHONPATH_DIR), str(PACKAGE_ROOT))
    parts = [p for p in base.get("PYTHONPATH", "").split(os.pathsep) if p and p not in ours]
    env = {**base, **RUNTIME_ENV, **(extra or {})}
    env["PYTHONPATH"] = os.pathsep.join([ours[0], *parts, ours[1]])
    for key, value in NO_MULTICAST_ENV.items():  # never overridable
        env[key] = value
    return env


def worker_command(model: Path | str, args: Sequence[str] = ()) -> list[str]:
    """The command of one engine worker (:mod:`.worker`), with SGLang's CLI arguments."""
    return [sys.executable, "-m", "hs_tracer_testbed.runtime.gpu.worker", "--model-path", str(model),
            *SERVER_FLAGS, *args]


class EngineWorker:
    """One real ``sgl.Engine`` in a child process (its own process group), driven over pipes.

    Why a child per engine: several engines share one machine (each is its own process tree, so a
    client can alternate between a traced and an untraced one), and SGLang must be imported after
    the runtime's environment is in place, which a fresh process guarantees.
    """

    def __init__(self, model: Path | str, args: Sequence[str] = (), *,
                 env: Mapping[str, str] | None = None, log: IO[str] | None = None) -> None:
        self.proc = subprocess.Popen(worker_command(model, args), env=runtime_env(env),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
                                     bufsize=1, start_new_session=True)
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _reply(self, timeout_s: float) -> Any:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self._lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                raise TimeoutError(f"engine worker gave no answer within {timeout_s:.0f} s") from None
            if line is None:
                raise RuntimeError(f"engine worker exited with {self.proc.wait()}")
            if line.startswith(REPLY):
                reply = json.loads(line[len(REPLY):])
                if "error" in reply:
                    raise RuntimeError(f"engine worker: {reply['error']}")
                return reply["result"]

    def wait_ready(self, timeout_s: float) -> None:
        """Block until the engine is up (its CUDA graphs captured), or raise."""
        self._reply(timeout_s)

    def generate(self, payload: Mapping[str, Any], timeout_s: float = 600) -> list[dict[str, Any]]:
        """``sgl.Engine.generate(**payload)``; always a list of outputs."""
        with self._lock:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps({"op": "generate", "kwargs": dict(payload)}) + "\n")
            self.proc.stdin.flush()
            out = self._reply(timeout_s)
        return out if isinstance(out, list) else [out]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, grace_s: float = 30) -> None:
        """Ask the engine to shut down; SIGKILL its process group if it does not within ``grace_s``."""
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(grace_s)
            except (OSError, subprocess.TimeoutExpired):
                pass
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)

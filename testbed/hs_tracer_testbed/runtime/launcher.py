"""Start a real SGLang ``sgl.Engine`` (0.5.23, or 0.5.12 in its own virtualenv) on a CPU-only
machine, optionally with EAGLE-3.

Why a launcher: running SGLang's EAGLE path without a GPU takes an environment that production
must never see (a ``sgl_kernel`` stand-in on PYTHONPATH, pure-torch kernels registered as
``torch.ops.sgl_kernel.*``, two SGLang patches, see :mod:`hs_tracer_testbed.runtime.patches`).
This module is the only place that turns it on: it sets the environment for the current process
and for the scheduler processes SGLang spawns (the ``sitecustomize`` in the PYTHONPATH directory
re-applies the patches there), then starts the engine with small CPU settings.

The hs_tracer plugin keeps working in the scheduler processes: plugin loading is untouched, so pass
``env={"HS_TRACER": "1", ...}`` to enable it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

RUNTIME_FLAG = "HS_TRACER_TESTBED_RUNTIME"
# When set, a file that every engine start appends one line to (the pytest test running, if any): how
# the test suite counts its engine starts, whichever program makes them.
START_LOG_ENV = "TESTBED_ENGINE_START_LOG"
PYTHONPATH_DIR = Path(__file__).resolve().parent / "pythonpath"
# Where hs_tracer_testbed itself is importable from: the ``sitecustomize`` imports it at interpreter
# start in every engine process, before anything could extend ``sys.path``.
PACKAGE_ROOT = Path(__file__).resolve().parents[2]

# Small settings that fit a 2-core, few-GiB machine and keep runs deterministic.
DEFAULT_ENGINE_KWARGS: dict[str, Any] = {
    "device": "cpu",
    "attention_backend": "intel_amx",
    "dtype": "float32",
    "disable_cuda_graph": True,
    # On CPU SGLang reads the machine's free memory before and after loading the weights and refuses
    # to start when the drop exceeds this fraction; on a shared machine other processes allocate in
    # between. max_total_tokens below is what bounds the KV cache, so a roomy fraction costs nothing.
    "mem_fraction_static": 0.25,
    "max_total_tokens": 4096,
    "random_seed": 0,
    "log_level": "warning",
    # Text only: a multimodal target (Kimi-K2.5's wrapper) would otherwise need its image processor.
    "enable_multimodal": False,
}


class TestbedRuntimeError(RuntimeError):
    """The CPU testbed runtime cannot be set up in this process."""


def runtime_env() -> dict[str, str]:
    """The environment variables the testbed runtime needs, for this process and its children
    (with those the installed release's own module adds, :func:`.patches.release_patches`)."""
    from hs_tracer_testbed.runtime.patches import release_patches

    ours = (str(PYTHONPATH_DIR), str(PACKAGE_ROOT))
    pythonpath = os.environ.get("PYTHONPATH", "")
    parts = [p for p in pythonpath.split(os.pathsep) if p and p not in ours]
    # The package root goes last: where it is site-packages it must not shadow the caller's path.
    return {
        **release_patches()[0],
        "SGLANG_USE_CPU_ENGINE": "1",
        "TORCHDYNAMO_DISABLE": "1",
        RUNTIME_FLAG: "1",
        "PYTHONPATH": os.pathsep.join([ours[0], *parts, ours[1]]),
    }


def rank_env(overrides: Mapping[str, Any]) -> dict[str, str]:
    """The environment an engine of more than one rank needs on the CPU (none for one rank).

    SGLang binds each CPU rank to the cores of a NUMA node of its own and refuses more ranks than
    nodes unless ``SGLANG_CPU_OMP_THREADS_BIND`` lists the cores of each rank; this machine's cores
    are dealt out to the ranks in turn. ``OMP_NUM_THREADS=1``: each rank computes on one thread, so
    two ranks on two cores do not fight over them.
    """
    ranks = int(overrides.get("tp_size", 1)) * int(overrides.get("pp_size", 1))
    if not overrides.get("enable_dp_attention"):
        ranks *= int(overrides.get("dp_size", 1))
    if ranks == 1:
        return {}
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0]
    return {"SGLANG_CPU_OMP_THREADS_BIND": "|".join(str(cores[i % len(cores)]) for i in range(ranks)),
            "OMP_NUM_THREADS": "1"}


def prepare_process(env: Mapping[str, str] | None = None) -> None:
    """Make this process (and the processes it spawns from now on) a testbed runtime: set the env
    (plus ``env``), put the ``sgl_kernel`` stand-in on ``sys.path`` and install the patches.

    Must run before SGLang is first imported in this process: SGLang decides CPU vs. GPU at import.
    """
    from hs_tracer_testbed.runtime import patches

    os.environ.update(runtime_env())
    if env:
        os.environ.update(env)
    if str(PYTHONPATH_DIR) not in sys.path:
        sys.path.insert(0, str(PYTHONPATH_DIR))
    stand_in = sys.modules.get("sgl_kernel")
    if stand_in is not None and not getattr(stand_in, "HS_TRACER_TESTBED_STAND_IN", False):
        raise TestbedRuntimeError(
            "a real sgl_kernel is already imported in this process; start the CPU testbed in a process "
            "without it"
        )
    patches.install()
    if "sglang" in sys.modules:
        from sglang.srt.utils.common import is_cpu

        if not is_cpu():
            raise TestbedRuntimeError(
                "sglang was imported before the CPU testbed runtime was prepared, so it chose a GPU "
                "code path; call hs_tracer_testbed.runtime.launcher.prepare_process() before importing "
                "sglang (or start the engine in a fresh process)"
            )


def count_start() -> None:
    """Note one engine start in the file ``TESTBED_ENGINE_START_LOG`` names, if set (the test suite
    prints the count per test file)."""
    if log := os.environ.get(START_LOG_ENV):
        with open(log, "a") as f:
            f.write(os.environ.get("PYTEST_CURRENT_TEST", "") + "\n")


def engine_kwargs(
    target: Path | str,
    draft: Path | str | None = None,
    *,
    spec_steps: int = 3,
    topk: int = 1,
    num_draft_tokens: int | None = None,
    **overrides: Any,
) -> dict[str, Any]:
    """The ``sgl.Engine`` keyword arguments for ``target`` (and EAGLE-3 with ``draft``).

    With topk == 1 SGLang requires num_draft_tokens == spec_steps + 1, which is the default here;
    for a tree (topk > 1) the default is topk * spec_steps + 1 (every candidate verified).
    """
    kwargs = {**DEFAULT_ENGINE_KWARGS, "model_path": str(target)}
    if draft is not None:
        if spec_steps < 1 or topk < 1:
            raise ValueError(f"spec_steps and topk must be >= 1, got spec_steps={spec_steps} topk={topk}")
        if num_draft_tokens is None:
            num_draft_tokens = spec_steps + 1 if topk == 1 else topk * spec_steps + 1
        kwargs.update(
            speculative_algorithm="EAGLE3",
            speculative_draft_model_path=str(draft),
            speculative_num_steps=spec_steps,
            speculative_eagle_topk=topk,
            speculative_num_draft_tokens=num_draft_tokens,
        )
    kwargs.update(overrides)
    return kwargs


def start_engine(
    target: Path | str,
    draft: Path | str | None = None,
    *,
    spec_steps: int = 3,
    topk: int = 1,
    num_draft_tokens: int | None = None,
    env: Mapping[str, str] | None = None,
    **overrides: Any,
) -> Any:
    """Start ``sgl.Engine`` on CPU for ``target`` (plain decoding) or with an EAGLE-3 ``draft``.

    ``env`` adds environment variables for this process and the engine's processes (e.g.
    ``{"HS_TRACER": "1"}``); they stay set afterwards, like the runtime env itself (use
    :func:`engine` to have them restored). ``overrides`` go to ``sgl.Engine`` unchanged and win over
    the defaults (``DEFAULT_ENGINE_KWARGS``). The caller must call ``shutdown()`` on the result.
    With ``HS_TRACER`` on, invalid tracer settings raise :class:`hs_tracer.inputs.InputError` (the
    plugin's message) before anything starts.
    """
    from hs_tracer.inputs.env import require_valid

    env = {**rank_env(overrides), **(env or {})}
    require_valid({**os.environ, **env})  # a bad HS_TRACER_* setting: one line, no engine
    prepare_process(env)
    import sglang as sgl

    count_start()
    return sgl.Engine(
        **engine_kwargs(
            target, draft, spec_steps=spec_steps, topk=topk, num_draft_tokens=num_draft_tokens, **overrides
        )
    )


@contextmanager
def engine(
    target: Path | str,
    draft: Path | str | None = None,
    *,
    env: Mapping[str, str] | None = None,
    **kwargs: Any,
) -> Iterator[Any]:
    """Context manager around :func:`start_engine` (same arguments): shuts the engine down on exit
    and restores the ``env`` extras (the runtime env itself stays, since SGLang in this process
    depends on it)."""
    env = {**rank_env(kwargs), **(env or {})}
    saved = {key: os.environ.get(key) for key in env}
    eng = start_engine(target, draft, env=env, **kwargs)
    try:
        yield eng
    finally:
        eng.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value

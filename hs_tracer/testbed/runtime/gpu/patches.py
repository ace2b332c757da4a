"""The GPU testbed's changes to SGLang 0.5.23 (and one debugging wrapper around hs_tracer's hooks),
applied in every process the GPU launcher starts through ``pythonpath/sitecustomize.py``. Never
applied by the production plugin.

* ``sglang.srt.layers.dual_gemm``: the Llama MLP of an EAGLE-3 draft picks SGLang's CuTe-DSL dual
  GEMM on CUDA, which needs ``nvidia-cutlass-dsl`` (not installable next to another torch). Its mode
  selector returns None, the plain GEMM path SGLang uses when the dual GEMM does not apply.
* ``sglang.srt.distributed.device_communicators.triton_symm_mem_ag``: the logits processor's
  all-gather would try NVLink multicast (symmetric memory) on its first eager call. Multicast must
  never run on shared GPU hosts, so every ``MultimemAllGatherer`` is built with ``enabled=False``,
  its own NCCL fallback, instead of trusting it to discover that multicast is absent.
* ``hs_tracer.integrations.sglang.hooks`` (only with ``HS_TRACER_TESTBED_SYNC_DEBUG=1``): each hook
  runs with ``torch.cuda.set_sync_debug_mode("error")`` armed around its own body and restored after,
  so a host-device synchronisation inside hs_tracer raises there (the hook's guard counts it as a
  hook error and switches tracing off) while SGLang's own code runs unchecked.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

from hs_tracer.testbed.runtime.patches import PostImportHook

logger = logging.getLogger("hs_tracer.testbed")

SYNC_DEBUG_FLAG = "HS_TRACER_TESTBED_SYNC_DEBUG"
DUAL_GEMM_MODULE = "sglang.srt.layers.dual_gemm"
SYMM_MEM_AG_MODULE = "sglang.srt.distributed.device_communicators.triton_symm_mem_ag"
HOOKS_MODULE = "hs_tracer.integrations.sglang.hooks"


def no_dual_gemm(module: ModuleType) -> None:
    module.DualGemm._select_mode = lambda self, *args, **kwargs: None


def multimem_off(module: ModuleType) -> None:
    cls = module.MultimemAllGatherer
    if getattr(cls, "_hs_tracer_multimem_off", False):
        return
    original = cls.__init__

    @functools.wraps(original)
    def init(self: Any, max_tokens: int, *, enabled: bool = True, **kwargs: Any) -> None:
        original(self, max_tokens, enabled=False, **kwargs)

    cls.__init__ = init
    cls._hs_tracer_multimem_off = True
    logger.info("hs_tracer GPU testbed: MultimemAllGatherer forced to its NCCL fallback (no multicast)")


def sync_checked(hook: Callable[..., Any],
                 set_mode: Callable[[str], None] | None = None) -> Callable[..., Any]:
    """``hook`` with CUDA sync-debug mode "error" armed around its call, "default" after."""
    if set_mode is None:
        import torch

        set_mode = torch.cuda.set_sync_debug_mode

    @functools.wraps(hook)
    def checked(*args: Any, **kwargs: Any) -> Any:
        set_mode("error")
        try:
            return hook(*args, **kwargs)
        finally:
            set_mode("default")

    return checked


def arm_sync_debug(module: ModuleType) -> None:
    """Wrap every entry of the hooks module's HOOKS list (the plugin registers from that list)."""
    module.HOOKS[:] = [(target, sync_checked(hook), kind) for target, hook, kind in module.HOOKS]
    logger.info("hs_tracer GPU testbed: sync debug mode 'error' armed around %d hooks", len(module.HOOKS))


def patches(environ: Mapping[str, str] = os.environ) -> dict[str, Callable[[ModuleType], None]]:
    out: dict[str, Callable[[ModuleType], None]] = {DUAL_GEMM_MODULE: no_dual_gemm,
                                                    SYMM_MEM_AG_MODULE: multimem_off}
    if environ.get(SYNC_DEBUG_FLAG) == "1":
        out[HOOKS_MODULE] = arm_sync_debug
    return out


_hook = PostImportHook()


def install() -> None:
    """Apply every patch now (module already imported) or right after its first import."""
    _hook.install(patches())

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
* ``sglang.kernels.ops.attention.decode_attention``: for MLA the grouped decode kernel reuses the K
  tile (``next_pow2(Lk)`` wide) as V (``next_pow2(Lv)``), which only compiles when both pad to the
  same width. DeepSeek-V3 (576/512) does; the tiny testbed target (40/32) does not, and plain
  decoding failed to compile. For such shapes only, the kernel is told the cache is not MLA, so it
  loads V from the value view of the same buffer (same values, one more load).
* ``hs_tracer.integrations.sglang.hooks`` (only with ``HS_TRACER_TESTBED_SYNC_DEBUG=1``): each hook
  that runs while serving (per step, or per forward) runs with
  ``torch.cuda.set_sync_debug_mode("error")`` armed around its own body and restored after, so a
  host-device synchronisation inside hs_tracer raises there (the hook's guard counts it as a hook
  error and switches tracing off) while SGLang's own code runs unchecked. The startup hooks (run once,
  before serving) are left unarmed: building the fingerprint probe compiles its kernel and waits
  for it there, by design.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

from hs_tracer_testbed.runtime.patches import PostImportHook

logger = logging.getLogger("hs_tracer_testbed")

SYNC_DEBUG_FLAG = "HS_TRACER_TESTBED_SYNC_DEBUG"
DUAL_GEMM_MODULE = "sglang.srt.layers.dual_gemm"
DECODE_ATTENTION_MODULE = "sglang.kernels.ops.attention.decode_attention"
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
    # To stderr directly: this runs at import, before SGLang configures logging, and the line is the
    # run's evidence that no multicast path is taken.
    print("hs_tracer GPU testbed: MultimemAllGatherer forced to its NCCL fallback (no multicast)",
          file=sys.stderr, flush=True)


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def narrow_mla_decode(module: Any) -> None:
    original = module._decode_grouped_att_m_fwd

    @functools.wraps(original)
    def grouped(q: Any, k_buffer: Any, v_buffer: Any, *args: Any, has_mla: bool = False,
                **kwargs: Any) -> Any:
        lk, lv = int(k_buffer.shape[-1]), int(v_buffer.shape[-1])
        if has_mla and lk not in (576, 288) and _pow2(lk) != _pow2(lv):
            has_mla = False
        return original(q, k_buffer, v_buffer, *args, has_mla=has_mla, **kwargs)

    module._decode_grouped_att_m_fwd = grouped


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

    checked.__hs_tracer_sync_checked__ = True  # type: ignore[attr-defined]
    return checked


# The hooks that run once while SGLang starts (by target method name); every other hook runs while
# serving and is armed.
STARTUP_HOOKS = ("resolve_spec_aux_hidden_state_config", "init_attention_backends", "init_lm_head",
                 "init_cuda_graphs")


def arm_sync_debug(module: ModuleType) -> None:
    """Wrap the serving-time entries of the hooks module's HOOKS list (the plugin registers from it)."""
    armed = 0
    hooks = []
    for target, hook, kind in module.HOOKS:
        if target.rsplit(".", 1)[-1] not in STARTUP_HOOKS:
            hook = sync_checked(hook)
            armed += 1
        hooks.append((target, hook, kind))
    module.HOOKS[:] = hooks
    logger.info("hs_tracer GPU testbed: sync debug mode 'error' armed around %d serving-time hooks", armed)


def patches(environ: Mapping[str, str] = os.environ) -> dict[str, Callable[[ModuleType], None]]:
    out: dict[str, Callable[[ModuleType], None]] = {DUAL_GEMM_MODULE: no_dual_gemm,
                                                    SYMM_MEM_AG_MODULE: multimem_off,
                                                    DECODE_ATTENTION_MODULE: narrow_mla_decode}
    if environ.get(SYNC_DEBUG_FLAG) == "1":
        out[HOOKS_MODULE] = arm_sync_debug
    return out


_hook = PostImportHook()


def install() -> None:
    """Apply every patch now (module already imported) or right after its first import."""
    _hook.install(patches())

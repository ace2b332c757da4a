"""``sgl_kernel.kvcacheio`` (host KV-cache transfers for HiCache, imported at module level, never
called with the hierarchical cache off)."""

from typing import Any

from hs_tracer_testbed.runtime.gpu.standin import missing_op


def __getattr__(name: str) -> Any:
    return missing_op(__name__, name)

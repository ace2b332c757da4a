"""``sgl_kernel.quantization`` (GGUF kernels, imported by SGLang at module level, never called here)."""

from typing import Any

from hs_tracer_testbed.runtime.gpu.standin import missing_op


def __getattr__(name: str) -> Any:
    return missing_op(__name__, name)

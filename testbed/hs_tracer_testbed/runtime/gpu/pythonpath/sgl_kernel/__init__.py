"""Stand-in for the ``sgl_kernel`` package inside the hs_tracer GPU testbed (never in production).

Why: SGLang 0.5.23 imports ~30 names from ``sgl_kernel`` (and its submodules ``quantization``,
``kvcacheio``, ``utils``) at module level on CUDA, but the ``sglang-kernel`` wheel is compiled for
SGLang's own torch and does not load under another one. Only the GPU testbed launcher puts this
directory on ``PYTHONPATH``. The ops SGLang calls on the testbed's path are the pure-torch ones of
``hs_tracer_testbed.runtime.gpu.ops``; every other name is a stub that raises, naming the op, when
called (binding a name at import is fine, computing garbage is not).
"""

from __future__ import annotations

from typing import Any

from hs_tracer_testbed.runtime.gpu.ops import (
    fused_add_rmsnorm,
    moe_align_block_size,
    moe_sum_reduce,
    rmsnorm,
    silu_and_mul,
    weak_ref_tensor,
)
from hs_tracer_testbed.runtime.gpu.standin import missing_op

# SGLang's launch check wants sglang-kernel >= 0.4.9 unless SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1
# (the launcher sets it); the version names what this stands in for.
__version__ = "0.4.10"
HS_TRACER_TESTBED_STAND_IN = True

__all__ = ["fused_add_rmsnorm", "kvcacheio", "moe_align_block_size", "moe_sum_reduce", "quantization",
           "rmsnorm", "silu_and_mul", "utils", "weak_ref_tensor"]


def __getattr__(name: str) -> Any:
    return missing_op(__name__, name)


from . import kvcacheio, quantization, utils  # noqa: E402  SGLang imports these submodules by name

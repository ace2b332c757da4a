"""``sgl_kernel.utils``: the one helper the Triton attention backend calls."""

from hs_tracer_testbed.runtime.gpu.ops import is_arch_support_pdl

__all__ = ["is_arch_support_pdl"]

"""CPU testbed: a tiny trained DeepSeek-V3 target, its EAGLE-3 draft and their training data.

``ensure_testbed()`` returns a built testbed (building it into a shared cache on first use);
``hs-tracer testbed build --out DIR`` writes one anywhere. The CPU runtime that lets SGLang run
EAGLE-3 without a GPU lives in :mod:`hs_tracer_testbed.runtime`.

This package imports nothing heavy at import time: the runtime's ``sitecustomize`` hook imports
``hs_tracer_testbed.runtime`` (and so this file) in every SGLang process.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hs_tracer_testbed.build import Recipe, TestbedPaths, ensure_testbed

__all__ = ["Recipe", "TestbedPaths", "ensure_testbed"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from hs_tracer_testbed import build

        return getattr(build, name)
    raise AttributeError(f"module 'hs_tracer_testbed' has no attribute {name!r}")

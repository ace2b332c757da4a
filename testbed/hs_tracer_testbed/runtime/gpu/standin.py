"""What the GPU testbed provides in place of packages SGLang 0.5.23 imports but that cannot be
installed next to another torch: stubs that raise when called, and fallback modules for
``flash_mla`` and ``IPython.display``.

``flash_mla`` is imported by SGLang's EAGLE worker whenever the decode CUDA graph is captured (three
names, never called with the Triton attention backend); ``IPython.display`` by ``sglang.utils`` at
module level. The fallbacks are found only when no real package is installed (the finder sits at
the end of ``sys.meta_path``).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Callable
from typing import Any, NoReturn


class UnavailableKernelError(NotImplementedError):
    """SGLang called a kernel the GPU testbed does not provide."""


def missing_op(module: str, name: str) -> Callable[..., NoReturn]:
    """A stand-in for ``module.name`` that raises when called. Dunder names stay missing (so
    ``hasattr`` probes, pickling and ``from x import *`` behave)."""
    if name.startswith("__") and name.endswith("__"):
        raise AttributeError(name)

    def unavailable(*_args: Any, **_kwargs: Any) -> NoReturn:
        raise UnavailableKernelError(
            f"{module}.{name} was called, but the hs_tracer GPU testbed does not provide it; keep "
            "SGLang on the launcher's flags (Triton attention and MoE, PyTorch sampling)")

    unavailable.__name__ = unavailable.__qualname__ = name
    return unavailable


class _MissingAttrs(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        return missing_op(self.__name__, name)


def _flash_mla_interface(module: types.ModuleType) -> None:
    module.FlashMLASchedMeta = type("FlashMLASchedMeta", (), {})


def _display(module: types.ModuleType) -> None:
    module.HTML = lambda *a, **k: None
    module.display = lambda *a, **k: None


# module name -> (is a package, fill-in)
FALLBACKS: dict[str, tuple[bool, Callable[[types.ModuleType], None] | None]] = {
    "flash_mla": (True, None),
    "flash_mla.flash_mla_interface": (False, _flash_mla_interface),
    "IPython": (True, None),
    "IPython.display": (False, _display),
}


class _Loader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return _MissingAttrs(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        module.HS_TRACER_TESTBED_STAND_IN = True  # type: ignore[attr-defined]
        fill = FALLBACKS[module.__name__][1]
        if fill is not None:
            fill(module)


class FallbackFinder(importlib.abc.MetaPathFinder):
    """Provides the FALLBACKS modules when every other finder failed."""

    def find_spec(self, fullname: str, path: object, target: object = None) -> Any:
        entry = FALLBACKS.get(fullname)
        if entry is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Loader(), is_package=entry[0])


def install_fallbacks() -> None:
    if not any(isinstance(f, FallbackFinder) for f in sys.meta_path):
        sys.meta_path.append(FallbackFinder())

"""Stand-in for the ``sgl_kernel`` package inside the hs_tracer CPU testbed (never in production).

Why: with ``SGLANG_USE_CPU_ENGINE=1`` SGLang 0.5.23 imports ~80 names from ``sgl_kernel`` at module
level, but the CPU build of sgl-kernel is not published. Only the testbed launcher puts this
directory on ``PYTHONPATH``. Importing it registers the testbed's pure-torch CPU ops under
``torch.ops.sgl_kernel`` (see ``hs_tracer_testbed.runtime.kernels``) and exports them by name;
every other name resolves to a stub that raises a clear error naming the op when called, so a
code path that needs an unported kernel fails loudly instead of computing garbage. The submodules
in ``STUB_SUBMODULES``, which some releases import at module level without a fallback (0.5.12:
``sgl_kernel.kvcacheio``), are stand-ins of the same kind; every other submodule stays missing, so
SGLang's own ``ImportError`` fallbacks keep working.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Any, NoReturn

import torch

from hs_tracer_testbed.runtime.kernels import OP_NAMES, register_ops

__version__ = "0.0.0+hs-tracer-testbed"
STUB_SUBMODULES = ("kvcacheio",)
HS_TRACER_TESTBED_STAND_IN = True

register_ops()
for _name in OP_NAMES:
    globals()[_name] = getattr(torch.ops.sgl_kernel, _name)
del _name


class UnavailableKernelError(NotImplementedError):
    """An sgl-kernel op that the CPU testbed does not implement was called."""


def _stub(name: str):
    def unavailable(*args: Any, **kwargs: Any) -> NoReturn:
        raise UnavailableKernelError(
            f"sgl_kernel.{name} was called, but the hs_tracer CPU testbed's sgl_kernel stand-in does not "
            f"implement it (implemented: {', '.join(OP_NAMES)}). Keep the model on the layers' "
            "forward_native paths, or add a pure-torch version in testbed/hs_tracer_testbed/runtime/kernels."
        )

    unavailable.__name__ = name
    unavailable.__qualname__ = name
    return unavailable


def __getattr__(name: str):
    if name.startswith("__") and name.endswith("__"):
        raise AttributeError(name)
    return _stub(name)


class _StubSubmodules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """The ``sgl_kernel.<name>`` submodules of ``STUB_SUBMODULES``: every public name is a stub."""

    def find_spec(self, fullname: str, path: object, target: object = None) -> object:
        if fullname not in {f"{__name__}.{sub}" for sub in STUB_SUBMODULES}:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = ModuleType(spec.name)
        module.__getattr__ = __getattr__  # type: ignore[method-assign]
        return module

    def exec_module(self, module: ModuleType) -> None:
        return None


if not any(isinstance(f, _StubSubmodules) for f in sys.meta_path):
    sys.meta_path.append(_StubSubmodules())

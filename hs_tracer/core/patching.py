"""Wrapping an engine's methods, for an engine without a hook registry of its own (vLLM): a hook runs
before or after the method it wraps, with the method's own arguments, and never changes them or its
result (its handlers are guarded: :meth:`hs_tracer.core.state.Slot.guarded`). :func:`unwrap_all` takes
every wrapper back out, as OpenTelemetry's instrumentors uninstrument."""

from __future__ import annotations

import functools
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_ORIGINAL = "__hs_tracer_original__"


@dataclass(frozen=True)
class _Applied:
    """One wrapped attribute and what :func:`unwrap_all` puts back."""

    target: str
    owner: Any
    name: str
    raw: Any  # the attribute as the class's own ``__dict__`` held it; None: inherited from a base


_APPLIED: list[_Applied] = []


def wrap(target: str, hook_type: str, handler: Callable[..., Any]) -> None:
    """Wrap ``module.Class.method`` (``target``) on its class so ``handler`` runs ``hook_type``
    ("before": ``handler(self, *args, **kwargs)``; "after": ``handler(result, self, *args, **kwargs)``)."""
    owner_path, _, name = target.rpartition(".")
    module, _, cls_name = owner_path.rpartition(".")
    owner = pkgutil.resolve_name(f"{module}:{cls_name}")
    raw = owner.__dict__.get(name)
    original = getattr(owner, name)

    if hook_type == "before":
        @functools.wraps(original)
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            handler(self, *args, **kwargs)
            return original(self, *args, **kwargs)
    elif hook_type == "after":
        @functools.wraps(original)
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(self, *args, **kwargs)
            handler(result, self, *args, **kwargs)
            return result
    else:
        raise ValueError(f"unknown hook type {hook_type!r}")
    setattr(wrapper, _ORIGINAL, original)
    setattr(owner, name, wrapper)
    _APPLIED.append(_Applied(target, owner, name, raw))


def applied() -> list[str]:
    """The targets wrapped in this process, in the order they were."""
    return [a.target for a in _APPLIED]


def unwrap_all() -> None:
    """Undo every :func:`wrap`, newest first: each class gets back the very attribute it had (an
    inherited method is deleted from the subclass again)."""
    while _APPLIED:
        a = _APPLIED.pop()
        if a.raw is None:
            delattr(a.owner, a.name)
        else:
            setattr(a.owner, a.name, a.raw)

"""Registering hs_tracer's hooks in SGLang's ``HookRegistry`` and taking them back out.

SGLang applies the registered hooks once, before the engine starts (``HookRegistry.apply_hooks``):
each target's attribute becomes a chain of wrappers, each (its code in the registry's module)
holding the one below as ``__wrapped__``. The registry has no removal, so :func:`unregister_all`
does it: it drops hs_tracer's entries, puts back the attribute the chain was built on (and every
module binding SGLang redirected to the chain), then lets SGLang rebuild the chain for any other
plugin's hooks. It reads the registry's ``_hooks`` and ``_patched`` tables, as every supported
release keeps them.
"""

from __future__ import annotations

import contextlib
import pkgutil
import sys
import types
from collections.abc import Callable
from typing import Any

_REGISTERED: list[tuple[str, Callable[..., Any]]] = []


def register(target: str, hook: Callable[..., Any], hook_type: Any) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry  # the engine: only inside its process

    HookRegistry.register(target, hook, hook_type)
    _REGISTERED.append((target, hook))


def registered() -> list[str]:
    """The targets hs_tracer registered hooks on in this process, in order."""
    return [t for t, _ in _REGISTERED]


def unregister_all() -> None:
    """Take every hook :func:`register` put in back out, restoring each patched attribute."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    ours = {}
    for target, hook in _REGISTERED:
        ours.setdefault(target, set()).add(id(hook))
    _REGISTERED.clear()
    for target, ids in ours.items():
        entries = HookRegistry._hooks.get(target, [])
        others = [e for e in entries if id(e[1]) not in ids]
        patched = target in HookRegistry._patched
        if patched:
            _restore(target, sys.modules[HookRegistry.__module__].__file__)
            HookRegistry._patched.discard(target)
        if not others:
            HookRegistry._hooks.pop(target, None)
            continue
        HookRegistry._hooks[target] = others
        if patched:  # another plugin's hooks stay applied: SGLang applies what is not applied yet
            HookRegistry.apply_hooks()


def _restore(target: str, registry_file: str | None) -> None:
    """Put back the attribute below the chain of wrappers SGLang's registry (``registry_file``) built,
    as the class or module held it."""
    obj_path, _, attr = target.rpartition(".")
    obj = pkgutil.resolve_name(obj_path)
    raw = obj.__dict__.get(attr) if isinstance(obj, type) else getattr(obj, attr)
    kind = type(raw) if isinstance(raw, (classmethod, staticmethod)) else None
    chain = raw.__func__ if kind is not None else raw
    fn = chain
    while getattr(getattr(fn, "__code__", None), "co_filename", None) == registry_file:
        fn = fn.__wrapped__
    inherited = next((b.__dict__[attr] for b in getattr(obj, "__mro__", ())[1:] if attr in b.__dict__), None)
    if kind is None and inherited is fn:
        delattr(obj, attr)  # SGLang set the chain on the subclass over a method it inherits
    else:
        setattr(obj, attr, kind(fn) if kind is not None else fn)
    _rebind(raw, fn, obj)


def _rebind(chain: Any, original: Any, owner: Any) -> None:
    """Point back every module binding SGLang redirected from ``original`` to ``chain`` (it copies a
    patch into each module that had imported the name)."""
    for module in list(sys.modules.values()):
        if module is owner or not isinstance(module, types.ModuleType):
            continue
        try:
            names = [k for k, v in vars(module).items() if v is chain]
        except TypeError:
            continue
        for name in names:
            with contextlib.suppress(AttributeError, TypeError):
                setattr(module, name, original)

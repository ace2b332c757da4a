"""Registering hs_tracer's hooks in SGLang's ``HookRegistry`` and taking them back out.

SGLang applies the registered hooks once, before the engine starts (``HookRegistry.apply_hooks``):
each target's attribute becomes a chain of wrappers, one per function hook on it, each wrapper's
``__wrapped__`` the one below. The registry has no removal, so :func:`unregister_all` does it: it
drops hs_tracer's entries, puts back the attribute the chain was built on (and every module binding
SGLang redirected to the chain), then lets SGLang rebuild the chain for any other plugin's hooks.
"""

from __future__ import annotations

import pkgutil
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
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType, _propagate_patch

    ours = {}
    for target, hook in _REGISTERED:
        ours.setdefault(target, set()).add(id(hook))
    _REGISTERED.clear()
    for target, ids in ours.items():
        entries = HookRegistry._hooks.get(target, [])
        others = [e for e in entries if id(e[1]) not in ids]
        patched = target in HookRegistry._patched
        if patched:
            # One wrapper per function hook (a class REPLACE substitutes instead of wrapping).
            layers = sum(1 for ht, h, _ in entries if not (isinstance(h, type) and ht == HookType.REPLACE))
            _restore(target, layers, _propagate_patch)
            HookRegistry._patched.discard(target)
        if not others:
            HookRegistry._hooks.pop(target, None)
            continue
        HookRegistry._hooks[target] = others
        if patched:  # another plugin's hooks stay applied
            HookRegistry._apply_target(target, others)
            HookRegistry._patched.add(target)


def _restore(target: str, layers: int, propagate: Callable[[Any, Any, Any], int]) -> None:
    """Put back the attribute below ``layers`` wrappers, as the class or module held it."""
    obj_path, _, attr = target.rpartition(".")
    obj = pkgutil.resolve_name(obj_path)
    raw = obj.__dict__.get(attr) if isinstance(obj, type) else getattr(obj, attr)
    kind = type(raw) if isinstance(raw, (classmethod, staticmethod)) else None
    chain = raw.__func__ if kind is not None else raw
    fn = chain
    for _ in range(layers):
        fn = fn.__wrapped__
    inherited = next((b.__dict__[attr] for b in getattr(obj, "__mro__", ())[1:] if attr in b.__dict__), None)
    if kind is None and inherited is fn:
        delattr(obj, attr)  # SGLang set the chain on the subclass over a method it inherits
    else:
        setattr(obj, attr, kind(fn) if kind is not None else fn)
    propagate(raw, fn, obj)  # module-level bindings SGLang pointed at the chain

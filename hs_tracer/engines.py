"""The engine interface and the registry of engines: what the engine-neutral code asks of a serving
engine, and where each engine's adapter lives.

Each engine is one package, ``hs_tracer/integrations/<engine>/``, whose ``engine`` module holds an
object with the :class:`Engine` interface; the registry below names it by a dotted path and imports it
only when asked, so listing the engines imports no adapter and no engine. The neutral layers (static
checks, diagnosis, export) and ``hs-tracer check --engine`` reach an engine only through
:func:`get`; a new engine is its package plus one line in :data:`_BUILT_IN`. An engine packaged
outside hs_tracer registers under the ``hs_tracer.engines`` entry-point group instead (name ->
``"module:attribute"``), which every process (the export process too) finds by itself.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Mapping
from typing import Any, Protocol

from hs_tracer.errors import InputError

# name -> "module:attribute" of the adapter's engine object. One line per engine.
_BUILT_IN: dict[str, str] = {
    "sglang": "hs_tracer.integrations.sglang.engine:ENGINE",
    "vllm": "hs_tracer.integrations.vllm.engine:ENGINE",
}
_REGISTRY: dict[str, str] = dict(_BUILT_IN)
DEFAULT = next(iter(_BUILT_IN))  # the engine a command means when it names none
ENTRY_POINT_GROUP = "hs_tracer.engines"  # where an engine packaged outside hs_tracer registers


class Engine(Protocol):
    """What is specific to one serving engine, behind one name."""

    name: str  # the registry key, as written on the command line (``--engine NAME[==RELEASE]``)
    display_name: str  # as prose names it
    honoured_flags: frozenset[str]  # the draft norm flags its draft model has a branch for

    def newest_release(self) -> str:
        """The newest release whose rules hs_tracer knows (the default when none is installed)."""

    def installed_version(self) -> str | None:
        """The installed release, read from package metadata without importing the engine."""

    def problems(self) -> list[str]:
        """The version guard: why tracing would stay off on the installed release (empty: none)."""

    def served_flags(self, draft_config: Mapping[str, Any]) -> dict[str, bool]:
        """Each draft norm flag as the engine's newest supported release applies it."""

    def flags_release(self, engine_version: str) -> str:
        """The release whose norm-flag reading :meth:`served_flags` describes, for a message."""

    def layer_id_rules(self, engine_version: str | None) -> Any:
        """The release's rules for a draft config's layer ids (None: the newest release), the object
        :mod:`hs_tracer.sources` and the static checks read; None where no rule depends on the
        release. A release whose rules hs_tracer has not read is an input error."""

    def rules_label(self, engine_version: str | None) -> str:
        """The releases sharing ``engine_version``'s layer-id rules, as messages name them."""

    def layer_0_fixed_in(self, engine_version: str | None) -> str | None:
        """The oldest newer release that feeds a captured embedding where ``engine_version`` crashes
        on it (None: none does, or it does not crash)."""

    def preflight(self, args: Any, pinned: str) -> Any:
        """``hs-tracer check``: the engine's static checks on the parsed arguments, at release
        ``pinned`` (empty: the installed one, else the newest known); a ``CheckResult``."""

    def human(self, result: Any, verbose: bool = False) -> str:
        """The preflight result as text."""

    def install(self, cfg: Any) -> int:
        """Install the tracer state and every hook of the installed release; the hooks installed."""

    def uninstall(self) -> None:
        """Remove every hook :meth:`install` put in, restoring each patched attribute, and stop tracing."""


def names() -> list[str]:
    """The engines registered so far, built-in first (an entry point's once :func:`get` looked it up:
    listing them all would read every installed distribution's metadata)."""
    return list(_REGISTRY)


def register(name: str, path: str) -> None:
    """Register an engine outside hs_tracer (``path``: ``"module:attribute"`` of its engine object)."""
    _REGISTRY[name] = path


def unregister(name: str) -> None:
    """Forget an engine :func:`register` added (a built-in engine stays)."""
    if name not in _BUILT_IN:
        _REGISTRY.pop(name, None)


def get(name: str) -> Engine:
    """The engine registered as ``name``, its adapter imported now; an unknown name is an input error."""
    path = _REGISTRY.get(name)
    if path is None:
        found = {ep.name: ep.value for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}
        path = found.get(name)
        if path is None:
            known = ", ".join({**_REGISTRY, **found})
            raise InputError(f"--engine {name} is not supported (one of: {known})")
        _REGISTRY[name] = path
    module, _, attr = path.partition(":")
    engine: Engine = getattr(importlib.import_module(module), attr)
    return engine


def newest_release(name: str = DEFAULT) -> str:
    """The newest release of engine ``name`` whose rules hs_tracer knows: the release a message names
    for rules read from that engine's newest source."""
    return get(name).newest_release()


def parse(spec: str) -> tuple[Engine, str]:
    """``NAME`` or ``NAME==RELEASE`` (spaces ignored) -> the engine and the pinned release (or "")."""
    name, _, pinned = spec.replace(" ", "").partition("==")
    return get(name), pinned

"""What every engine's release table declares: its hooks and its release families. Data only, no
engine import.

An engine's release table (``integrations/sglang/releases/`` for SGLang,
``integrations/vllm/versions.py`` for vLLM) lists one :class:`ReleaseFamily` per group of releases
whose internals agree, each with the :class:`Hook` s its adapter wraps. The plugin's version guard,
the hook names (guard labels and ``HS_TRACER_FAULT_INJECT`` values), the tests and the support
matrix in docs/versions.md come from these tables.
"""

from __future__ import annotations

import enum
import inspect
import pkgutil
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar


class Phase(str, enum.Enum):
    """When a hook runs: this decides how it is guarded and which hooks a debugging wrapper arms."""

    STARTUP = "startup"  # once per runner or worker while the engine starts, before serving
    CAPTURE = "capture"  # each forward of a model body or of the logits processor (recorded at graph capture)
    STEP = "step"  # each prefill or verify step, in the scheduler's Python, never under torch.compile


@dataclass(frozen=True)
class Hook:
    """One hook: the engine's ``target`` (dotted path ``module.Class.method``), when it runs, and
    the hs_tracer function it runs.

    ``params`` are the target's parameters (after self) the handler reads; the guard checks them
    against the installed signature. ``reads`` are the attributes it reads from them (documented in
    the support matrix; a missing one switches tracing off at the first call, never serving).
    """

    target: str
    type: str  # "before" or "after"
    handler: str  # "module:function"
    phase: Phase
    params: tuple[str, ...] = ()
    reads: tuple[str, ...] = ()
    worker: str = ""  # SGLang: "V1" or "V2" for the speculative worker's own hooks; "" for the shared ones
    # A model body's hook: where its class is not importable (a kernel this machine lacks, a release
    # without that model) none of its models can be served, so the hook is left out instead of
    # switching tracing off.
    optional: bool = False

    @property
    def name(self) -> str:
        """``Class.method`` (or the function's name): guard label and fault-injection name."""
        parts = self.target.split(".")
        return ".".join(parts[-2:]) if parts[-2][:1].isupper() else parts[-1]


@dataclass(frozen=True)
class ReleaseFamily:
    """Releases of one engine whose hook targets and signatures agree."""

    name: str
    releases: tuple[str, ...]  # exact releases (their local and .postN builds count as them)
    hooks: tuple[Hook, ...]


def handler_name(handler: str, families: Iterable[ReleaseFamily | None]) -> str:
    """The name a handler (``module:function``) runs under: its hook's in the first of ``families``
    (the installed release's first, then every family of the table) that lists it."""
    for family in families:
        for hook in family.hooks if family is not None else ():
            if hook.handler == handler:
                return hook.name
    raise KeyError(f"{handler} is no hook's handler in the version table")


FamilyT = TypeVar("FamilyT", bound=ReleaseFamily)


def family_or_problem(engine: str, version: str | None, family: FamilyT | None,
                      supported: str) -> FamilyT | str:
    """The family to check the installed engine against, or why it cannot be traced before any hook
    target is looked at: it is not installed, or no family lists its release (``supported``: the
    releases that are)."""
    if version is None:
        return f"{engine} is not installed"
    if family is None:
        return f"{engine} {version} is not a supported release ({supported})"
    return family


def signature_problems(hooks: Sequence[Hook], targets: Iterable[str] | None = None) -> list[str]:
    """The hook targets (all of ``hooks``', or ``targets``) the installed engine lacks, or whose
    signature no longer takes a parameter a handler reads, as short phrases (empty: all there)."""
    found: list[str] = []
    for target in sorted(set(targets) if targets is not None else {h.target for h in hooks}):
        params = {p for h in hooks if h.target == target for p in h.params}
        try:
            fn = pkgutil.resolve_name(target)
        except (ImportError, AttributeError) as exc:
            found.append(f"{target} is missing ({type(exc).__name__})")
            continue
        try:
            names = set(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            found.append(f"{target} has no inspectable signature")
            continue
        missing = sorted(p for p in params if p not in names)
        if missing:
            found.append(f"{target} no longer takes {', '.join(missing)}")
    return found

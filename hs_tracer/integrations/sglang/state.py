"""Per-process tracer state and the fail-safe guard every hook runs under.

One :class:`TracerState` per scheduler process. A hook that raises is counted, logged once and
switches the tracer off; SGLang's own call then proceeds exactly as if hs_tracer were not there.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from hs_tracer.config import TracerConfig

logger = logging.getLogger("hs_tracer")

F = TypeVar("F", bound=Callable[..., Any])


@dataclass
class TracerState:
    config: TracerConfig
    enabled: bool = True
    hook_errors: int = 0
    disabled_reason: str | None = None
    target: dict[str, Any] = field(default_factory=dict)  # what the target runner looks like
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def fail(self, where: str, exc: BaseException) -> None:
        """Record a hook error and switch tracing off for the rest of this process's life."""
        with self._lock:
            self.hook_errors += 1
            first = self.enabled
            self.enabled = False
            self.disabled_reason = f"{where}: {type(exc).__name__}: {exc}"
        if first:
            logger.error("hs_tracer: error in %s, tracing switched off; serving continues", where,
                         exc_info=exc)
        self.write_report()

    def status(self) -> dict[str, Any]:
        from sglang.srt.plugins.hook_registry import HookRegistry

        return {
            "pid": os.getpid(),
            "enabled": self.enabled,
            "hooks_applied": sorted(t for t in HookRegistry._patched if t in _own_targets()),
            "hook_errors": self.hook_errors,
            "disabled_reason": self.disabled_reason,
            "target": self.target,
        }

    def write_report(self) -> None:
        """Write this process's status to ``HS_TRACER_REPORT_DIR`` (atomic rename), if set."""
        report_dir = self.config.report_dir
        if report_dir is None:
            return
        report_dir.mkdir(parents=True, exist_ok=True)
        path = report_dir / f"scheduler-{os.getpid()}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.status(), indent=2, default=str))
        tmp.replace(path)


_STATE: TracerState | None = None


def _own_targets() -> set[str]:
    from hs_tracer.integrations.sglang.hooks import HOOKS

    return {target for target, _hook, _type in HOOKS}


def install(cfg: TracerConfig) -> TracerState:
    global _STATE
    _STATE = TracerState(cfg)
    return _STATE


def current() -> TracerState | None:
    return _STATE


def guarded(where: str) -> Callable[[F], F]:
    """Run a hook only while tracing is on; turn any exception into :meth:`TracerState.fail`.

    The wrapped hook returns ``None`` on every path SGLang's HookRegistry treats as "no change".
    """

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            state = _STATE
            if state is None or not state.enabled:
                return None
            try:
                return fn(state, *args, **kwargs)
            except Exception as exc:  # the tracer must never break serving
                state.fail(where, exc)
                return None

        return wrapper  # type: ignore[return-value]

    return decorate

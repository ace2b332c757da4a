"""SGLang plugin entry point (group ``sglang.srt.plugins``), called in every SGLang process.

With ``HS_TRACER`` unset this module imports nothing beyond the standard library and registers
nothing. With ``HS_TRACER=1`` it checks the installed SGLang against its release family
(:mod:`.versions`) and registers the hooks that family lists (:func:`.hooks.hook_table`) through
SGLang's own ``HookRegistry``.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from hs_tracer import config
from hs_tracer.core.plugin import called_from, settings
from hs_tracer.integrations.sglang import releases, versions
from hs_tracer.integrations.sglang.engine import ENGINE

if TYPE_CHECKING:
    from hs_tracer.integrations.sglang.hooks import Wrap

logger = logging.getLogger("hs_tracer")


def register(wrap: Wrap | None = None) -> None:
    """Entry point. Never raises: a broken tracer must not stop SGLang from starting.

    SGLang calls it without arguments. ``wrap`` goes to :func:`.hooks.hook_table`: the GPU testbed's
    runtime binds its debugging wrapper here (``functools.partial``); production passes none."""
    if not config.enabled(os.environ):
        return
    try:
        if not _in_scheduler_process():
            # The launcher, tokenizer and detokenizer processes run no model: nothing to trace there,
            # and importing the hook targets would only slow their start. Say so here if no
            # scheduler process will ever reach the plugin.
            problem = _entry_problem()
            if problem:
                logger.warning("hs_tracer: tracing stays off: %s", problem)
            return
        _register(wrap)
    except Exception:  # the plugin must never take serving down
        logger.exception("hs_tracer: failed to register, tracing stays off")


def _in_scheduler_process() -> bool:
    """SGLang calls ``load_plugins()`` first thing in its scheduler entry: look for that frame."""
    return called_from(releases.SCHEDULER_ENTRIES)


def _entry_problem() -> str | None:
    """Why no scheduler process of the installed SGLang would register hooks, without importing it:
    an unsupported release, or a scheduler entry that its source no longer defines."""
    version = versions.installed_version()
    if version is None:
        return None
    family = releases.family_for(version)
    if family is None:
        return f"sglang {version} is not a supported release ({releases.supported_text()})"
    module, function = family.scheduler_entry
    try:
        origin = getattr(importlib.util.find_spec(module), "origin", None)
        source = Path(origin).read_text(encoding="utf-8") if origin else ""
    except (ImportError, OSError):
        source = ""
    if f"def {function}(" not in source:
        return (f"sglang {version} has no scheduler entry {module}.{function}, where hs_tracer expects "
                "SGLang to load plugins in each scheduler process")
    return None


def _register(wrap: Wrap | None = None) -> None:
    cfg = settings(os.environ)
    if cfg is None:
        return

    found = versions.problems()
    family = versions.installed_family()
    version = versions.installed_version()
    if found or family is None:
        status = f" ({releases.support(version)})" if family is not None else ""
        logger.warning("hs_tracer: tracing stays off for this SGLang: %s%s", "; ".join(found), status)
        return

    n = ENGINE.install(cfg, wrap)
    # One line: the release, its support status and what was registered (an untested release says so).
    log = logger.warning if releases.is_untested(version) else logger.info
    log("hs_tracer: %s; %d hooks registered", releases.support(version), n)

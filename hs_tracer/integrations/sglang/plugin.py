"""SGLang plugin entry point (group ``sglang.srt.plugins``), called in every SGLang process.

With ``HS_TRACER`` unset this module imports nothing beyond the standard library and registers
nothing. With ``HS_TRACER=1`` it checks the installed SGLang against :mod:`.versions` and registers
the hooks of :mod:`.hooks` through SGLang's own ``HookRegistry``.
"""

from __future__ import annotations

import logging
import os
import sys

from hs_tracer import config

# Where SGLang 0.5.23 starts a scheduler process (module, function); it calls load_plugins() there.
SCHEDULER_ENTRY = ("sglang.srt.managers.scheduler", "run_scheduler_process")

logger = logging.getLogger("hs_tracer")


def register() -> None:
    """Entry point. Never raises: a broken tracer must not stop SGLang from starting."""
    if not config.enabled(os.environ):
        return
    if not _in_scheduler_process():
        # The launcher, tokenizer and detokenizer processes run no model: nothing to trace there,
        # and importing the hook targets would only slow their start.
        return
    try:
        _register()
    except Exception:  # the plugin must never take serving down
        logger.exception("hs_tracer: failed to register, tracing stays off")


def _in_scheduler_process() -> bool:
    """SGLang calls ``load_plugins()`` first thing in ``run_scheduler_process``: look for that frame."""
    frame = sys._getframe(1)
    while frame is not None:
        if (frame.f_code.co_name == SCHEDULER_ENTRY[1]
                and frame.f_globals.get("__name__") == SCHEDULER_ENTRY[0]):
            return True
        frame = frame.f_back
    return False


def _register() -> None:
    from hs_tracer.inputs import env

    cfg, error = env.validate(os.environ)
    if error:
        logger.error("%s", error)
        return
    logger.setLevel(cfg.log_level)

    from hs_tracer.integrations.sglang import versions

    found = versions.problems()
    if found:
        logger.warning("hs_tracer: tracing stays off for this SGLang: %s", "; ".join(found))
        return

    from sglang.srt.plugins.hook_registry import HookRegistry

    from hs_tracer.integrations.sglang import hooks

    hooks.install_state(cfg)
    for target, hook, hook_type in hooks.HOOKS:
        HookRegistry.register(target, hook, hook_type)
    logger.info("hs_tracer: %d hooks registered", len(hooks.HOOKS))

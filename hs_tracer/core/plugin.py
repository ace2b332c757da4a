"""What every engine's plugin entry does before it touches the engine: find out whether this process
is one that runs the model, and read and validate the ``HS_TRACER_*`` settings."""

from __future__ import annotations

import logging
import sys
from collections.abc import Collection, Mapping

from hs_tracer.config import TracerConfig
from hs_tracer.inputs import env

logger = logging.getLogger("hs_tracer")


def called_from(entries: Collection[tuple[str, str]]) -> bool:
    """Whether a ``(module, function)`` of ``entries`` is on the calling stack: the engine loads
    plugins in every process, and only the ones that run the model have its entry below them."""
    frame = sys._getframe(1)
    while frame is not None:
        if (frame.f_globals.get("__name__"), frame.f_code.co_name) in entries:
            return True
        frame = frame.f_back
    return False


def settings(environ: Mapping[str, str]) -> TracerConfig | None:
    """The validated settings at the log level they ask for, or None after one error line that
    says which setting is wrong (tracing then stays off, serving goes on)."""
    cfg, error = env.validate(environ)
    if error:
        logger.error("%s", error)
        return None
    logger.setLevel(cfg.log_level)
    return cfg

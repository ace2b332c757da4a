"""vLLM plugin entry point (group ``vllm.general_plugins``), which vLLM calls in every process.

With ``HS_TRACER`` unset this module imports nothing beyond the standard library and wraps nothing.
With ``HS_TRACER=1``, in a process that runs vLLM's engine core or a worker, it checks the installed
vLLM against :mod:`.versions` and wraps the hooks its release family lists there.
"""

from __future__ import annotations

import logging
import os

from hs_tracer import config
from hs_tracer.core.plugin import called_from, settings
from hs_tracer.integrations.vllm import versions
from hs_tracer.integrations.vllm.engine import ENGINE

logger = logging.getLogger("hs_tracer")

# Where vLLM loads general plugins in a process that runs a model or a scheduler: the engine core's
# constructor and a worker's initialisation. (The front-end process loads them while it builds the
# engine config; it runs neither, unless the engine core runs inside it: multiprocessing off.)
ENGINE_ENTRIES = frozenset({("vllm.v1.engine.core", "__init__"),
                            ("vllm.v1.worker.worker_base", "init_worker")})


def register() -> None:
    """Entry point. Never raises: a broken tracer must not stop vLLM from starting."""
    if not config.enabled(os.environ):
        return
    try:
        if _in_engine_process():
            _register()
    except Exception:  # the plugin must never take serving down
        logger.exception("hs_tracer: failed to register, tracing stays off")


def _in_engine_process() -> bool:
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1").strip() == "0":
        return True  # the engine core runs in the process that loads the plugins first
    return called_from(ENGINE_ENTRIES)


def _register() -> None:
    cfg = settings(os.environ)
    if cfg is None:
        return
    found = versions.problems()
    family = versions.installed_family()
    if found or family is None:
        logger.warning("hs_tracer: tracing stays off for this vLLM: %s", "; ".join(found))
        return
    n = ENGINE.install(cfg)
    if n:
        logger.info("hs_tracer: %d hooks applied for vllm %s", n, family.name)

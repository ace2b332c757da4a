"""SGLang's scheduler, detokenizer and data-parallel controller processes forked from a server
process that has imported SGLang already, instead of spawned as fresh interpreters.

Why: SGLang forces multiprocessing's ``spawn`` start method (CUDA cannot be forked), so each of an
engine's processes imports SGLang and torch again: about 6.5 CPU seconds each on the 2-core
machine, most of what a CPU engine start costs. The testbed has no CUDA: multiprocessing's
``forkserver`` method starts one clean server process per engine process (it imports SGLang once,
runs no model, starts no thread) and forks each child from it. The children run the same SGLang
code as spawned ones and load plugins themselves (SGLang's ``load_plugins()`` in each scheduler
entry: hs_tracer registers there as in production), with two differences spawn does not have,
undone here: a forked child inherits the server's environment, not the launcher's at
``Process.start()`` (:func:`_in_env` restores the launcher's), and its parent is the server, to
which SGLang's children send ``SIGQUIT`` when they fail (the server passes it on to the launcher).
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import signal
from collections.abc import Callable
from multiprocessing import context
from multiprocessing.popen_forkserver import Popen
from types import ModuleType
from typing import Any

# What the server imports before forking: the first makes it pass SIGQUIT on to the launcher; the
# model registry imports every model module of SGLang (about 2 CPU s of each scheduler's start).
PRELOAD = ["hs_tracer_testbed.runtime.forkserver_signals", "sglang.srt.managers.scheduler",
           "sglang.srt.managers.detokenizer_manager", "sglang.srt.managers.data_parallel_controller",
           "sglang.srt.models.registry"]


def _in_env(env: dict[str, str], target: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run ``target`` in the forked child with the launcher's environment at ``Process.start()``
    and SIGQUIT's default action, as in a spawned child."""
    os.environ.clear()
    os.environ.update(env)
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)
    return target(*args, **kwargs)


def _popen(process_obj: Any) -> Any:
    """Start a forkserver child that runs its target through :func:`_in_env`."""
    if process_obj._target is not None:
        process_obj._target = functools.partial(_in_env, dict(os.environ), process_obj._target)
    return Popen(process_obj)


def use_forkserver(module: ModuleType) -> None:
    """Patch ``sglang.srt.entrypoints.engine``: after SGLang sets ``spawn`` (in
    ``_set_envs_and_config``, before it starts any process), set ``forkserver`` instead. A release
    without that function keeps ``spawn``."""
    original = getattr(module, "_set_envs_and_config", None)
    if original is None:
        return

    @functools.wraps(original)
    def set_envs_and_config(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        multiprocessing.set_start_method("forkserver", force=True)
        multiprocessing.set_forkserver_preload(PRELOAD)
        return result

    module._set_envs_and_config = set_envs_and_config
    context.ForkServerProcess._Popen = staticmethod(_popen)

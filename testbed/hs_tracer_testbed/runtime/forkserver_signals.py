"""Imported by the testbed's forkserver before anything else (:data:`.forkserver.PRELOAD`): the
server passes ``SIGQUIT`` on to the launcher that started it.

Why: SGLang's children signal their parent when they fail, and the launcher's handler then stops
the engine's process tree; a forked child's parent is the server, so the server forwards it.
"""

import os
import signal


def _pass_on(signum: int, frame: object) -> None:
    os.kill(os.getppid(), signal.SIGQUIT)


signal.signal(signal.SIGQUIT, _pass_on)

"""Installs the hs_tracer CPU testbed's SGLang patches in every Python process that the testbed
launcher starts (SGLang spawns its scheduler and detokenizer processes, which re-import everything
and would not see patches made in the launcher process).

Only the testbed launcher puts this directory on PYTHONPATH, and it does nothing unless the
launcher's flag ``HS_TRACER_TESTBED_RUNTIME=1`` is set. The patches are post-import hooks, so this
costs nothing for processes that never import SGLang.
"""

import os

if os.environ.get("HS_TRACER_TESTBED_RUNTIME") == "1":
    from hs_tracer_testbed.runtime import patches

    patches.install()

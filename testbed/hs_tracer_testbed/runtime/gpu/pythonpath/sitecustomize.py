"""Installs the hs_tracer GPU testbed's SGLang patches and fallback modules in every Python process
the GPU testbed launcher starts (SGLang spawns scheduler and detokenizer processes, which re-import
everything and would not see changes made in the launcher process).

Only the GPU testbed launcher puts this directory on PYTHONPATH, and it does nothing unless the
launcher's flag ``HS_TRACER_TESTBED_GPU_RUNTIME=1`` is set.
"""

import os

if os.environ.get("HS_TRACER_TESTBED_GPU_RUNTIME") == "1":
    from hs_tracer_testbed.runtime.gpu import patches, standin

    standin.install_fallbacks()
    patches.install()

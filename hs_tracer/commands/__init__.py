"""One module per ``hs-tracer`` sub-command (see :mod:`hs_tracer.cli`)."""

from __future__ import annotations

import importlib.util

# `hs-tracer demo` and `hs-tracer testbed` run on the CPU testbed, which production installs lack.
TESTBED_MISSING = (
    "the CPU testbed is not installed; it ships apart from hs_tracer, as the distribution in the "
    "testbed/ folder of the hs_tracer repository: from a checkout run `pip install ./testbed` "
    "(or `make venv`)"
)


def testbed_installed() -> bool:
    return importlib.util.find_spec("hs_tracer_testbed") is not None

"""Shared pytest setup. Engine tests (``-m engine``) start real SGLang processes on the CPU."""

import os
from pathlib import Path

import pytest

pytest_plugins = ["tests.infra.fixtures"]

# The testbed is its own distribution (testbed/); pytest's `pythonpath` puts this checkout's copy on
# sys.path, and the processes the tests start (the CLI, engine runs) get it through PYTHONPATH.
_TESTBED_ROOT = str(Path(__file__).resolve().parents[1] / "testbed")
_inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != _TESTBED_ROOT]
os.environ["PYTHONPATH"] = os.pathsep.join([_TESTBED_ROOT, *_inherited])


@pytest.fixture(scope="session")
def testbed():
    """The CPU testbed (tiny trained DeepSeek-V3 target, EAGLE-3 draft, training data), built once."""
    from hs_tracer_testbed import ensure_testbed

    return ensure_testbed()


@pytest.fixture(scope="session")
def testbed_profile(testbed) -> Path:
    """The reference profile of the testbed draft's training data (with the all-layer atlas)."""
    from hs_tracer_testbed.demo import testbed_profile as build

    return build(testbed)

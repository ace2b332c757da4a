"""Shared pytest setup. Engine tests (``-m engine``) start real SGLang processes on the CPU."""

from pathlib import Path

import pytest

pytest_plugins = ["tests.infra.fixtures"]


@pytest.fixture(scope="session")
def testbed():
    """The CPU testbed (tiny trained DeepSeek-V3 target, EAGLE-3 draft, training data), built once."""
    from hs_tracer.testbed import ensure_testbed

    return ensure_testbed()


@pytest.fixture(scope="session")
def testbed_profile(testbed) -> Path:
    """The reference profile of the testbed draft's training data (with the all-layer atlas)."""
    from hs_tracer.demo import testbed_profile as build

    return build(testbed)

"""Shared pytest setup. Engine tests (``-m engine``) start real SGLang processes on the CPU, all through
the harness in tests/engine_runs.py (fixture ``engines``)."""

import importlib.util
import os
import tempfile
from pathlib import Path

import pytest

pytest_plugins = ["tests.infra.fixtures"]

# tests/on_vllm needs vLLM, which lives in its own venv (.venv-vllm: it pins another torch than SGLang);
# `make test` runs them there (`make test-vllm`). SGLang's venv has no vLLM to import.
collect_ignore = [] if importlib.util.find_spec("vllm") else ["on_vllm"]

# The testbed is its own distribution (testbed/); pytest's `pythonpath` puts this checkout's copy on
# sys.path, and the processes the tests start (the CLI, engine runs) get it through PYTHONPATH.
_TESTBED_ROOT = str(Path(__file__).resolve().parents[1] / "testbed")
_inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != _TESTBED_ROOT]
os.environ["PYTHONPATH"] = os.pathsep.join([_TESTBED_ROOT, *_inherited])

# Every real engine start of the session, by any program the tests run, appends a line here.
_START_LOG = "TESTBED_ENGINE_START_LOG"
_OWN_LOG = pytest.StashKey[Path]()


def pytest_configure(config: pytest.Config) -> None:
    if _START_LOG not in os.environ:
        fd, path = tempfile.mkstemp(prefix="hs-tracer-engine-starts-", suffix=".log")
        os.close(fd)
        os.environ[_START_LOG] = path
        config.stash[_OWN_LOG] = Path(path)


def pytest_unconfigure(config: pytest.Config) -> None:
    if (own := config.stash.get(_OWN_LOG, None)) is not None:
        own.unlink(missing_ok=True)


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    from tests.engine_runs import count_starts

    counts = count_starts(Path(os.environ[_START_LOG]))
    if counts:
        per_file = ", ".join(f"{name} {n}" for name, n in sorted(counts.items()))
        terminalreporter.write_line(f"real engine starts (SGLang, vLLM): {sum(counts.values())} ({per_file})")


@pytest.fixture(scope="session")
def testbed():
    """The CPU testbed (tiny trained DeepSeek-V3 target, EAGLE-3 draft, training data), built once."""
    from hs_tracer_testbed import ensure_testbed

    return ensure_testbed()


@pytest.fixture(scope="session")
def small():
    """A smaller testbed (hidden size 32): another model than the testbed's."""
    from hs_tracer_testbed import build

    return build.ensure_testbed(recipe=build.Recipe.small(), progress=False)


@pytest.fixture(scope="session")
def small_profile(small, tmp_path_factory) -> Path:
    """The reference profile of the small testbed: a profile of another model for the testbed."""
    from hs_tracer.cli import main

    out = tmp_path_factory.mktemp("small") / "small.profile"
    assert main(["profile", "build", str(small.specforge_data), "-o", str(out), "--draft", str(small.draft),
                 "--target", str(small.target), "--no-progress"]) == 0
    return out


@pytest.fixture(scope="session")
def testbed_profile(testbed) -> Path:
    """The reference profile of the testbed draft's training data (with the all-layer atlas)."""
    from hs_tracer_testbed.demo import testbed_profile as build

    return build(testbed)


@pytest.fixture(scope="session")
def real_pair():
    """The real-model pair: SmolLM2-135M-Instruct and its EAGLE-3 draft trained here, built once."""
    from hs_tracer_testbed import smollm

    return smollm.ensure_pair()


@pytest.fixture(scope="session")
def real_engines(real_pair, tmp_path_factory):
    """Engines of the real-model pair (same harness as ``engines``, its own target, draft and
    profile); each started once, on first use."""
    from hs_tracer_testbed.demo import real_pair_profile
    from tests.engine_runs import Engines

    harness = Engines(real_pair, real_pair_profile(real_pair), tmp_path_factory.mktemp("real-engines"))
    yield harness
    harness.close()


@pytest.fixture(scope="session")
def engines(testbed, testbed_profile, tmp_path_factory):
    """The suite's real engines (tests/engine_runs.py ENGINES), each started once, on first use."""
    from tests.engine_runs import Engines

    harness = Engines(testbed, testbed_profile, tmp_path_factory.mktemp("engines"))
    yield harness
    harness.close()

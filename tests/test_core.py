"""The engine-neutral core as an adapter sees it, with a skeleton adapter over a fake engine module: the
guard never lets an exception or a result reach the engine, the report file is written on a failure,
and the release-table checks name a missing target or a changed signature. No engine is imported."""

from __future__ import annotations

import json
import logging
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from hs_tracer.config import TracerConfig
from hs_tracer.core import state as core
from hs_tracer.core.plugin import called_from, settings
from hs_tracer.release_table import (
    Hook,
    Phase,
    ReleaseFamily,
    family_or_problem,
    handler_name,
    signature_problems,
)

ENGINE = "hs_tracer_fake_engine"


@dataclass
class SkeletonState(core.TracerState):
    """The least an adapter's state adds: its rank and its report."""

    calls: int = 0

    def tp_rank(self) -> int:
        return 0

    def status(self) -> dict[str, Any]:
        return self.with_diagnosis({"pid": 1, "enabled": self.enabled, "hook_errors": self.hook_errors,
                                    "disabled_reason": self.disabled_reason,
                                    "wiring": self.wiring_json()})


@pytest.fixture
def engine(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """A fake engine module with one class whose method a hook reads."""
    module = types.ModuleType(ENGINE)

    class Runner:
        def step(self, batch: Any, result: Any = None) -> Any:
            return result

    module.Runner = Runner  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, ENGINE, module)
    return module


FAMILY = ReleaseFamily("1.0", ("1.0.0",), (
    Hook(f"{ENGINE}.Runner.step", "after", "tests.test_core:after_step", Phase.STEP, ("batch",)),
))


def test_the_guard_runs_the_hook_on_the_state_and_returns_none() -> None:
    slot: core.Slot[SkeletonState] = core.Slot()
    hook = slot.guarded("Runner.step")(lambda st, batch: setattr(st, "calls", st.calls + 1) or "changed")
    assert hook("batch") is None  # nothing installed: nothing runs
    st = slot.install(SkeletonState(TracerConfig()))
    assert hook("batch") is None and st.calls == 1
    assert hook.__hs_tracer_where__ == "Runner.step"


def test_a_hook_error_switches_tracing_off_and_writes_the_report(tmp_path: Path) -> None:
    slot: core.Slot[SkeletonState] = core.Slot()
    st = slot.install(SkeletonState(TracerConfig(report_dir=tmp_path)))

    def broken(_st: SkeletonState) -> None:
        raise ValueError("engine changed")

    hook = slot.guarded("Runner.step")(broken)
    assert hook() is None and hook() is None  # the second call finds tracing off
    assert not st.enabled and st.hook_errors == 1
    assert st.disabled_reason == "Runner.step: ValueError: engine changed"
    (report,) = tmp_path.iterdir()
    assert json.loads(report.read_text())["disabled_reason"] == st.disabled_reason


def test_a_fault_injected_by_name_is_a_hook_error() -> None:
    slot: core.Slot[SkeletonState] = core.Slot()
    st = slot.install(SkeletonState(TracerConfig(fault_inject="Runner.step")))
    slot.guarded("Runner.step")(lambda _st: None)()
    assert not st.enabled and "HS_TRACER_FAULT_INJECT=Runner.step" in (st.disabled_reason or "")


def test_without_a_profile_nothing_is_compared() -> None:
    assert SkeletonState(TracerConfig()).trained_sources() == (None, None)


def test_the_release_table_checks_against_the_fake_engine(engine: types.ModuleType) -> None:
    assert signature_problems(FAMILY.hooks) == []
    engine.Runner.step = lambda self, other: None
    assert signature_problems(FAMILY.hooks) == [f"{ENGINE}.Runner.step no longer takes batch"]
    del engine.Runner.step
    assert signature_problems(FAMILY.hooks) == [f"{ENGINE}.Runner.step is missing (AttributeError)"]
    assert handler_name("tests.test_core:after_step", (None, FAMILY)) == "Runner.step"
    assert family_or_problem("fake", None, FAMILY, "1.0.0") == "fake is not installed"
    assert family_or_problem("fake", "2.0", None, "1.0.0") == "fake 2.0 is not a supported release (1.0.0)"
    assert family_or_problem("fake", "1.0.0", FAMILY, "1.0.0") is FAMILY


def test_the_plugin_entry_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    logger = logging.getLogger("hs_tracer")
    monkeypatch.setattr(logger, "level", logger.level)  # settings() sets the level it reads
    assert called_from({(__name__, "test_the_plugin_entry_checks")})
    assert not called_from({(ENGINE, "main")})
    assert settings({"HS_TRACER": "1"}) is not None
    assert settings({"HS_TRACER": "1", "HS_TRACER_WINDOW_TOKENS": "many"}) is None

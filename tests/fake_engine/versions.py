"""The fake engine's release table: one family, three hooks."""

from __future__ import annotations

from hs_tracer.release_table import Hook, Phase, ReleaseFamily, handler_name
from tests.fake_engine import RELEASE

_RUNNER = "tests.fake_engine.serving.Runner"
_HOOKS = "tests.fake_engine.hooks"

FAMILY = ReleaseFamily(RELEASE, (RELEASE,), (
    Hook(f"{_RUNNER}.load", "after", f"{_HOOKS}:after_load", Phase.STARTUP),
    Hook(f"{_RUNNER}.draft_extend", "before", f"{_HOOKS}:before_draft_extend", Phase.STEP,
         ("features", "batch")),
    Hook(f"{_RUNNER}.verify", "after", f"{_HOOKS}:after_verify", Phase.STEP, ("batch",)),
))


def hook_name(handler: str) -> str:
    return handler_name(handler, (FAMILY,))

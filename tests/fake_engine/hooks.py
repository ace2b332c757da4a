"""The fake engine's hooks: the wiring at load, the draft's input per step, the accept lengths."""

from __future__ import annotations

from typing import Any

from tests.fake_engine import state, versions, wiring
from tests.fake_engine.state import TracerState


def _guarded(fn: Any) -> Any:
    return state.SLOT.guarded(versions.hook_name(f"{fn.__module__}:{fn.__name__}"))(fn)


@_guarded
def after_load(st: TracerState, _result: Any, runner: Any) -> None:
    w = wiring.record("FakeForCausalLM", runner.num_layers, runner.hidden_size, runner.aux_layer_ids,
                      runner.draft_fc_in)
    st.finish_startup(w, wiring.check(w))


@_guarded
def before_draft_extend(st: TracerState, _runner: Any, features: Any, batch: Any) -> None:
    if st.steps is not None:
        st.steps.observe_decode(features, batch)


@_guarded
def after_verify(st: TracerState, accept_lens: Any, runner: Any, batch: Any) -> None:
    if st.steps is not None:  # the engine commits every request it verified: nothing to skip
        st.steps.record(batch, batch.reqs, accept_lens, runner.num_draft_tokens, runner.num_draft_tokens,
                        settled=None)

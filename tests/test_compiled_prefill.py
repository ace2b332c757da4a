"""hs_tracer's hooks are invisible to torch.compile (SGLang's piecewise compiled prefill).

SGLang traces the target model body with Dynamo; the HookRegistry wrapper around
``DeepseekV2Model.forward`` and hs_tracer's AFTER hook run inside that trace. This test wraps a
stand-in model body with SGLang's own ``HookRegistry`` wrapper and the real hook, compiles it with
``fullgraph=True`` (a graph break fails) and counts compilations while the tracer's state changes
between calls: one compilation, and nothing recorded from inside the graph.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from sglang.srt.plugins.hook_registry import HookType, _wrap_fn

from hs_tracer.config import TracerConfig
from hs_tracer.integrations.sglang import hooks, state

MODEL = SimpleNamespace(layers_to_capture=[2, 4, 5], start_layer=0, end_layer=8)
# The capture hook as the plugin registers it on DeepseekV2Model.forward (guarded under that name).
CAPTURE_HOOK = next(fn for target, fn, _ty in hooks.hook_table()
                    if target.endswith(".DeepseekV2Model.forward"))


def body(model: object, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x * 2, torch.cat([x, x, x], dim=-1)


@pytest.fixture
def tracer():
    st = state.install(TracerConfig())
    yield st
    state.install(TracerConfig()).enabled = False


def test_hook_does_not_recompile_or_break_the_graph(tracer) -> None:
    wrapped = _wrap_fn(body, CAPTURE_HOOK, HookType.AFTER)
    compiles = []

    def backend(gm: torch.fx.GraphModule, _inputs: list) -> object:
        compiles.append(gm)
        return gm.forward

    fn = torch.compile(lambda x: wrapped(MODEL, x), backend=backend, fullgraph=True)
    torch._dynamo.reset()
    for i in range(4):
        _out, aux = fn(torch.full((3, 4), float(i)))
        tracer.note_capture([9], 1)  # the tracer's state changes between calls, as in serving
    assert torch.equal(aux, torch.full((3, 12), 3.0))
    assert len(compiles) == 1
    assert tracer.captured_layers == [[9]] * 4  # nothing recorded from inside the graph
    assert tracer.enabled


def test_eager_calls_still_record(tracer) -> None:
    wrapped = _wrap_fn(body, CAPTURE_HOOK, HookType.AFTER)
    wrapped(MODEL, torch.ones(2, 4))
    assert tracer.captured_layers == [[2, 4, 5]]
    assert tracer.capture_widths == [12]


def test_a_body_returning_a_list_of_states_records_their_total_width(tracer) -> None:
    # Llama, Qwen and most other bodies return their aux states as a list, not packed.
    llama_hook = next(fn for target, fn, _ty in hooks.hook_table() if target.endswith(".LlamaModel.forward"))
    wrapped = _wrap_fn(lambda m, x: (x, [x, x[:, :2]]), llama_hook, HookType.AFTER)
    wrapped(SimpleNamespace(layers_to_capture=[7, 3], start_layer=0, end_layer=8), torch.ones(2, 4))
    wrapped(SimpleNamespace(layers_to_capture=[7, 3], start_layer=0, end_layer=8), torch.ones(2, 4))
    assert tracer.captured_layers == [[3, 7]] * 2  # loop order, not list order
    assert tracer.capture_widths == [6, 6]

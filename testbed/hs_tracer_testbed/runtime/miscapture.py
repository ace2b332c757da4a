"""A target capture loop that feeds the draft other layers than its ``layers_to_capture`` says: the
ways an engine's model loop goes wrong while its record stays as configured. Testbed only, for the
tests of in-engine layer identity; applied in every SGLang engine process when
``HS_TRACER_TESTBED_MISCAPTURE`` names a mode (``patches.install``), and to vLLM's Llama body in the
process that serves a vLLM testbed run (``hs_tracer_testbed.vllm_runs``).

Modes, for a body whose ``layers_to_capture`` (vLLM: ``aux_hidden_state_layers``) is ``L`` (layer
``l`` captured = the residual stream entering layer ``l``):

* ``late``: every slot is captured after its layer instead of before it (``l + 1``: one layer late);
* ``late_deep``: the same for every slot but the first;
* ``embedding_first``: the first slot gets the embedding (layer 0), the others stay.

Channel modes (SGLang's Llama body): the loop captures the configured layers, but what it appends is
not the residual stream entering them, while hs_tracer's own tap on each layer's capture channel still
sees the right value (so the fault is in the loop's code, as when a model class appends the wrong
tensor):

* ``residual_left_out``: every slot gets the sublayer output alone (the MLP output of the layer before,
  without the residual the fused add-norm keeps separately);
* ``input_norm``: every slot gets the value after the captured layer's input norm;
* ``swap``: the last two slots are appended in each other's place.

The loop runs with the changed list and the body's list is restored before it returns, so
everything that reads it (the engine's record, hs_tracer's startup and capture metadata) sees the
configured layers.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from types import ModuleType
from typing import Any

ENV = "HS_TRACER_TESTBED_MISCAPTURE"
MODES: dict[str, Callable[[list[int]], list[int]]] = {
    "late": lambda layers: [lay + 1 for lay in layers],
    "late_deep": lambda layers: layers[:1] + [lay + 1 for lay in layers[1:]],
    "embedding_first": lambda layers: [0, *layers[1:]],
}
CHANNEL_MODES = ("residual_left_out", "input_norm", "swap")
BODIES = {"sglang.srt.models.llama": "LlamaModel", "sglang.srt.models.deepseek_v2": "DeepseekV2Model"}
VLLM_BODY = ("vllm.model_executor.models.llama", "LlamaModel", "aux_hidden_state_layers")


def mode() -> str | None:
    """The mode asked for, or None; an unknown mode raises (a test asked for something that is not here)."""
    name = os.environ.get(ENV) or None
    if name is not None and name not in MODES and name not in CHANNEL_MODES:
        raise ValueError(f"{ENV}={name!r}: one of {', '.join([*MODES, *CHANNEL_MODES])}")
    return name


def miscapture(cls: type, shift: Callable[[list[int]], list[int]], attr: str = "layers_to_capture") -> None:
    """Make ``cls.forward`` capture ``shift`` of its layer list (``attr``) while its record stays."""
    forward = cls.forward

    @functools.wraps(forward)
    def patched(self: Any, *args: Any, **kwargs: Any) -> Any:
        configured = getattr(self, attr)
        if not configured:
            return forward(self, *args, **kwargs)
        setattr(self, attr, type(configured)(shift(list(configured))))
        try:
            return forward(self, *args, **kwargs)
        finally:
            setattr(self, attr, configured)

    cls.forward = patched


def patches() -> dict[str, Callable[[ModuleType], None]]:
    """The post-import patches for the mode asked for (none without one)."""
    name = mode()
    if name is None:
        return {}
    if name in CHANNEL_MODES:
        return {"sglang.srt.models.llama": lambda m: mischannel(m, name)}
    return {module: (lambda m, cls=cls: miscapture(getattr(m, cls), MODES[name]))
            for module, cls in BODIES.items()}


def mischannel(module: ModuleType, name: str) -> None:
    """Make the Llama body's loop append ``name``'s value (a channel mode) instead of the captured
    layer's input. The decoder layer notes itself and the residual before its boundary runs; the
    loop's aux list (the callback the layer's capture channel ends in) transforms what it is handed."""
    import torch

    layer_cls, base = module.LlamaDecoderLayer, module.AuxHiddenStateList
    forward = layer_cls.forward
    running: dict[str, Any] = {}

    @functools.wraps(forward)
    def layer_forward(self: Any, positions: Any, hidden_states: Any, forward_batch: Any,
                      capture_output: Any = None) -> Any:
        if capture_output is not None:
            stream = getattr(forward_batch, "residual_stream", None)
            residual = getattr(stream, "residual", None)
            running.update(layer=self, residual=None if residual is None else residual.clone())
        return forward(self, positions, hidden_states, forward_batch, capture_output=capture_output)

    class Appended(base):  # type: ignore[misc, valid-type]
        def capture(self, hidden: Any, *, owned: bool = False) -> None:
            value = hidden.float()
            if name == "residual_left_out" and running.get("residual") is not None:
                value = value - running["residual"].float()
            elif name == "input_norm":
                norm = running["layer"].input_layernorm
                value = value * torch.rsqrt(value.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
                value = value * norm.weight.float()
            super().capture(value.to(hidden.dtype).contiguous(), owned=True)
            if name == "swap" and len(self) == 3:
                self[1], self[2] = self[2], self[1]

    layer_cls.forward = layer_forward
    module.AuxHiddenStateList = Appended


def patch_vllm() -> None:
    """Apply the mode asked for (if any) to vLLM's Llama body in this process."""
    name = mode()
    if name is not None:
        import importlib

        module, cls, attr = VLLM_BODY
        miscapture(getattr(importlib.import_module(module), cls), MODES[name], attr)

"""Same-token layer identity inside vLLM (the engine-neutral sampler: :mod:`hs_tracer.core.identity`).

What is sampled. One in ``HS_TRACER_IDENTITY_EVERY`` eager forwards of the target's model body
(prefill, verify and mixed batches alike: vLLM runs them as one forward), never a forward under
CUDA-graph capture or torch.compile (vLLM's compiled body never calls this Python: with compilation
on, nothing is sampled). Up to ``ROWS`` rows are picked, spread over the forward's token count (the
shape of its ``positions``, known on the host). For those rows:

* ``embedding`` .. ``block:N-2``: each decoder layer's inputs as the residual stream
  (``hidden_states + residual``; the embedding enters the first layer with no residual), the value
  vLLM's own aux capture yields for that layer id;
* ``block:N-1``: the last layer's returned ``(hidden_states, residual)`` summed;
* ``final_norm`` and the slots: what the body returns (its output and its aux hidden-state list).

Cost: an unsampled forward pays one wrapper call on the body and a countdown check; the layers carry
a wrapper only during a sampled forward. Only the emitting rank samples (the layers' inputs need no
channel that other ranks must pass alike); a model split over pipeline stages is not sampled (the
aux states of earlier stages arrive from another process).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any

import torch

from hs_tracer import sources
from hs_tracer.core.identity import LayerIdentity, installed, spread

logger = logging.getLogger("hs_tracer")


def layer_style(forward: Callable[..., Any]) -> str | None:
    """``inputs`` for a decoder layer that takes ``hidden_states`` and ``residual`` (vLLM's loops
    capture their sum before calling it), else None (no identity for this model)."""
    params = inspect.signature(forward).parameters
    return "inputs" if "hidden_states" in params and "residual" in params else None


class IdentitySampler(LayerIdentity):
    """Samples one vLLM target model body (module docstring); a wrapper on the body's ``forward``
    opens the sample and hands the body's result over."""

    def layer_style(self, forward: Callable[..., Any]) -> str | None:
        return layer_style(forward)

    def install(self, keep_first: bool = False) -> bool:
        if not super().install(keep_first):
            return False
        forward = self.body.forward
        compiling = torch.compiler.is_compiling

        def body_forward(*args: Any, **kwargs: Any) -> Any:
            if compiling():  # traced by torch.compile: folds away
                return forward(*args, **kwargs)
            self._begin(kwargs["positions"] if "positions" in kwargs else args[1])
            result = forward(*args, **kwargs)
            if self.active is not None:
                self.finish(result)
            return result

        body_forward.__wrapped__ = forward  # type: ignore[attr-defined]
        self.body.forward = body_forward
        return True

    def _begin(self, positions: Any) -> None:
        """Is this forward sampled? (a countdown check unless it is)"""
        self._close_stale()
        if self._off():
            return
        if self.countdown > 0:
            self.countdown -= 1
            return
        try:
            if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                return
            rows = spread(int(positions.shape[-1]))
            if rows:
                self._open(rows)
        except Exception as exc:
            self._failure(exc)

    def _enter(self, first: bool, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Nothing per layer: the body's wrapper opened the sample."""

    def _tap(self, bound: inspect.BoundArguments, style: str, name: str) -> None:
        self._take_inputs(name, bound.arguments["hidden_states"], bound.arguments["residual"])

    def _last_block(self, out: Any, bound: inspect.BoundArguments) -> None:
        if isinstance(out, tuple) and len(out) == 2:
            hidden, residual = out
            self._take_inputs(str(sources.Source.block_output(self.num_layers - 1)), hidden, residual)
        else:
            self.no_last_block += 1


def install(st: Any, body: Any) -> IdentitySampler | None:
    """The sampler for the target's model body, its layers wrapped (None when off, or for a body
    this module cannot sample: logged once). An error of the sampler's own later switches tracing
    off; serving goes on with the layers as vLLM calls them."""
    every = st.config.identity_every
    layers = st.aux.get("layer_ids") or []
    if every <= 0 or not layers or not hasattr(body, "layers"):
        return None
    whole = int(getattr(body, "start_layer", 0) or 0) == 0 and \
        int(getattr(body, "end_layer", None) or len(body.layers)) == st.target["num_layers"]
    if not whole:
        logger.info("hs_tracer: in-engine layer identity is off: the target is split over pipeline stages")
        return None
    sampler = IdentitySampler(body, every, st.target["num_layers"], st.target["hidden_size"], len(layers),
                              st.target["device"], st.target["dtype"], record=st.emitting,
                              fail=lambda exc: st.fail("layer identity", exc), tracing=lambda: st.enabled)
    return installed(sampler)

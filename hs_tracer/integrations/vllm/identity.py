"""Same-token layer identity inside vLLM (the engine-neutral sampler: :mod:`hs_tracer.core.identity`).

What is sampled. One in ``HS_TRACER_IDENTITY_EVERY`` forwards of the target's model body (prefill,
verify and mixed batches alike: vLLM runs them as one forward), eager or compiled. Up to ``ROWS``
rows are picked, spread over the forward's token count (known on the host). For those rows:

* ``embedding`` .. ``block:N-2``: each decoder layer's inputs as the residual stream
  (``hidden_states + residual``; the embedding enters the first layer with no residual), the value
  vLLM's own aux capture yields for that layer id;
* ``block:N-1``: the last layer's returned ``(hidden_states, residual)`` summed;
* ``final_norm`` and the slots: what the body returns (its output and its aux hidden-state list).

Eager (``enforce_eager``): the layers carry a wrapper only during a sampled forward; an unsampled
forward pays one wrapper call on the body and a countdown check.

Compiled (vLLM's default: its ``support_torch_compile`` body traced by Dynamo once): each decoder
layer's ``input_layernorm`` keeps a wrapper that Dynamo inlines; it hands the residual stream
entering the layer (the sum the norm returns, a value the graph stores anyway: the compiler's
fusions, and so the served tokens, stay as they are) to ``hs_tracer::layer_input`` (:func:`op`), a
``torch.library`` custom op registered as having a side effect, so the compiler keeps the call in
the graph instead of eliminating it. The op's body is
host Python that runs at every execution of the compiled graph: at the first layer it decides
whether this forward is sampled (the countdown), and only then takes its rows (no sum of the full
tensors in the graph). The final norm's sum goes through the op too (``block:N-1``); the final
norm and the slots are read from what the compiled body returns, in a wrapper on the ``forward`` of
the model that calls it (vLLM calls a compiled body through an ahead-of-time compiled function or
its class's swapped code, never through an instance attribute of the body). An unsampled forward
pays one op call per layer (a dispatcher call and a countdown check). Under CUDA graphs the op runs at
capture only, never at replay: a replayed forward is not sampled (:func:`graphs_note`).

Only the emitting rank samples (the layers' inputs need no channel that other ranks must pass
alike); a model split over pipeline stages is not sampled (the aux states of earlier stages arrive
from another process).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.fx

from hs_tracer import sources
from hs_tracer.core.identity import LayerIdentity, input_source, installed, spread

logger = logging.getLogger("hs_tracer")


OP_NAME = "hs_tracer::layer_input"
_SAMPLER: IdentitySampler | None = None  # the op's receiver in this process (one target body)


def _layer_input(hidden_states: torch.Tensor, residual: torch.Tensor | None, layer: int) -> None:
    """``hs_tracer::layer_input``: layer ``layer``'s inputs (``layer == N``: the last layer's
    outputs) handed over by the compiled graph; host Python, run at each execution of the graph."""
    sampler = _SAMPLER
    if sampler is not None:
        sampler.layer_input(hidden_states, residual, layer)


def op() -> Any:
    """The custom op (registered once per process, before the body is compiled)."""
    if not hasattr(torch.ops, "hs_tracer") or not hasattr(torch.ops.hs_tracer, "layer_input"):
        registered = torch.library.custom_op(OP_NAME, mutates_args=())(_layer_input)
        registered.register_fake(lambda hidden_states, residual, layer: None)
        # nothing reads its (empty) result: without this the compiler's dead-code pass drops it
        torch.fx.node.has_side_effect(torch.ops.hs_tracer.layer_input.default)
    return torch.ops.hs_tracer.layer_input.default


def _cache_key(forward: Callable[..., Any]) -> Callable[..., Any]:
    """The body's ``forward`` unchanged, under another name: vLLM keys its compile cache on the name
    of the body's ``forward``, and a graph compiled without the op (tracing off) must never be loaded
    for a traced body, nor the reverse."""

    def traced_body_forward(*args: Any, **kwargs: Any) -> Any:
        return forward(*args, **kwargs)

    traced_body_forward.__wrapped__ = forward  # type: ignore[attr-defined]
    return traced_body_forward


def _tapped_norm(forward: Callable[..., Any], tap: Any, layer: int) -> Callable[..., Any]:
    """A residual norm's ``forward`` (vLLM's ``RMSNorm``: ``(x, residual)`` -> ``(normed, x +
    residual)``; no residual: ``x`` is the stream) that hands the op the stream it sums."""

    def tapped_norm_forward(x: Any, residual: Any = None, *args: Any, **kwargs: Any) -> Any:
        out = forward(x, residual, *args, **kwargs)
        tap(x if residual is None else out[1], None, layer)
        return out

    tapped_norm_forward.__wrapped__ = forward  # type: ignore[attr-defined]
    return tapped_norm_forward


def layer_style(forward: Callable[..., Any]) -> str | None:
    """``inputs`` for a decoder layer that takes ``hidden_states`` and ``residual`` (vLLM's loops
    capture their sum before calling it), else None (no identity for this model)."""
    params = inspect.signature(forward).parameters
    return "inputs" if "hidden_states" in params and "residual" in params else None


def compiled(body: Any) -> bool:
    """vLLM compiles this body (``support_torch_compile`` with compilation on)."""
    return getattr(body, "do_not_compile", True) is False


def graphs_note(compilation_config: Any, device: Any) -> str | None:
    """Why some forwards are not sampled on this runner: vLLM replays CUDA graphs (None: none)."""
    mode = getattr(compilation_config, "cudagraph_mode", None)
    if torch.device(device).type != "cuda" or mode is None or str(getattr(mode, "name", mode)) == "NONE":
        return None
    return (f"cudagraph_mode {getattr(mode, 'name', mode)}: a forward vLLM replays from a CUDA graph is not "
            "sampled (the sampler's host code runs at capture only); forwards vLLM runs without a graph are")


class IdentitySampler(LayerIdentity):
    """Samples one vLLM target model body (module docstring); a wrapper on the body's ``forward``
    (compiled: on the ``outer`` model's) opens the sample (eager) and hands the body's result over."""

    mode = "eager"
    graphs: str | None = None
    outer: Any = None  # the model whose forward calls the body (compiled: its wrapper reads the result)

    def layer_style(self, forward: Callable[..., Any]) -> str | None:
        return layer_style(forward)

    def install(self, keep_first: bool = False) -> bool:
        global _SAMPLER
        if not super().install(keep_first):
            return False
        is_compiling = torch.compiler.is_compiling
        compiled_body = compiled(self.body)
        host = self.outer if compiled_body and self.outer is not None else self.body
        forward = host.forward
        if compiled_body:
            if not self._compiled_taps(op()):
                return False
            self.mode = "compiled"
            self._taps = []  # the eager path's layer wrappers: not used
            _SAMPLER = self

        def body_forward(*args: Any, **kwargs: Any) -> Any:
            if is_compiling():  # traced by torch.compile: folds away
                return forward(*args, **kwargs)
            if not compiled_body:
                self._begin(int((kwargs["positions"] if "positions" in kwargs else args[1]).shape[-1]))
            result = forward(*args, **kwargs)
            if self.active is not None:
                self.finish(result)
            return result

        body_forward.__wrapped__ = forward  # type: ignore[attr-defined]
        host.forward = body_forward
        if host is not self.body:
            self.body.forward = _cache_key(self.body.forward)
        return True

    def _compiled_taps(self, tap: Any) -> bool:
        """Wrappers for the compiled body that Dynamo inlines (no ``inspect`` inside): each decoder
        layer's ``input_layernorm`` hands the op the residual stream entering the layer (the first
        layer's input, else the sum the norm returns), the body's final ``norm`` the sum it returns
        (``block:N-1``). Values the graph stores anyway, so the compiler's fusions stay as they are.
        False for a body without these norms."""
        layers = [self.body.layers[i] for i in range(self.start, self.end)]
        final = getattr(self.body, "norm", None)
        if final is None or not all(hasattr(layer, "input_layernorm") for layer in layers):
            return False
        for i, layer in enumerate(layers, start=self.start):
            layer.input_layernorm.forward = _tapped_norm(layer.input_layernorm.forward, tap, i)
        final.forward = _tapped_norm(final.forward, tap, self.num_layers)
        return True

    def layer_input(self, hidden: torch.Tensor, residual: torch.Tensor | None, layer: int) -> None:
        """The op's host side: the first layer decides whether this forward is sampled."""
        if layer == self.start:
            self._begin(int(hidden.shape[0]))
        if self.active is None:
            return
        name = input_source(layer) if layer < self.num_layers else str(sources.Source.block_output(layer - 1))
        self._take_inputs(name, hidden, residual)

    def _begin(self, tokens: int) -> None:
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
            rows = spread(tokens)
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

    def status(self) -> dict[str, Any]:
        return {**super().status(), "mode": self.mode, "graphs": self.graphs}


def install(st: Any, body: Any, compilation_config: Any = None, outer: Any = None) -> IdentitySampler | None:
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
    sampler.outer = outer if outer is not body else None
    sampler = installed(sampler)
    if sampler is not None:
        sampler.graphs = graphs_note(compilation_config, st.target["device"])
        if sampler.graphs:
            logger.warning("hs_tracer: in-engine layer identity: %s", sampler.graphs)
    return sampler

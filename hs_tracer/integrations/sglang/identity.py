"""Same-token layer identity inside SGLang (the engine-neutral sampler: :mod:`hs_tracer.core.identity`).

What is sampled. One in ``HS_TRACER_IDENTITY_EVERY`` extend forwards (``EXTEND``/``MIXED``; never a
target-verify or decode forward, never a graph's warm-up or capture, never under torch.compile) that
has rows past position 0. Up to ``ROWS`` rows are picked, spread over the batch, none at
position 0 of its sequence (SGLang's loops and the profiles treat that row apart). For those rows:

* ``embedding`` .. ``block:N-2``: the value SGLang's own capture at layer ``i`` yields (the
  residual stream entering layer ``i``: ``hidden_states + residual`` after block ``i-1``, the
  embedding at ``i = 0``), read by passing every decoder layer the capture channel its loop passes a
  captured layer (``capture_output`` callback, or the ``captured_last_layer_outputs`` collector of
  the DeepSeek loop), chained to the loop's own where the loop captures that layer; on loops that
  capture before the call (``hidden_states + residual`` of the layer's inputs) the same sum;
* ``block:N-1``: the last layer's output completed with its residual (SGLang's residual snapshot),
  where that needs no communication;
* ``final_norm`` and the slots: the body's output and the aux hidden states it returns, handed over
  by the after-hook on the body's ``forward``.

Which forwards count. The model runner's ``forward`` decides (a wrapper on the target's runner):
one in ``HS_TRACER_IDENTITY_EVERY`` extend forwards, counted whether the prefill replays a CUDA graph
or runs eagerly; the sampled one runs eagerly (its prefill graph runner is out of sight for that
call), since a replayed graph runs none of the layers' Python. Forwards that SGLang runs to warm up
and capture its graphs never go through ``forward`` and are never sampled: their rows are dummy
data, and under capture the copies would be recorded into the graph instead of run. Without a
runner (a model body driven directly) the first layer decides, on eager forwards outside SGLang's
graph capture.

Cost: an unsampled forward pays one call of the runner's wrapper and a countdown check, plus, when
eager, one call of the first layer's wrapper; the other layers carry a wrapper only during a
sampled forward. A sampled prefill that would have replayed a graph runs eagerly (one in
``HS_TRACER_IDENTITY_EVERY`` prefills; decode and verify steps are never touched).

Ranks. Every tensor rank of a sampled forward passes the capture channels and runs it eagerly (the
sampling decision depends only on the batch, the same on every rank), so the layers' collectives
stay alike across ranks; only the emitting rank records.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any

import torch

from hs_tracer import sources
from hs_tracer.core.identity import ROWS, LayerIdentity, installed, spread
from hs_tracer.integrations.sglang import versions
from hs_tracer.integrations.sglang.releases import FAMILIES

logger = logging.getLogger("hs_tracer")

def sample_rows(prefix_lens: list[int], extend_lens: list[int], rows: int = ROWS) -> list[int]:
    """Up to ``rows`` row indices of an extend batch, spread evenly over its rows that are not at
    position 0 of their sequence (a request without a cached prefix starts there)."""
    segments = []
    row = 0
    for prefix, n in zip(prefix_lens, extend_lens, strict=True):
        start = row + (1 if prefix == 0 else 0)
        row += n
        if start < row:
            segments.append((start, row))
    out, seg, offset = [], 0, 0
    for p in spread(sum(e - s for s, e in segments), rows):
        while p >= offset + segments[seg][1] - segments[seg][0]:
            offset += segments[seg][1] - segments[seg][0]
            seg += 1
        out.append(segments[seg][0] + p - offset)
    return out


class _Tap(list):
    """A stand-in for the DeepSeek loop's aux collector (``captured_last_layer_outputs``): what the
    layer captures goes to the sampler, then to the loop's own collector where the loop passed one."""

    def __init__(self, inner: Any, take: Callable[[Any], None]) -> None:
        super().__init__()
        self._inner, self._take = inner, take

    def capture(self, value: Any, *more: Any, **options: Any) -> None:
        self._take(value)
        if self._inner is not None:  # the loop's own, called exactly as the layer called this
            self._inner.capture(value, *more, **options)

    def append(self, value: Any) -> None:
        self._take(value)
        if self._inner is not None:
            self._inner.append(value)

    def __getattr__(self, name: str) -> Any:
        if self._inner is None:
            raise AttributeError(name)
        return getattr(self._inner, name)


def layer_style(forward: Callable[..., Any]) -> str | None:
    """How a decoder layer is given a capture: ``callback`` (``capture_output``), ``collector``
    (``captured_last_layer_outputs``), ``inputs`` (loops that capture ``hidden_states + residual``
    of a layer's inputs before calling it), or None (unknown: no identity for this model)."""
    params = inspect.signature(forward).parameters
    if "forward_batch" not in params:
        return None
    if "capture_output" in params:
        return "callback"
    if "captured_last_layer_outputs" in params:
        return "collector"
    if "residual" in params and "hidden_states" in params:
        return "inputs"
    return None


PREFILL_GRAPH_RUNNERS = ("prefill_cuda_graph_runner", "piecewise_cuda_graph_runner")
"""The model runner's attributes that hold a prefill graph runner (the newest release's breakable
CUDA graphs; the torch.compile piecewise graphs of earlier releases): set aside for a sampled
forward."""


def _graph_capture_check() -> Callable[[], bool]:
    """SGLang's own "a graph is being warmed up or captured" flag (False where it has none)."""
    try:
        from sglang.srt.model_executor.runner_utils.capture_mode import get_is_capture_mode
    except ImportError:  # releases before the graph runners were split
        try:
            from sglang.srt.model_executor.cuda_graph_runner import get_is_capture_mode
        except ImportError:
            return lambda: False
    return get_is_capture_mode


class IdentitySampler(LayerIdentity):
    """Samples one SGLang target model body (module docstring); the target's model runner decides
    per forward where it is wrapped (:meth:`install_runner`), else the body's first layer."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._fb_at = 0  # where the first layer takes its forward batch positionally
        self.runner: Any = None  # the target's model runner, once its forward decides
        self._pending: list[int] | None = None  # rows the runner chose for the forward running now
        self._capturing: Callable[[], bool] = lambda: False
        self.eager = 0  # sampled prefills run eagerly instead of replaying a graph

    def install(self, keep_first: bool = True) -> bool:
        first = self.body.layers[self.start].forward
        if "forward_batch" in inspect.signature(first).parameters:
            self._fb_at = list(inspect.signature(first).parameters).index("forward_batch")
        self._capturing = _graph_capture_check()
        return super().install(keep_first)

    def install_runner(self, runner: Any) -> None:
        """Let the target's model runner decide which forwards are sampled (module docstring)."""
        forward = runner.forward
        params = list(inspect.signature(forward).parameters)
        at = params.index("forward_batch") if "forward_batch" in params else 0

        def runner_forward(*args: Any, **kwargs: Any) -> Any:
            set_aside = self._decide(runner, kwargs["forward_batch"] if "forward_batch" in kwargs
                                     else args[at] if len(args) > at else None)
            try:
                return forward(*args, **kwargs)
            finally:
                self._pending = None
                for name, graphs in set_aside:
                    setattr(runner, name, graphs)

        runner_forward.__wrapped__ = forward  # type: ignore[attr-defined]
        runner.forward = runner_forward
        self.runner = runner

    def _due(self, fb: Any) -> list[int] | None:
        """The rows to sample of this forward batch, or None (a countdown check unless it is due)."""
        if fb.forward_mode.name not in ("EXTEND", "MIXED") or fb.extend_seq_lens_cpu is None:
            return None
        if self.countdown > 0:
            self.countdown -= 1
            return None
        rows = sample_rows(list(fb.extend_prefix_lens_cpu or [0] * len(fb.extend_seq_lens_cpu)),
                           list(fb.extend_seq_lens_cpu))
        return rows or None  # nothing past position 0: the next extend forward is looked at

    def _decide(self, runner: Any, fb: Any) -> list[tuple[str, Any]]:
        """Before the runner's forward: is it sampled? If so its prefill graph runners are set
        aside (returned, to be put back), so the forward runs eagerly through the layers."""
        self._pending = None
        if self._off() or fb is None:
            return []
        try:
            rows = self._due(fb)
            if rows is None:
                return []
            set_aside = [(name, getattr(runner, name)) for name in PREFILL_GRAPH_RUNNERS
                         if getattr(runner, name, None) is not None]
            for name, _graphs in set_aside:
                setattr(runner, name, None)
            self.eager += bool(set_aside)
            self._pending = rows
            return set_aside
        except Exception as exc:
            self._failure(exc)
            return []

    def layer_style(self, forward: Callable[..., Any]) -> str | None:
        return layer_style(forward)

    def _enter(self, first: bool, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if first:
            self._begin(args, kwargs)

    def _begin(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """The first layer of a forward (its arguments): open the sample the runner chose, or
        without a runner decide here (a countdown check unless it is sampled)."""
        self._close_stale()
        if self._off():
            return
        if self.runner is not None:
            rows, self._pending = self._pending, None
            if rows:
                self._open(rows)
            return
        try:
            if self._capturing() or (self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
                return
            rows = self._due(kwargs["forward_batch"] if "forward_batch" in kwargs else args[self._fb_at])
            if rows:
                self._open(rows)
        except Exception as exc:
            self._failure(exc)

    def status(self) -> dict[str, Any]:
        return {**super().status(), "eager_prefills": self.eager}

    def _tap(self, bound: inspect.BoundArguments, style: str, name: str) -> None:
        args = bound.arguments
        if style == "callback":
            inner = args.get("capture_output")

            def capture(value: Any, *more: Any, **options: Any) -> None:
                self._take(name, value)
                if inner is not None:  # the loop's own, called exactly as the layer called this
                    inner(value, *more, **options)

            args["capture_output"] = capture
        elif style == "collector":
            args["captured_last_layer_outputs"] = _Tap(args.get("captured_last_layer_outputs"),
                                                       lambda v: self._take(name, v))
        else:
            self._take_inputs(name, args["hidden_states"], args.get("residual"))

    def _last_block(self, out: Any, bound: inspect.BoundArguments) -> None:
        name = str(sources.Source.block_output(self.num_layers - 1))
        fb = bound.arguments["forward_batch"]
        try:
            hidden = out[0] if isinstance(out, tuple) else out
            if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], torch.Tensor) \
                    and getattr(fb, "residual_stream", None) is None:
                self._take(name, out[0] + out[1])  # loops that return (hidden_states, residual)
                return
            stream = getattr(fb, "residual_stream", None)
            pending = getattr(stream, "pending", None)
            if stream is None or (pending is not None and (pending.owed is not None
                                                           or not pending.update.is_plain_add)):
                return
            from sglang.srt.layers.layer_boundary.residual import batch as residual_batch

            value = residual_batch.snapshot(hidden, fb)
        except (ImportError, NotImplementedError, RuntimeError, AttributeError, TypeError):
            self.no_last_block += 1  # a boundary that cannot complete it here: one candidate fewer
            return
        self._take(name, value)


def _log_failure(exc: BaseException) -> None:
    """An error of the sampler's own: identity stops (``failed`` in the status), the rest of the
    tracer goes on; the layers run as SGLang calls them."""
    logger.error("hs_tracer: in-engine layer identity failed and is off; tracing goes on", exc_info=exc)


def _body_hooked(body: Any) -> bool:
    """Whether the installed release's hook table has an after-hook on the body's ``forward`` (the
    hook that hands the sampler the final norm's and the slots' rows)."""
    owner = next((c for c in type(body).__mro__ if "forward" in vars(c)), type(body))
    target = f"{owner.__module__}.{owner.__qualname__}.forward"
    family = versions.installed_family() or FAMILIES[0]
    return any(h.target == target and h.type == "after" for h in family.hooks)


def _attention_dp() -> bool | None:
    """Whether attention data parallelism is on (None: this SGLang does not say)."""
    try:
        from sglang.srt.runtime_context import get_parallel
    except ImportError:  # releases before SGLang's runtime context
        try:
            from sglang.srt.layers.dp_attention import get_attention_dp_size

            return int(get_attention_dp_size()) > 1
        except (ImportError, AssertionError, AttributeError, RuntimeError):
            return None
    try:
        size = getattr(get_parallel(), "attn_dp_size", None)
    except ValueError:  # not published in this process: a single rank
        return False
    return None if size is None else int(size) > 1


def install(st: Any, body: Any, runner: Any = None) -> IdentitySampler | None:
    """The sampler for the target's model body, its layers wrapped (None when off, or for a loop
    whose layers take no known capture: logged once)."""
    every = st.config.identity_every
    layers = st.target.get("layers_to_capture") or []
    if every <= 0 or not layers or not st.aux.get("use_aux_hidden_state") or not hasattr(body, "layers"):
        return None
    if not _body_hooked(body):
        logger.info("hs_tracer: %s's forward carries no hs_tracer hook on this SGLang; in-engine layer "
                    "identity is off", type(body).__name__)
        return None
    if _attention_dp() is not False:
        logger.info("hs_tracer: in-engine layer identity is off with attention data parallelism (or where "
                    "this SGLang does not say): its ranks run different batches, and a sampled forward "
                    "must pass the same capture channels on every rank")
        return None
    sampler = IdentitySampler(body, every, st.target["num_layers"], st.target["hidden_size"], len(layers),
                              st.target_device, st.target_dtype, record=st.emitting, fail=_log_failure,
                              tracing=lambda: st.enabled)
    if installed(sampler) is None:
        return None
    if runner is not None:
        sampler.install_runner(runner)
    return sampler

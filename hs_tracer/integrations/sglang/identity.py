"""Same-token layer identity inside the engine: on sampled prefill forwards of the target, a few rows
of every candidate source and of the draft-input slots, taken from the same forward.

Why: the verdict otherwise trusts the engine's account of what each slot carries (its
``layers_to_capture`` read through hs_tracer's layer-id rules). That account is wrong exactly when
the failure hs_tracer exists for happens inside the engine: a model loop that captures after a layer
instead of before it, a rule the engine applies differently than assumed, a new architecture. Rows of
the same tokens settle it: the slot's rows *equal* one candidate's (the same tensor's values), and
differ from every other by what a whole layer adds.

What is sampled. One in ``HS_TRACER_IDENTITY_EVERY`` eager extend forwards (``EXTEND``/``MIXED``;
never a target-verify or decode forward, never a forward under CUDA-graph capture or torch.compile)
that has rows past position 0. Up to :data:`ROWS` rows are picked, spread over the batch, none at
position 0 of its sequence (SGLang's loops and the profiles treat that row apart). For those rows:

* ``embedding`` .. ``block:N-2``: the value SGLang's own capture at layer ``i`` yields (the
  residual stream entering layer ``i``: ``hidden_states + residual`` after block ``i-1``, the
  embedding at ``i = 0``), read by passing every decoder layer the capture channel its loop passes a
  captured layer (``capture_output`` callback, or the ``captured_last_layer_outputs`` collector of
  the DeepSeek loop), chained to the loop's own where the loop captures that layer; on loops that
  capture before the call (``hidden_states + residual`` of the layer's inputs) the same sum;
* ``block:N-1``: the last layer's output completed with its residual (SGLang's residual snapshot),
  where that needs no communication;
* ``final_norm``: the model body's output;
* the slots: the aux hidden states the body returns (the packed tensor or the list the logits
  processor concatenates for the draft).

The rows are projected on the device to :data:`DIMS` dimensions by one fixed random matrix, in
float32 (equal rows stay equal; a relative difference is kept to within a few percent) and copied
to pinned host memory asynchronously, with an event; the recorder thread takes landed samples
(:meth:`IdentitySampler.landed`) and the analysis (export process or recorder thread) compares them
(:func:`hs_tracer.diagnosis.same_token.identify`).

Cost: an unsampled forward pays one call of the first layer's wrapper and a countdown check (eager
forwards only: under CUDA graphs this Python does not run); the other layers carry a wrapper only
during a sampled forward. Every
tensor rank of a sampled forward passes the capture channels (the sampling decision depends only on
the batch, the same on every rank), so the layers' collectives stay alike across ranks; only the
emitting rank records.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hs_tracer import sources

logger = logging.getLogger("hs_tracer")

ROWS = 8
"""Rows sampled per forward."""
DIMS = 64
"""Width the rows are projected to (rows narrower than this are copied as they are)."""
SLOTS = 2
"""Samples in flight at once (device buffers, pinned host buffers): bounded memory."""
SEED = 20261204
"""Seed of the fixed projection (the same in every process: samples of different forwards pool)."""


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
    total = sum(e - s for s, e in segments)
    if total == 0:
        return []
    n = min(rows, total)
    picks = sorted({(2 * j + 1) * total // (2 * n) for j in range(n)})
    out, seg, offset = [], 0, 0
    for p in picks:
        while p >= offset + segments[seg][1] - segments[seg][0]:
            offset += segments[seg][1] - segments[seg][0]
            seg += 1
        out.append(segments[seg][0] + p - offset)
    return out


@dataclass
class Sample:
    """One sampled forward's rows, as landed on the host: ``candidates`` [S, R, D] in the order of
    ``sources``, ``slots`` [R, K, D]."""

    sources: list[str]
    candidates: np.ndarray
    slots: np.ndarray


class _Slot:
    """Buffers of one sample in flight."""

    def __init__(self, capacity: int, hidden: int, dims: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        cuda = device.type == "cuda"
        self.rows = torch.zeros(capacity, ROWS, hidden, dtype=dtype, device=device)
        self.host = torch.zeros(capacity * ROWS, dims, dtype=torch.float32, pin_memory=cuda)
        self.idx_host = torch.zeros(ROWS, dtype=torch.int64, pin_memory=cuda)
        self.idx = torch.zeros(ROWS, dtype=torch.int64, device=device)
        self.event = torch.cuda.Event() if cuda else None
        self.names: list[str] = []
        self.slot_count = 0
        self.count = 0  # rows sampled
        self.state = "free"  # free -> filling -> in flight -> free


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
    if "capture_output" in params:
        return "callback"
    if "captured_last_layer_outputs" in params:
        return "collector"
    if "residual" in params and "hidden_states" in params:
        return "inputs"
    return None


class IdentitySampler:
    """Samples one target model body (module docstring). Built at startup, before SGLang captures
    the target's CUDA graphs; its layer wrappers are instance attributes of the layers."""

    def __init__(self, body: Any, every: int, num_layers: int, hidden: int, num_slots: int,
                 device: Any, dtype: Any, record: bool, fail: Callable[[BaseException], None]) -> None:
        self.body = body
        self.every = every
        self.num_layers = num_layers
        self.hidden = hidden
        self.num_slots = num_slots
        self.device = torch.device(device)
        self.dtype = dtype if isinstance(dtype, torch.dtype) else torch.bfloat16
        self.record = record  # this rank records (attention-TP rank 0); every rank passes the taps
        self._fail = fail
        self.dims = DIMS if hidden > DIMS else hidden
        self.countdown = 0  # the first eligible forward is sampled
        self.active: _Slot | None = None  # the slot being filled by the forward running now
        self.sampled = 0  # forwards sampled (taps passed)
        self.recorded = 0  # samples recorded on this rank
        self.missed = 0  # sampled forwards not recorded (both slots in flight)
        self.failed: str | None = None
        self.no_last_block = 0  # sampled forwards whose last block's output could not be completed
        self._rows: list[int] = []
        self._slots: list[_Slot] = []
        self._capacity = num_layers + 2 + num_slots
        self._proj: torch.Tensor | None = None
        self._taps: list[tuple[Any, Any, Callable[..., Any]]] = []  # (layer, own forward attribute, wrapper)
        self._armed = False
        self.start = int(getattr(body, "start_layer", 0) or 0)
        self.end = int(getattr(body, "end_layer", None) or len(body.layers))

    # ---- startup -------------------------------------------------------------------------------
    def install(self) -> bool:
        """Wrap the body's first decoder layer (it decides, per forward, whether to sample) and
        prepare the others' wrappers, which are set only for a sampled forward (:meth:`_arm`). False
        (and nothing wrapped) for a loop whose layers take no capture this module knows."""
        layers = self.body.layers
        styles = [layer_style(layers[i].forward) for i in range(self.start, self.end)]
        if not styles or any(s is None for s in styles):
            return False
        for i, style in zip(range(self.start, self.end), styles, strict=True):
            layer = layers[i]
            wrapper = self._wrap(i, layer.forward, style)
            if i == self.start:
                layer.forward = wrapper
            else:
                self._taps.append((layer, layer.__dict__.get("forward"), wrapper))
        if self.record:
            self._slots = [_Slot(self._capacity, self.hidden, self.dims, self.dtype, self.device)
                           for _ in range(SLOTS)]
            gen = torch.Generator().manual_seed(SEED)
            if self.dims < self.hidden:
                proj = torch.randn(self.hidden, self.dims, generator=gen) / self.dims ** 0.5
                self._proj = proj.to(device=self.device)  # float32: fast on every device, and exact enough
        return True

    def _arm(self) -> None:
        """Set the other layers' wrappers for the forward being sampled."""
        for layer, _prior, wrapper in self._taps:
            layer.forward = wrapper
        self._armed = True

    def _disarm(self) -> None:
        """Give the other layers back their own ``forward`` (unsampled forwards never see a wrapper)."""
        self._armed = False
        for layer, prior, _wrapper in self._taps:
            if prior is None:
                layer.__dict__.pop("forward", None)
            else:
                layer.forward = prior

    def _wrap(self, i: int, forward: Callable[..., Any], style: str) -> Callable[..., Any]:
        sig = inspect.signature(forward)
        name = sources.id_to_source(i, "sglang_capture", self.num_layers).__str__()
        first, last = i == self.start, i == self.end - 1 and self.end == self.num_layers
        fb_at = list(sig.parameters).index("forward_batch")
        compiling = torch.compiler.is_compiling

        def layer_forward(*args: Any, **kwargs: Any) -> Any:
            if compiling():  # traced by torch.compile: folds away
                return forward(*args, **kwargs)
            if first:
                self._begin(kwargs["forward_batch"] if "forward_batch" in kwargs else args[fb_at])
            if self.active is None:
                return forward(*args, **kwargs)
            try:
                bound = sig.bind(*args, **kwargs)
                self._tap(bound, style, name)
            except Exception as exc:  # hs_tracer's own: the layer runs as SGLang called it
                self._failure(exc)
                return forward(*args, **kwargs)
            out = forward(*bound.args, **bound.kwargs)
            if last and self.active is not None and self.active is not _NOT_RECORDED:
                self._last_block(out, bound.arguments["forward_batch"])
            return out

        layer_forward.__wrapped__ = forward  # type: ignore[attr-defined]
        return layer_forward

    # ---- per forward ---------------------------------------------------------------------------
    def _begin(self, fb: Any) -> None:
        """The first layer of a forward: is it sampled? (a countdown check unless it is)"""
        self.active = None
        if self._armed:  # a sampled forward that never reached the body's end
            self._disarm()
        if self.every <= 0 or self.failed is not None:
            return
        try:
            mode = fb.forward_mode
            if self.countdown > 0:
                if mode.name in ("EXTEND", "MIXED"):
                    self.countdown -= 1
                return
            if mode.name not in ("EXTEND", "MIXED") or fb.extend_seq_lens_cpu is None:
                return
            if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                return
            rows = sample_rows(list(fb.extend_prefix_lens_cpu or [0] * len(fb.extend_seq_lens_cpu)),
                               list(fb.extend_seq_lens_cpu))
            if not rows:
                return  # nothing past position 0: the next extend forward is looked at
            self.countdown = self.every - 1
            self.sampled += 1
            self._rows = rows
            for stale in self._slots:  # filled by a forward that never reached the body's end
                if stale.state == "filling":
                    stale.state = "free"
            slot = next((s for s in self._slots if s.state == "free"), None) if self.record else None
            self._arm()
            if slot is None:
                if self.record:
                    self.missed += 1
                self.active = _NOT_RECORDED
                return
            n = len(rows)
            slot.idx_host[:n] = torch.tensor(rows, dtype=torch.int64)
            slot.idx[:n].copy_(slot.idx_host[:n], non_blocking=True)
            slot.names, slot.count, slot.slot_count, slot.state = [], n, 0, "filling"
            self.active = slot
        except Exception as exc:
            self._failure(exc)

    def _take(self, name: str, value: Any) -> None:
        """Rows of one candidate into the active slot (stream-ordered: before any later write)."""
        slot = self.active
        if slot is None or slot is _NOT_RECORDED:
            return
        try:
            k = len(slot.names)
            if k >= self._capacity - self.num_slots or value.shape[-1] != self.hidden:
                return
            dest = slot.rows[k, :slot.count]
            if value.dtype == dest.dtype:
                torch.index_select(value, 0, slot.idx[:slot.count], out=dest)
            else:  # a residual kept in another precision: cast as the slot's copy of it would be
                dest.copy_(value.index_select(0, slot.idx[:slot.count]))
            slot.names.append(name)
        except Exception as exc:
            self._failure(exc)

    def _tap(self, bound: inspect.BoundArguments, style: str, name: str) -> None:
        """Give the layer a capture channel (chained to the loop's own), or read its inputs."""
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
        elif self.active is not _NOT_RECORDED:
            hidden, residual = args["hidden_states"], args.get("residual")
            self._take(name, hidden if residual is None else hidden + residual)

    def _last_block(self, out: Any, fb: Any) -> None:
        """``block:N-1``: the last layer's output completed with its residual, where no
        communication is needed for it."""
        name = str(sources.Source.block_output(self.num_layers - 1))
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

    def finish(self, result: Any) -> None:
        """The body returned: the final norm's rows and the slots' rows, then project and copy the
        sample to the host (async), with an event."""
        slot = self.active
        if self._armed:
            self._disarm()
        if slot is None or slot is _NOT_RECORDED or not isinstance(result, tuple):
            self.active = None
            return
        try:
            self._take("final_norm", result[0])
            self.active = None
            aux = result[-1]
            parts = [aux] if isinstance(aux, torch.Tensor) else list(aux)
            n, k = slot.count, len(slot.names)
            idx = slot.idx[:n]
            views = []
            for part in parts:
                rows = part.index_select(0, idx)
                views += list(rows.view(n, -1, self.hidden).unbind(1))
            if len(views) != self.num_slots or k + len(views) > self._capacity:
                slot.state = "free"
                return
            for j, v in enumerate(views):
                slot.rows[k + j, :n].copy_(v)
            used = slot.rows[:k + len(views), :n].reshape(-1, self.hidden)
            out = used.float() @ self._proj if self._proj is not None else used.float()
            slot.host[:out.shape[0]].copy_(out, non_blocking=True)
            if slot.event is not None:
                slot.event.record()
            slot.slot_count = len(views)
            slot.state = "in flight"
            self.recorded += 1
        except Exception as exc:
            slot.state = "free"
            self._failure(exc)

    # ---- recorder thread -----------------------------------------------------------------------
    def landed(self) -> list[Sample]:
        """Samples whose host copy completed (event queried, never waited on); their slots are
        freed."""
        out = []
        for slot in self._slots:
            if slot.state != "in flight" or (slot.event is not None and not slot.event.query()):
                continue
            n, k, s = slot.count, slot.slot_count, len(slot.names)
            rows = slot.host[:(s + k) * n].float().numpy().reshape(s + k, n, self.dims).copy()
            out.append(Sample(list(slot.names), rows[:s], rows[s:].transpose(1, 0, 2).copy()))
            slot.state = "free"
        return out

    def _failure(self, exc: BaseException) -> None:
        """hs_tracer's own error: identity sampling stops for this process (``failed``), once told."""
        self.active = None
        if self._armed:
            self._disarm()
        if self.failed is None:
            self.failed = f"{type(exc).__name__}: {exc}"
            self._fail(exc)

    def status(self) -> dict[str, Any]:
        return {"every": self.every, "sampled": self.sampled, "recorded": self.recorded,
                "missed": self.missed, "rows": ROWS, "dims": self.dims, "failed": self.failed,
                "no_last_block": self.no_last_block}


def _log_failure(exc: BaseException) -> None:
    """An error of the sampler's own: identity stops (``failed`` in the status), the rest of the
    tracer goes on; the layers run as SGLang calls them."""
    logger.error("hs_tracer: in-engine layer identity failed and is off; tracing goes on", exc_info=exc)


def _body_hooked(body: Any) -> bool:
    """Whether the installed release's hook table has an after-hook on the body's ``forward`` (the
    hook that hands the sampler the final norm's and the slots' rows)."""
    from hs_tracer.integrations.sglang import versions
    from hs_tracer.sglang_releases import FAMILIES

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


_NOT_RECORDED: Any = object()  # a sampled forward this rank passes taps for but does not record


def install(st: Any, body: Any) -> IdentitySampler | None:
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
                              st.target_device, st.target_dtype, record=st.emitting, fail=_log_failure)
    if not sampler.install():
        logger.info("hs_tracer: %s's decoder layers take no capture hs_tracer knows; in-engine layer "
                    "identity is off", type(body).__name__)
        return None
    return sampler

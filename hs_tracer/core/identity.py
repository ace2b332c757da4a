"""Same-token layer identity inside an engine, the engine-neutral part: on sampled target forwards,
a few rows of every candidate source and of the draft-input slots, taken from the same forward.

Why: the verdict otherwise trusts the engine's account of what each slot carries (the layer ids it
records, read through hs_tracer's layer-id rules). That account is wrong exactly when the failure
hs_tracer exists for happens inside the engine: a model loop that captures after a layer instead of
before it, a rule the engine applies differently than assumed, a new architecture. Rows of the same
tokens settle it: the slot's rows *equal* one candidate's (the same tensor's values), and differ
from every other by what a whole layer adds.

An engine adapter subclasses :class:`LayerIdentity`: it decides which forwards and rows are sampled
(:meth:`LayerIdentity._open`), gives each decoder layer the capture channel its loop uses
(:meth:`LayerIdentity._tap`) and completes the last layer's output (:meth:`LayerIdentity._last_block`).
What is the same for every engine lives here: the layer wrappers, the buffers, the projection and
the asynchronous copy to the host.

Candidates, for a sampled row: ``embedding`` .. ``block:N-2`` (the residual stream entering layer
``i``: the embedding at ``i = 0``), ``block:N-1`` (the last layer's output completed with its
residual), ``final_norm`` (the model body's output); the slots: the aux hidden states the body
returns (one packed tensor or a list of them).

The rows are projected on the device to :data:`DIMS` dimensions by one fixed random matrix, in
float32 (equal rows stay equal; a relative difference is kept to within a few percent) and copied
to host memory (pinned on CUDA) asynchronously, with an event; the recorder thread takes landed
samples (:meth:`LayerIdentity.landed`) and the analysis compares them
(:func:`hs_tracer.diagnosis.same_token.identify`). Nothing on the per-step path waits for the device.
"""

from __future__ import annotations

import abc
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch

from hs_tracer import sources

logger = logging.getLogger("hs_tracer")

ROWS = 8
"""Rows sampled per forward."""
DIMS = 64
"""Width the rows are projected to (rows narrower than this are copied as they are)."""
SLOTS = 2
"""Samples in flight at once (device buffers, host buffers): bounded memory."""
SEED = 20261204
"""Seed of the fixed projection (the same in every process: samples of different forwards pool)."""


def spread(total: int, rows: int = ROWS) -> list[int]:
    """Up to ``rows`` of ``range(total)``, spread evenly (the middle of equal parts)."""
    n = min(rows, total)
    return sorted({(2 * j + 1) * total // (2 * n) for j in range(n)}) if n > 0 else []


def input_source(layer: int) -> str:
    """The candidate a layer's input carries: the residual stream entering it."""
    return str(sources.Source.embedding() if layer == 0 else sources.Source.block_output(layer - 1))


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


NOT_RECORDED: Any = object()
"""The active sample of a forward this rank passes taps for but does not record."""


class LayerIdentity(abc.ABC):
    """Samples one target model body (module docstring). Built at startup, before the engine
    captures the target's CUDA graphs; its layer wrappers are instance attributes of the layers, set
    only for a sampled forward (:meth:`_arm`) unless the adapter keeps one set (:meth:`install`)."""

    def __init__(self, body: Any, every: int, num_layers: int, hidden: int, num_slots: int,
                 device: Any, dtype: Any, record: bool, fail: Callable[[BaseException], None],
                 tracing: Callable[[], bool]) -> None:
        self.body = body
        self.every = every
        self.num_layers = num_layers
        self.hidden = hidden
        self.num_slots = num_slots
        self.device = torch.device(device)
        self.dtype = dtype if isinstance(dtype, torch.dtype) else torch.bfloat16
        self.record = record  # this rank records (tensor rank 0); every rank passes the taps
        self._fail = fail
        # The tracer state's enabled flag: the sampler's wrappers run outside the hooks' guard, so
        # once a hook's failure switched tracing off, only this stops them sampling.
        self._tracing = tracing
        self.dims = DIMS if hidden > DIMS else hidden
        self.countdown = 0  # the first eligible forward is sampled
        self.active: _Slot | None = None  # the slot being filled by the forward running now
        self.sampled = 0  # forwards sampled (taps passed)
        self.recorded = 0  # samples recorded on this rank
        self.missed = 0  # sampled forwards not recorded (both slots in flight)
        self.failed: str | None = None
        self.no_last_block = 0  # sampled forwards whose last block's output could not be completed
        self._slots: list[_Slot] = []
        self._capacity = num_layers + 2 + num_slots
        self._proj: torch.Tensor | None = None
        self._taps: list[tuple[Any, Any, Callable[..., Any]]] = []  # (layer, own forward attribute, wrapper)
        self._armed = False
        self.start = int(getattr(body, "start_layer", 0) or 0)
        self.end = int(getattr(body, "end_layer", None) or len(body.layers))

    # ---- what an engine adapter supplies --------------------------------------------------------
    @abc.abstractmethod
    def layer_style(self, forward: Callable[..., Any]) -> str | None:
        """How a decoder layer of this engine is given a capture channel (None: not known)."""

    @abc.abstractmethod
    def _tap(self, bound: inspect.BoundArguments, style: str, name: str) -> None:
        """Give the layer its capture channel (chained to the loop's own), or read its inputs."""

    @abc.abstractmethod
    def _last_block(self, out: Any, bound: inspect.BoundArguments) -> None:
        """``block:N-1`` from the last layer's output, where no communication is needed for it."""

    @abc.abstractmethod
    def _enter(self, first: bool, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Called by every layer wrapper before its layer runs (an adapter deciding per forward in
        its first layer opens the sample here)."""

    # ---- startup -------------------------------------------------------------------------------
    def install(self, keep_first: bool = False) -> bool:
        """Prepare the buffers and a wrapper per decoder layer, set only for a sampled forward; with
        ``keep_first`` the first layer keeps its wrapper (it decides per forward). False (nothing
        wrapped) for a loop whose layers take no capture this engine's adapter knows."""
        layers = self.body.layers
        styles = [self.layer_style(layers[i].forward) for i in range(self.start, self.end)]
        if not styles or any(s is None for s in styles):
            return False
        if self.record:  # buffers first: nothing is wrapped unless they exist
            self._slots = [_Slot(self._capacity, self.hidden, self.dims, self.dtype, self.device)
                           for _ in range(SLOTS)]
            gen = torch.Generator().manual_seed(SEED)
            if self.dims < self.hidden:
                proj = torch.randn(self.hidden, self.dims, generator=gen) / self.dims ** 0.5
                self._proj = proj.to(device=self.device)  # float32: fast on every device, and exact enough
        wrappers = [self._wrap(i, layers[i].forward, style)
                    for i, style in zip(range(self.start, self.end), styles, strict=True)]
        for i, wrapper in zip(range(self.start, self.end), wrappers, strict=True):
            layer = layers[i]
            if keep_first and i == self.start:
                layer.forward = wrapper
            else:
                self._taps.append((layer, layer.__dict__.get("forward"), wrapper))
        return True

    def _arm(self) -> None:
        """Set the layers' wrappers for the forward being sampled."""
        for layer, _prior, wrapper in self._taps:
            layer.forward = wrapper
        self._armed = True

    def _disarm(self) -> None:
        """Give the layers back their own ``forward`` (unsampled forwards never see a wrapper)."""
        self._armed = False
        for layer, prior, _wrapper in self._taps:
            if prior is None:
                layer.__dict__.pop("forward", None)
            else:
                layer.forward = prior

    def _wrap(self, i: int, forward: Callable[..., Any], style: str) -> Callable[..., Any]:
        sig = inspect.signature(forward)
        name = input_source(i)
        first, last = i == self.start, i == self.end - 1 and self.end == self.num_layers
        compiling = torch.compiler.is_compiling

        def layer_forward(*args: Any, **kwargs: Any) -> Any:
            if compiling():  # traced by torch.compile: folds away
                return forward(*args, **kwargs)
            self._enter(first, args, kwargs)
            if self.active is None:
                return forward(*args, **kwargs)
            try:
                bound = sig.bind(*args, **kwargs)
                self._tap(bound, style, name)
            except Exception as exc:  # hs_tracer's own: the layer runs as the engine called it
                self._failure(exc)
                return forward(*args, **kwargs)
            out = forward(*bound.args, **bound.kwargs)
            if last and self.active is not None and self.active is not NOT_RECORDED:
                self._last_block(out, bound)
            return out

        layer_forward.__wrapped__ = forward  # type: ignore[attr-defined]
        return layer_forward

    # ---- per forward ---------------------------------------------------------------------------
    def _off(self) -> bool:
        """Nothing is sampled: identity is off, the sampler failed, or tracing was switched off."""
        return self.every <= 0 or self.failed is not None or not self._tracing()

    def _close_stale(self) -> None:
        """A new forward begins: no sample of an earlier one is still being filled."""
        self.active = None
        if self._armed:  # a sampled forward that never reached the body's end
            self._disarm()

    def _open(self, rows: list[int]) -> None:
        """Sample this forward at ``rows`` (row indices of its batch): arm the layers and take a
        free slot (none free: the taps pass, nothing is recorded)."""
        self.countdown = self.every - 1
        self.sampled += 1
        for stale in self._slots:  # filled by a forward that never reached the body's end
            if stale.state == "filling":
                stale.state = "free"
        slot = next((s for s in self._slots if s.state == "free"), None) if self.record else None
        self._arm()
        if slot is None:
            if self.record:
                self.missed += 1
            self.active = NOT_RECORDED
            return
        n = len(rows)
        slot.idx_host[:n] = torch.tensor(rows, dtype=torch.int64)
        slot.idx[:n].copy_(slot.idx_host[:n], non_blocking=True)
        slot.names, slot.count, slot.slot_count, slot.state = [], n, 0, "filling"
        self.active = slot

    def _take(self, name: str, value: Any) -> None:
        """Rows of one candidate into the active slot (stream-ordered: before any later write)."""
        slot = self.active
        if slot is None or slot is NOT_RECORDED:
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

    def _take_inputs(self, name: str, hidden: Any, residual: Any) -> None:
        """A layer's inputs as the residual stream (``hidden_states + residual``; the embedding
        enters the first layer with no residual)."""
        if self.active is not NOT_RECORDED:
            self._take(name, hidden if residual is None else hidden + residual)

    def finish(self, result: Any) -> None:
        """The body returned (final norm first, the aux states last): the final norm's rows and the
        slots' rows, then project and copy the sample to the host (async), with an event."""
        slot = self.active
        if self._armed:
            self._disarm()
        if slot is None or slot is NOT_RECORDED or not isinstance(result, tuple):
            self.active = None
            return
        try:
            self._take(str(sources.Source.final_norm()), result[0])
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


L = TypeVar("L", bound=LayerIdentity)


def installed(sampler: L) -> L | None:
    """``sampler`` with its layers wrapped, or None (logged once) where its buffers cannot be made
    or the body's decoder layers take no capture its adapter knows: serving goes on without it."""
    try:
        done = sampler.install()
    except (RuntimeError, ValueError, TypeError) as exc:  # e.g. no memory for its buffers
        logger.warning("hs_tracer: in-engine layer identity is off: %s: %s", type(exc).__name__, exc)
        return None
    if not done:
        logger.info("hs_tracer: %s's decoder layers take no capture hs_tracer knows; in-engine layer "
                    "identity is off", type(sampler.body).__name__)
        return None
    return sampler

"""Same-token layer identity: which candidate source a slot's rows *equal*, measured on the same tokens.

Why this exists beside the statistics: window statistics compare a slot's distribution with the
training profile's and cannot always separate neighbouring deep layers of a real model; an account
of the wiring (the engine's ``layers_to_capture``, a capture's manifest, a config's ids) is what
someone *says* is fed. Here the slot's rows are compared with every candidate source — the
embedding output, each block's output (the residual stream, ``hidden_states + residual`` in
SGLang's pre-norm loops), the final norm — computed for the *same* rows. One candidate equals the
slot up to the dtype's rounding; the others differ by what a whole layer adds. That names the fed
layer exactly on any model and text.

The math. For slot rows ``x_i`` and a candidate's rows ``c_i`` (i over the sampled rows), the
error is the relative distance ``e = sqrt(sum_i |x_i - c_i|^2 / sum_i |c_i|^2)`` (one number over
all rows: robust to a row of small norm). A slot is *measured* as candidate ``s`` when ``e_s`` is
within the tolerance and every other candidate's error is at least ``SEPARATION`` times larger;
candidates within the tolerance of each other (two layers that compute the same thing) are named
together, never one picked.

The tolerance is per compute dtype. The rows seen by the draft and a recomputation of the same
source agree exactly inside the engine (the same tensor), and up to accumulated rounding when the
source is recomputed elsewhere (another kernel, another precision): bfloat16 keeps 8 significand
bits, a relative rounding of 2^-9 per element, and a recomputed deep residual stream accumulates a
few percent; one layer of a real model changes the residual stream by far more than that (0.1-1 of
its norm on SmolLM2-135M's deep layers, more near the embedding).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from hs_tracer.profile.target_forward import INPUT_NORM, RESIDUAL_LEFT_OUT
from hs_tracer.sources import source_sort_key

TOLERANCE = {torch.float32: 0.02, torch.float16: 0.04, torch.bfloat16: 0.06}
"""Relative error up to which a recomputed source counts as equal to the slot's rows, per dtype of
the rows compared (the lower-precision one of the two)."""
EXACT_TOLERANCE = 1e-3
"""The same inside one engine: slot rows and candidates are the same tensors' values there."""
SEPARATION = 2.0
"""The runner-up's error must be at least this many times the match's, else the slot is ambiguous."""
SHARD = "shard"
SCALE = "scale"
TRANSFORMS = {
    RESIDUAL_LEFT_OUT: "{source}'s last sublayer output without its residual",
    INPUT_NORM: "{source} after the next layer's input norm",
    SHARD: "{source} in channels {lo}-{hi} only (one shard of {tp} tensor ranks), other values elsewhere",
    SCALE: "{source} times {scale:.3g}",
}
"""The channel transforms a slot fed none of the target's layers is tested for, in words."""
SHARD_COUNTS = (2, 4, 8)


def tolerance_for(*dtypes: torch.dtype) -> float:
    """The tolerance for comparing rows of these dtypes (the least precise decides)."""
    return max(TOLERANCE.get(d, TOLERANCE[torch.bfloat16]) for d in dtypes)


@dataclass(frozen=True)
class MeasuredSlot:
    """What one slot's rows equal. ``sources``: the candidates within tolerance (one on a decisive
    measurement; several when those candidates compute the same values; none when nothing fits)."""

    index: int
    sources: tuple[str, ...]
    rows: int
    error: float  # relative error to the nearest candidate
    nearest: str
    runner_up: str | None = None
    runner_up_error: float | None = None
    errors: dict[str, float] = field(default_factory=dict)
    tolerance: float | None = None
    transform: dict[str, Any] | None = None  # the tested transform of a layer the rows equal, if any
    tested: tuple[str, ...] = ()  # the transforms tested (where the rows equal no candidate)

    @property
    def source(self) -> str | None:
        """The one source the rows equal, or None when the measurement names none or several."""
        return self.sources[0] if len(self.sources) == 1 else None

    @property
    def fed_none(self) -> bool:
        """A result, not an absence: the rows equal none of the candidates (every one is farther than
        the tolerance), so the slot is fed a value none of the target's layers has."""
        return not self.sources and self.tolerance is not None and self.error > self.tolerance

    def explained(self) -> str:
        """What a slot fed none of the layers is, as far as the tested transforms tell."""
        t = self.transform
        if t is not None:
            return f"they are {t['words']} (relative error {_pct(t['error'])})"
        if not self.tested:
            return "no channel transform was tested"
        return f"no tested transform ({', '.join(self.tested).replace('_', ' ')}) explains them"

    def describe(self) -> str:
        """The measurement in words, for findings and reports."""
        if self.source is not None:
            other = ("" if self.runner_up is None else
                     f"; {self.runner_up}, the nearest other, differs by {_pct(self.runner_up_error)}")
            return (f"its rows equal {self.source}'s on {self.rows} tokens (relative error "
                    f"{_pct(self.error)}{other})")
        if self.sources:
            return f"its rows equal each of {', '.join(self.sources)} on {self.rows} tokens (not told apart)"
        if self.fed_none:
            return (f"its rows equal none of the target's layers on {self.rows} tokens (nearest "
                    f"{self.nearest}, relative error {_pct(self.error)}); {self.explained()}")
        return (f"its rows equal no candidate source decisively on {self.rows} tokens (nearest "
                f"{self.nearest}, relative error {_pct(self.error)}; {self.runner_up} "
                f"{_pct(self.runner_up_error)})")

    def to_json(self) -> dict[str, Any]:
        out = {"index": self.index, "sources": list(self.sources), "rows": self.rows,
               "error": self.error, "nearest": self.nearest, "runner_up": self.runner_up,
               "runner_up_error": self.runner_up_error}
        if self.tolerance is not None:
            out.update(tolerance=self.tolerance, fed_none=self.fed_none)
        if self.fed_none:
            out.update(transform=self.transform, tested=list(self.tested))
        return out


def from_json(raw: Mapping[str, Any]) -> MeasuredSlot:
    """A slot's measurement as :meth:`MeasuredSlot.to_json` wrote it."""
    keep = {k: v for k, v in raw.items() if k != "fed_none"}
    return MeasuredSlot(**{**keep, "sources": tuple(raw["sources"]), "tested": tuple(raw.get("tested", ()))})


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.2g} %"


def relative_errors(rows: torch.Tensor, candidates: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """``rows`` [N, D] against each candidate's [N, D]: the relative distance over all rows (fp32)."""
    x = rows.float()
    out = {}
    for name, cand in candidates.items():
        c = cand.float()
        out[name] = float(torch.linalg.vector_norm(x - c) / torch.linalg.vector_norm(c).clamp_min(1e-30))
    return out


def identify_slot(index: int, rows: torch.Tensor, candidates: Mapping[str, torch.Tensor],
                  tolerance: float) -> MeasuredSlot:
    """One slot's rows [N, D] against every candidate's rows [N, D] of the same tokens."""
    errors = relative_errors(rows, candidates)
    ranked = sorted(errors, key=lambda s: (errors[s], source_sort_key(s)))
    best = ranked[0]
    within = tuple(sorted((s for s in ranked if errors[s] <= tolerance), key=source_sort_key))
    outside = [s for s in ranked if s not in within and s != best]  # the nearest other
    runner = outside[0] if outside else None
    decisive = bool(within) and (runner is None or errors[runner] >= SEPARATION * errors[best])
    return MeasuredSlot(index=index, sources=within if decisive else (), rows=int(rows.shape[0]),
                        error=errors[best], nearest=best, runner_up=runner,
                        runner_up_error=None if runner is None else errors[runner], errors=errors,
                        tolerance=tolerance)


def identify(slot_rows: torch.Tensor, candidates: Mapping[str, torch.Tensor],
             tolerance: float) -> list[MeasuredSlot]:
    """Every slot of ``slot_rows`` [N, K, D] (the draft input split into its K slots) against
    ``candidates`` (source name -> [N, D] rows of the same N tokens)."""
    if slot_rows.dim() != 3:
        raise ValueError(f"slot rows must be [tokens, slots, width], got {tuple(slot_rows.shape)}")
    n, _k, d = slot_rows.shape
    for name, cand in candidates.items():
        if tuple(cand.shape) != (n, d):
            raise ValueError(f"candidate {name} has shape {tuple(cand.shape)}, the slots need {(n, d)}")
    return [identify_slot(k, slot_rows[:, k], candidates, tolerance) for k in range(slot_rows.shape[1])]


def explain(slot: MeasuredSlot, rows: torch.Tensor, candidates: Mapping[str, torch.Tensor],
            channels: Mapping[str, Mapping[str, torch.Tensor]] | None = None,
            shards: bool = True) -> MeasuredSlot:
    """A slot fed none of the candidates, tested for the usual faults of a capture channel on the same
    rows ``[N, D]``: ``channels`` (transform name -> source -> rows: the values a channel hands over
    when it leaves the residual out or applies the next layer's input norm, where the target
    exposes them), a slice of the hidden size (one tensor rank's shard, ``shards``: only where the
    rows are the channels themselves, not a projection) and a constant scale of every candidate.
    The transform whose rows the slot's equal within the tolerance, the nearest if several, is kept
    on the slot; any other slot is returned as it is."""
    if not slot.fed_none or slot.tolerance is None:
        return slot
    tol, x = slot.tolerance, rows.float()
    found: list[tuple[float, dict[str, Any]]] = []
    tested = []
    for name, by_source in (channels or {}).items():
        tested.append(name)
        for source, err in relative_errors(x, by_source).items():
            found.append((err, {"transform": name, "source": source, "error": err}))
    if shards:
        tested.append(SHARD)
        found += _shards(x, candidates, tol)
    tested.append(SCALE)
    for source, cand in candidates.items():
        c = cand.float()
        scale = float((x * c).sum() / (c * c).sum().clamp_min(1e-30))
        if abs(scale - 1.0) > tol and scale != 0.0:
            err = relative_errors(x, {source: scale * c})[source]
            found.append((err, {"transform": SCALE, "source": source, "error": err, "scale": scale}))
    fits = sorted((f for f in found if f[0] <= tol), key=lambda f: (f[0], source_sort_key(f[1]["source"])))
    best = None
    if fits:
        best = dict(fits[0][1])
        best["words"] = TRANSFORMS[best["transform"]].format(**best)
    return replace(slot, transform=best, tested=tuple(tested))


def _shards(x: torch.Tensor, candidates: Mapping[str, torch.Tensor], tol: float) -> list[tuple[float, dict]]:
    """Candidates whose rows equal the slot's on one contiguous slice of the hidden size (the widest
    slice that fits: the fewest tensor ranks), while the whole rows do not."""
    width, out = int(x.shape[-1]), []
    for source, cand in candidates.items():
        c = cand.float()
        for tp in SHARD_COUNTS:
            if width % tp:
                continue
            part = width // tp
            cols = [slice(s * part, (s + 1) * part) for s in range(tp)]
            errs = [relative_errors(x[:, cut], {source: c[:, cut]})[source] for cut in cols]
            s = min(range(tp), key=errs.__getitem__)
            if errs[s] <= tol:
                out.append((errs[s], {"transform": SHARD, "source": source, "error": errs[s], "tp": tp,
                                      "lo": s * part, "hi": (s + 1) * part - 1}))
                break
    return out


def split_slots(features: torch.Tensor, num_slots: int) -> torch.Tensor:
    """The draft input [N, K*H] as [N, K, H]."""
    n, width = features.shape
    if width % num_slots:
        raise ValueError(f"draft input width {width} does not split into {num_slots} slots")
    return features.reshape(n, num_slots, width // num_slots)


def measured_sources(measured: Sequence[MeasuredSlot]) -> list[str | None]:
    """Per slot, the one source measured (None where the measurement names none or several)."""
    return [m.source for m in measured]

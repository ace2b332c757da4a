"""Which source each slot of a dump holds, measured by recomputing the target on the dump's own tokens.

Why: a capture's manifest, a dump's ids and their convention are accounts of what was fed; window
statistics cannot always tell neighbouring deep layers of a real model apart. Recomputing the target
on the same tokens and comparing the stored rows with every candidate source
(:mod:`hs_tracer.diagnosis.same_token`) names the layer each slot holds, on any text.

Used by ``hs-tracer diagnose --target`` (the measurement decides each slot's observed source) and
``hs-tracer profile build --target`` (a dump whose rows hold other layers than its ids say is a
critical ``training_record_mismatch``; the profile records the measured sources).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hs_tracer.diagnosis.same_token import MeasuredSlot, explain, from_json, identify, tolerance_for
from hs_tracer.errors import InputError
from hs_tracer.findings import Code, Finding, Severity
from hs_tracer.profile.progress import BuildProgress
from hs_tracer.profile.target_forward import Target
from hs_tracer.profile.token_rows import Sample

STATISTICAL = "statistical: pass --target to measure which layer each slot carries"


@dataclass
class Measurement:
    """Per slot, what its rows equal; with what was compared and what could not be."""

    slots: list[MeasuredSlot]
    sequences: int
    rows: int
    tolerance: float
    dtype: str
    target: str
    left_out: dict[str, int] = field(default_factory=dict)

    @property
    def sources(self) -> list[str | None]:
        return [m.source for m in self.slots]

    def to_json(self) -> dict[str, Any]:
        return {"slots": [m.to_json() for m in self.slots], "sequences": self.sequences, "rows": self.rows,
                "tolerance": self.tolerance, "dtype": self.dtype, "target": self.target,
                "left_out": dict(self.left_out)}

    def summary(self) -> str:
        """What was recomputed and compared, and what could not be, in one line."""
        left = "".join(f"; {n} left out ({why})" for why, n in sorted(self.left_out.items()))
        return (f"measured: {self.target} recomputed on {self.sequences} of the data's own sequences, "
                f"{self.rows} rows of each slot compared with every source of the same tokens (tolerance "
                f"{100 * self.tolerance:.2g} % for {self.dtype} rows){left}")

    def lines(self) -> list[str]:
        """:meth:`summary`, then what each slot's rows equal."""
        return [self.summary()] + [f"  slot {m.index}: {m.describe()}" for m in self.slots]


def _dtype(name: str) -> torch.dtype:
    value = getattr(torch, str(name).replace("torch.", ""), None)
    return value if isinstance(value, torch.dtype) else torch.bfloat16


def measure(target: Target, sample: Sample, dtype: str, *, progress: bool | None = None) -> Measurement:
    """Recompute ``target`` on every sequence of ``sample`` and identify each slot from the rows of all
    of them together. Rows of another width than the target's hidden size are an input error."""
    if not sample.sequences:
        reasons = ", ".join(f"{n} left out: {why}" for why, n in sorted(sample.left_out.items())) or "no rows"
        raise InputError("--target", f"no whole sequence in the dump to recompute ({reasons})",
                         "capture requests from their first token (a prefix cache hit is not recomputable)")
    hidden = int(sample.sequences[0].rows.shape[-1])
    if hidden != target.hidden_size:
        raise InputError(f"--target {target.path}", f"hidden size {target.hidden_size}, the dump's slots are "
                         f"{hidden} wide", "pass the target the dump was produced with")
    top = max(int(seq.input_ids.max()) for seq in sample.sequences)
    if top >= target.vocab_size:
        raise InputError(f"--target {target.path}", f"the dump holds token id {top}, beyond its "
                         f"vocabulary of {target.vocab_size}", "pass the target the dump was produced with")
    bar = BuildProgress(sample.rows, "recompute target", progress, unit="tok")
    slot_rows, cands = [], {name: [] for name in target.sources}
    chans: dict[str, dict[str, list[torch.Tensor]]] = {}
    for seq in sample.sequences:
        seen: dict[str, dict[str, torch.Tensor]] = {}
        states = target.states(seq.input_ids, seq.positions, channels=seen)
        slot_rows.append(seq.rows.float())
        for name, rows in states.items():
            cands[name].append(rows)
        for kind, by_source in seen.items():
            for name, rows in by_source.items():
                chans.setdefault(kind, {}).setdefault(name, []).append(rows)
        bar.update(len(seq.positions), len(seq.positions))
    bar.close()
    tol = tolerance_for(_dtype(dtype), torch.float32)
    x = torch.cat(slot_rows)
    finite = torch.isfinite(x).all(dim=2).all(dim=1)  # non-finite rows: a finding of their own, no distance
    x = x[finite]
    cand = {k: torch.cat(v)[finite] for k, v in cands.items()}
    channels = {kind: {k: torch.cat(v)[finite] for k, v in by.items()} for kind, by in chans.items()}
    slots = [explain(m, x[:, m.index], cand, channels) for m in identify(x, cand, tol)]
    return Measurement(slots, len(sample.sequences), sample.rows, tol, str(dtype), str(target.path),
                       dict(sample.left_out))


def training_findings(measured: Sequence[MeasuredSlot], stated: Sequence[str],
                      origin: Mapping[str, Any]) -> list[Finding]:
    """A dump's stated sources (its ids in their convention) against what its rows measurably hold:
    critical where a slot holds another source, a warning where it equals none of the target's.
    ``origin``: the ids, convention and where they came from, for the message."""
    said = f"the ids {origin.get('layer_ids')} ({origin.get('convention')}, from {origin.get('ids_origin')})"
    out = []
    for m, want in zip(measured, stated, strict=True):
        if m.source is not None and m.source != want:
            out.append(Finding(
                Code.TRAINING_RECORD_MISMATCH, Severity.CRITICAL,
                f"slot {m.index} holds {m.source}, not {want} as {said} say: {m.describe()}",
                fix=f"the profile records {m.source} as the source slot {m.index} was trained on; correct "
                "the layer ids or their convention where the dump is described (draft config, --layer-ids, "
                "--convention) so the record matches the rows",
                slot=m.index, expected=want, observed=m.source,
                details={"measured": m.to_json(), "stated": list(stated)}))
        elif m.source is None:
            out.append(Finding(
                Code.TRAINING_RECORD_MISMATCH, Severity.WARNING,
                f"slot {m.index}'s rows could not be named: {m.describe()}; the profile keeps {want} as "
                f"{said} say",
                fix="check that --target is the model the dump was produced with, in the dump's precision",
                slot=m.index, expected=want, details={"measured": m.to_json()}))
    return out


def recorded_findings(meta: Mapping[str, Any]) -> list[Finding]:
    """The findings of the measurement a profile's provenance holds (``profile merge`` repeats them)."""
    raw = meta.get("source_measurement")
    if not raw or meta.get("stated_sources") is None:
        return []
    slots = [from_json(m) for m in raw["slots"]]
    return training_findings(slots, meta["stated_sources"], meta)


def trained_sources(measured: Sequence[MeasuredSlot], stated: Sequence[str]) -> list[str]:
    """What the draft was trained on: the measured source where the measurement names one, else the
    stated one."""
    return [m.source or want for m, want in zip(measured, stated, strict=True)]

"""The training provenance a reference profile records, as the preflight needs it.

The profile (:mod:`hs_tracer.profile.model`) stores, per slot, the canonical source the draft was
trained on, plus the raw ids, their convention and the target's depth and width. The preflight
compares the sources with what SGLang will capture; the depth and width must be the target's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hs_tracer.diagnosis.findings import Code, Finding, Severity
from hs_tracer.profile.model import Profile, ProfileError

__all__ = ["ProfileError", "TrainedProvenance", "check_profile_target", "read_provenance"]


@dataclass(frozen=True)
class TrainedProvenance:
    sources: list[str]
    layer_ids: list[int] | None
    convention: str | None
    num_layers: int | None
    hidden_size: int
    target_arch: str | None
    producer: str | None
    meta: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)


def read_provenance(path: str | Path) -> TrainedProvenance:
    meta = Profile.load(path).meta
    try:
        return TrainedProvenance(
            sources=[str(s) for s in meta["sources"]],
            layer_ids=meta.get("layer_ids"),
            convention=meta.get("convention"),
            num_layers=meta.get("num_layers"),
            hidden_size=int(meta["hidden_size"]),
            target_arch=meta.get("target_arch"),
            producer=meta.get("producer"),
            meta=meta,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ProfileError(f"{path}: profile metadata lacks sources/hidden_size ({exc})") from exc


def check_profile_target(p: TrainedProvenance, num_layers: int, hidden_size: int) -> list[Finding]:
    """A profile built on another target says nothing about this one."""
    findings = []
    if p.num_layers is not None and p.num_layers != num_layers:
        findings.append(Finding(
            Code.LAYER_ID_CONVENTION, Severity.WARNING,
            f"the profile was built on a {p.num_layers}-layer target, this target has {num_layers} "
            "layers: its sources may not name the same layers",
            "build the profile from this target's training data",
            expected=str(num_layers), observed=str(p.num_layers)))
    if p.hidden_size != hidden_size:
        findings.append(Finding(
            Code.DRAFT_INPUT_WIDTH_MISMATCH, Severity.CRITICAL,
            f"the profile's features are {p.hidden_size} wide, the target's hidden size is "
            f"{hidden_size}: the draft was trained on another target",
            "serve the draft with the target it was trained on",
            expected=str(p.hidden_size), observed=str(hidden_size)))
    return findings

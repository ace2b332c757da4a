"""The training provenance a reference profile records, as the preflight needs it.

The profile (:mod:`hs_tracer.profile.model`) stores, per slot, the canonical source the draft was
trained on, plus the raw ids, their convention and the target's depth and width. The preflight
compares the sources with what SGLang will capture once the profile is known to be of this model
(:func:`hs_tracer.profile.model.other_model`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hs_tracer.profile.model import Profile, ProfileError

__all__ = ["ProfileError", "TrainedProvenance", "read_provenance"]


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


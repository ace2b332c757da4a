"""The reference profile: what the draft was trained on, as mergeable per-channel statistics.

One safetensors file: the tensors below plus the JSON provenance in the safetensors header metadata
(key ``hs_tracer_profile``). No pickle anywhere.

* ``slots.{count,sum,sumsq}``  ``[K, H]`` float64: the training features per slot.
* ``pieces.{keys,tokens,sum,sumsq}``: the calibration sample (see :mod:`hs_tracer.profile.accumulate`).
* ``extras.{count,sum,sumsq}`` ``[E, H]``: other states the training dump holds (SpecForge's
  post-norm ``hidden_state`` = ``final_norm``, speculators' verifier layer), named in the metadata.
* ``atlas.{count,sum,sumsq}``  ``[C, H]``: optional layer atlas (every candidate source), named in the
  metadata.

All of them are sums, so :func:`merge_profiles` of shard profiles equals the single build.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hs_tracer.atomic_file import atomic_write
from hs_tracer.errors import InputError
from hs_tracer.fingerprint.stats import ChannelStats
from hs_tracer.profile import expectation
from hs_tracer.profile.accumulate import merge_piece_arrays

FORMAT = "hs_tracer_profile"
VERSION = 1
_META_KEY = "hs_tracer_profile"


class ProfileError(InputError):
    """A profile file is unreadable or two profiles cannot be merged; the message says why."""


@dataclass
class NamedStats:
    """Rows of per-channel stats, one per canonical source name."""

    names: list[str]
    stats: ChannelStats

    def row(self, name: str) -> ChannelStats:
        return self.stats.slot(self.names.index(name))

    def merge(self, other: NamedStats, what: str) -> NamedStats:
        if self.names != other.names:
            raise ProfileError(f"cannot merge {what}: sources {self.names} vs {other.names}")
        return NamedStats(list(self.names), self.stats.merge(other.stats))


@dataclass
class Profile:
    """Provenance (``meta``), trained-slot stats, calibration pieces, extras and the optional atlas."""

    meta: dict[str, Any]
    slots: ChannelStats
    pieces: dict[str, np.ndarray]
    extras: NamedStats | None = None
    atlas: NamedStats | None = None
    _cache: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    # --- provenance accessors --------------------------------------------------------------------
    @property
    def sources(self) -> list[str]:
        return list(self.meta["sources"])

    @property
    def num_slots(self) -> int:
        return int(self.meta["num_slots"])

    @property
    def hidden_size(self) -> int:
        return int(self.meta["hidden_size"])

    @property
    def num_layers(self) -> int | None:
        return self.meta.get("num_layers")

    @property
    def tokens(self) -> int:
        return int(self.meta["tokens"])

    @property
    def expected_acceptance(self) -> expectation.ExpectedAcceptance | None:
        return expectation.of_profile(self.meta)

    @property
    def expected_width(self) -> int:
        return self.num_slots * self.hidden_size

    def summary(self) -> str:
        m = self.meta
        lines = [
            f"profile: {m['producer']} data"
            f"{f' (written by {v})' if (v := m.get('producer_version')) else ''},"
            f" {m['tokens']} tokens from {m['records']} records",
            f"  target: {m.get('target_arch') or '?'} with {m.get('num_layers')} layers,"
            f" hidden {m['hidden_size']}, dtype {m.get('dtype')}",
            f"  slots: {', '.join(m['sources'])}  (ids {m.get('layer_ids')} in the {m.get('convention')}"
            f" convention, from {m.get('ids_origin')})",
            f"  calibration: {len(self.pieces['keys'])} pieces of {m['piece_tokens']} tokens",
        ]
        if m.get("source_measurement"):
            stated = m.get("stated_sources") or m["sources"]
            pairs = enumerate(zip(m["measured_sources"], stated, strict=True))
            differ = "; ".join(f"slot {k}: {got} (stated {want})" for k, (got, want) in pairs
                               if got not in (None, want))
            done = m["source_measurement"]
            lines.append(f"  measured on the target: {differ or 'every slot holds its stated source'}"
                         f" ({done['rows']} rows of {done['sequences']} sequences recomputed)")
        if self.extras is not None:
            lines.append(f"  extra candidates from the data: {', '.join(self.extras.names)}")
        if self.atlas is not None:
            lines.append(f"  atlas: {len(self.atlas.names)} sources, {m['atlas']['tokens']} tokens")
        exp = m.get("expected_acceptance")
        if exp:
            rates = ", ".join(f"{r:.2f}" for r in exp["per_position_rate"])
            data = exp.get("data", "training")
            lines.append(f"  expected acceptance: mean accept length {exp['mean_accept_length']:.2f}, per"
                         f" position [{rates}] ({exp['rows']} rows of {exp['sequences']} {data} sequences)")
        if m.get("shards") and not m.get("complete", True):
            lines.append(f"  INCOMPLETE: shards {m['shards']} of {m['shard_count']}")
        return "\n".join(lines)

    # --- persistence -----------------------------------------------------------------------------
    def tensors(self) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        for group, stats in (
            ("slots", self.slots),
            ("extras", self.extras.stats if self.extras else None),
            ("atlas", self.atlas.stats if self.atlas else None),
        ):
            if stats is None:
                continue
            out[f"{group}.count"] = np.ascontiguousarray(stats.count, np.float64)
            out[f"{group}.sum"] = np.ascontiguousarray(stats.sum, np.float64)
            out[f"{group}.sumsq"] = np.ascontiguousarray(stats.sumsq, np.float64)
        for name, arr in self.pieces.items():
            out[f"pieces.{name}"] = np.ascontiguousarray(arr)
        return out

    def save(self, path: str | Path) -> Path:
        from safetensors.numpy import save

        path = Path(path)
        meta = dict(self.meta)
        meta["extras_sources"] = self.extras.names if self.extras else []
        meta["atlas_sources"] = self.atlas.names if self.atlas else []
        data = save(self.tensors(), metadata={_META_KEY: json.dumps(meta, sort_keys=True)})
        return atomic_write(path, data)

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        from safetensors import safe_open

        path = Path(path)
        if not path.is_file():
            raise ProfileError(f"{path}: no such profile file; build one with `hs-tracer profile build`")
        try:
            with safe_open(str(path), framework="numpy") as f:
                raw_meta = (f.metadata() or {}).get(_META_KEY)
                tensors = {k: f.get_tensor(k) for k in list(f.keys())}
        except Exception as exc:
            raise ProfileError(f"{path}: not a safetensors profile ({exc})") from exc
        if raw_meta is None:
            raise ProfileError(f"{path}: safetensors file without hs_tracer profile metadata")
        meta = json.loads(raw_meta)
        if meta.get("format") != FORMAT or int(meta.get("version", 0)) != VERSION:
            raise ProfileError(
                f"{path}: profile format {meta.get('format')} v{meta.get('version')} unsupported"
            )

        def group(name: str) -> ChannelStats | None:
            if f"{name}.sum" not in tensors:
                return None
            return ChannelStats(tensors[f"{name}.count"], tensors[f"{name}.sum"], tensors[f"{name}.sumsq"])

        extras = group("extras")
        atlas = group("atlas")
        pieces = {k.split(".", 1)[1]: v for k, v in tensors.items() if k.startswith("pieces.")}
        return cls(
            meta=meta,
            slots=group("slots"),
            pieces=pieces,
            extras=NamedStats(meta.pop("extras_sources"), extras) if extras is not None else None,
            atlas=NamedStats(meta.pop("atlas_sources"), atlas) if atlas is not None else None,
        )


# Metadata that must agree for two profiles to be merged (everything else is summed or unioned).
_MERGE_KEYS = (
    "producer",
    "convention",
    "layer_ids",
    "sources",
    "num_slots",
    "hidden_size",
    "num_layers",
    "piece_tokens",
    "max_pieces",
    "skip_first_positions",
    "shard_count",
)


MEASURED_KEYS = ("sources", "stated_sources", "measured_sources", "source_measurement")
"""What a build that recomputed the target adds (``sources`` becomes the measured trained sources)."""


def _merge_value(meta: Mapping[str, Any], key: str) -> Any:
    """The value two shards must agree on: for ``sources``, what the ids state, since only the shard
    that measured them holds the measured sources."""
    if key == "sources" and meta.get("stated_sources") is not None:
        return meta["stated_sources"]
    return meta.get(key)


def merge_profiles(profiles: Sequence[Profile]) -> Profile:
    """Sum shard profiles into one. Shards must come from the same build settings and be disjoint."""
    if not profiles:
        raise ProfileError("nothing to merge")
    first = profiles[0]
    meta = dict(first.meta)
    slots, pieces, extras, atlas = first.slots, first.pieces, first.extras, first.atlas
    shards = list(meta.get("shards") or [])
    for p in profiles[1:]:
        for key in _MERGE_KEYS:
            if _merge_value(p.meta, key) != _merge_value(meta, key):
                raise ProfileError(
                    f"cannot merge: {key} is {meta.get(key)!r} in one profile and "
                    f"{p.meta.get(key)!r} in another; rebuild them with the same settings"
                )
        if (extras is None) != (p.extras is None) or (atlas is None) != (p.atlas is None):
            raise ProfileError("cannot merge a profile with an atlas/extras into one without")
        overlap = set(shards) & set(p.meta.get("shards") or [])
        if overlap:
            raise ProfileError(f"cannot merge: shard(s) {sorted(overlap)} appear twice")
        shards += list(p.meta.get("shards") or [])
        slots = slots.merge(p.slots)
        pieces = merge_piece_arrays(pieces, p.pieces, int(meta["max_pieces"]))
        extras = extras.merge(p.extras, "extras") if extras and p.extras else extras
        atlas = atlas.merge(p.atlas, "atlas") if atlas and p.atlas else atlas
        for key in ("tokens", "records", "files", "nonfinite_values", "skipped_tokens"):
            meta[key] = int(meta.get(key, 0)) + int(p.meta.get(key, 0))
        meta["expected_acceptance"] = expectation.merge(meta.get("expected_acceptance"),
                                                         p.meta.get("expected_acceptance"))
        if meta.get("atlas"):
            meta["atlas"] = {**meta["atlas"], "tokens": meta["atlas"]["tokens"] + p.meta["atlas"]["tokens"]}
    measured = next((p.meta for p in profiles if p.meta.get("source_measurement")), None)
    if measured is not None:  # one shard measured the sources (docs/profiles.md): the merge keeps them
        meta.update({k: measured[k] for k in MEASURED_KEYS})
    meta["shards"] = sorted(shards)
    meta.pop("build_key", None)  # identifies one shard's build (resume); a merge is not one
    count = meta.get("shard_count")
    meta["complete"] = count is None or len(shards) == count
    return Profile(meta=meta, slots=slots, pieces=pieces, extras=extras, atlas=atlas)


OTHER_MODEL_FIX = "use the profile built for this target's training data (hs-tracer profile build)"


def other_model(meta: Mapping[str, Any], *, hidden_size: int | None, num_layers: int | None = None,
                draft_vocab: int | None = None) -> str | None:
    """Why a profile is of another model than the one it would judge, in words (None: it fits).

    The one rule every command and the live diagnosis apply before judging anything against a
    profile: hidden size, layer count and the draft's vocabulary (when the profile kept the training
    data's vocabulary map) must be this model's. A profile of another model is an input problem, not
    a verdict on the draft: every comparison with it would blame the draft for what it cannot see.
    """
    differ = []
    theirs = meta.get("hidden_size")
    if hidden_size is not None and theirs is not None and int(theirs) != hidden_size:
        differ.append(f"hidden size {theirs}, this model's is {hidden_size}")
    theirs = meta.get("num_layers")
    if num_layers is not None and theirs is not None and int(theirs) != num_layers:
        differ.append(f"{theirs} layers, this model has {num_layers}")
    theirs = (meta.get("training_vocab_map") or {}).get("draft_vocab")
    if draft_vocab is not None and theirs is not None and int(theirs) != draft_vocab:
        differ.append(f"a draft vocabulary of {theirs}, this draft's is {draft_vocab}")
    if not differ:
        return None
    return f"the profile is of another model ({'; '.join(differ)})"

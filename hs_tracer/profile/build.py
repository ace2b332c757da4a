"""Build a reference profile from training dumps (optionally sharded), with provenance per slot.

Where the layer ids come from, in order: the data itself (hs_tracer captures carry
their wiring), else the draft's config (``--draft``), else explicit flags (``--layer-ids`` with
``--convention``), else the producer's default triple (recorded as ``ids_origin: default``).
The ids are converted once, here, to canonical sources through :mod:`hs_tracer.sources`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hs_tracer import __version__ as _version
from hs_tracer.errors import InputError
from hs_tracer.fingerprint.stats import ChannelStats
from hs_tracer.profile import readers
from hs_tracer.profile.accumulate import PieceSample, StatsAccumulator, add_record
from hs_tracer.profile.model import FORMAT, VERSION, NamedStats, Profile
from hs_tracer.profile.progress import BuildProgress
from hs_tracer.sources import Convention, default_ids, family_of, text_config, to_sources

DEFAULT_PIECE_TOKENS = 64
DEFAULT_MAX_PIECES = 256
DEFAULT_SKIP_FIRST = 1  # position 0 (BOS / attention sink) has outlier activations and never reaches decode


class BuildError(InputError):
    """Inputs that cannot make a profile; the message names the fix (the CLI turns it into exit 2)."""


@dataclass
class IdSpec:
    """Layer ids and how to read them, with where they came from."""

    ids: list[int] | None
    convention: Convention
    origin: str  # "data" | "draft_config" | "flag" | "default"
    family: str | None = None


@dataclass
class TargetInfo:
    num_layers: int | None = None
    hidden_size: int | None = None
    arch: str | None = None


def read_target(path: str | Path) -> TargetInfo:
    """Depth, width and architecture from a target config.json (or its directory)."""
    path = Path(path)
    cfg_file = path / "config.json" if path.is_dir() else path
    try:
        raw = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as exc:
        raise BuildError(
            f"{cfg_file}: cannot read the target config ({exc}); pass its config.json or dir"
        ) from exc
    text = text_config(raw)
    archs = raw.get("architectures") or []
    return TargetInfo(text.get("num_hidden_layers"), text.get("hidden_size"), archs[0] if archs else None)


def ids_from_draft(draft: str | Path) -> IdSpec | None:
    """The aux-layer ids a draft's config.json states, in the convention its format implies.

    SpecForge/SGLang drafts nest them in ``eagle_config`` (output of block j); speculators drafts put
    them at top level (input of layer k). None when the config states none.
    """
    path = Path(draft)
    cfg_file = path / "config.json" if path.is_dir() else path
    try:
        raw = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as exc:
        raise BuildError(f"{cfg_file}: cannot read the draft config ({exc})") from exc
    nested = raw.get("eagle_config")
    if isinstance(nested, dict) and nested.get("eagle_aux_hidden_state_layer_ids") is not None:
        return IdSpec(list(nested["eagle_aux_hidden_state_layer_ids"]), Convention.SPECFORGE, "draft_config")
    if raw.get("eagle_aux_hidden_state_layer_ids") is not None:
        return IdSpec(list(raw["eagle_aux_hidden_state_layer_ids"]), Convention.SPECULATORS, "draft_config")
    return None


@dataclass
class Dump:
    """One opened dump with every row (slot or extra) resolved to a canonical source."""

    reader: readers.Reader
    layout: readers.Layout
    num_slots: int
    hidden: int
    slot_sources: list[str]
    extra_sources: dict[str, str] = field(default_factory=dict)  # record extra name -> source
    layer_index: list[int] | None = None  # speculators: which file layers are the slots
    ids: IdSpec | None = None
    num_layers: int | None = None
    target_arch: str | None = None

    def records(self, file: Path):
        if isinstance(self.reader, readers.SpeculatorsReader):
            return self.reader.records(file, self.num_slots, self.hidden, self.layer_index)
        return self.reader.records(file, self.num_slots, self.hidden)


def _convert(ids: IdSpec, num_layers: int) -> list[str]:
    try:
        return to_sources(ids.ids, ids.convention, num_layers, family=ids.family)
    except ValueError as exc:
        raise BuildError(f"layer ids {ids.ids} ({ids.convention.value}, from {ids.origin}): {exc}") from exc


def open_dump(
    path: str | Path,
    *,
    ids: IdSpec | None = None,
    target: TargetInfo | None = None,
    all_layers: bool = False,
) -> Dump:
    """Open ``path`` and resolve its slot sources. ``all_layers``: every stored layer is a row (atlas)."""
    try:
        reader = readers.detect(path)
        layout = reader.layout()
    except readers.LayoutError as exc:
        raise BuildError(str(exc)) from exc
    target = target or TargetInfo()
    n = target.num_layers

    if isinstance(reader, readers.CaptureReader):
        m = layout.manifest
        assert m is not None
        n = n or m.num_layers
        if ids is None and m.sources:
            return Dump(
                reader,
                layout,
                m.num_slots,
                m.hidden_size,
                list(m.sources),
                ids=IdSpec(m.layers_to_capture, Convention.SGLANG_CAPTURE, "data"),
                num_layers=n,
                target_arch=m.target_arch or target.arch,
            )
        if ids is None and m.layers_to_capture is not None:
            ids = IdSpec(
                m.layers_to_capture,
                Convention.SGLANG_CAPTURE,
                "data",
                family=family_of(m.target_arch or target.arch).value,
            )
        if ids is None:
            raise BuildError(f"{path}: the capture names no sources; pass --layer-ids and --convention")
        if n is None:
            raise BuildError(f"{path}: the target's layer count is unknown; pass --num-layers or --target")
        sources = _convert(ids, n)
        return Dump(
            reader,
            layout,
            m.num_slots,
            m.hidden_size,
            sources,
            ids=ids,
            num_layers=n,
            target_arch=m.target_arch or target.arch,
        )

    if isinstance(reader, readers.SpeculatorsReader):
        layers = int(layout.layers_in_file or 0)
        hidden = int(layout.hidden_size or 0)
        final = {"final_norm": "final_norm"} if "final_norm" in layout.extras else {}
        if all_layers:
            if ids is None:  # an all-layer dump: ids 0..L-1 (C_in) = embedding, block:0 .. block:L-2
                n = n or layers - 1
                ids = IdSpec(list(range(layers)), Convention.SPECULATORS, "default")
            if n is None:
                raise BuildError(f"{path}: pass --num-layers or --target to read the atlas ids")
            sources = _convert(ids, n)
            if len(sources) != layers:
                raise BuildError(f"{path}: {layers} layers stored but {len(sources)} atlas ids given")
            return Dump(
                reader,
                layout,
                layers,
                hidden,
                sources,
                dict(final),
                layer_index=list(range(layers)),
                ids=ids,
                num_layers=n,
                target_arch=target.arch,
            )
        if n is None:
            raise BuildError(f"{path}: the target's layer count is unknown; pass --num-layers or --target")
        if ids is None:
            ids = IdSpec(None, Convention.SPECULATORS, "default")
        data_ids = ids.ids if ids.ids is not None else default_ids(ids.convention, n)
        sources = _convert(IdSpec(data_ids, ids.convention, ids.origin, ids.family), n)
        # speculators trains on hs[:, :-1]; the file has one more layer (the verifier's, id N) than the
        # draft's ids when the ids list excludes it, as launch_vllm.py writes it.
        if len(sources) == layers - 1:
            extra = {f"layer:{layers - 1}": f"block:{n - 1}"}
        elif len(sources) == layers:
            extra = {f"layer:{layers - 1}": sources[-1]}
            sources = sources[:-1]
        else:
            raise BuildError(
                f"{path}: files hold {layers} layers, which fits neither {len(sources)} ids nor "
                f"{len(sources)} + the verifier layer; check --layer-ids"
            )
        extra.update(final)
        ids = IdSpec(data_ids[: len(sources)], ids.convention, ids.origin, ids.family)
        return Dump(
            reader,
            layout,
            len(sources),
            hidden,
            sources,
            extra,
            list(range(len(sources))),
            ids=ids,
            num_layers=n,
            target_arch=target.arch,
        )

    # SpecForge
    hidden = layout.hidden_size or target.hidden_size
    if not hidden:
        raise BuildError(f"{path}: records have no hidden_state to tell the hidden size; pass --target")
    if layout.width % hidden:
        raise BuildError(
            f"{path}: aux_hidden_state width {layout.width} is not a multiple of hidden {hidden}"
        )
    k = layout.width // hidden
    if n is None:
        raise BuildError(f"{path}: the target's layer count is unknown; pass --num-layers or --target")
    if ids is None:
        ids = IdSpec(None, Convention.SPECFORGE, "default")
    data_ids = ids.ids if ids.ids is not None else default_ids(ids.convention, n)
    sources = _convert(IdSpec(data_ids, ids.convention, ids.origin, ids.family), n)
    ids = IdSpec(data_ids, ids.convention, ids.origin, ids.family)
    if len(sources) != k:
        raise BuildError(
            f"{path}: records hold {k} slots of {hidden} but the ids {data_ids} name {len(sources)}"
        )
    extra = {"final_norm": "final_norm"} if "final_norm" in layout.extras else {}
    return Dump(reader, layout, k, hidden, sources, extra, ids=ids, num_layers=n, target_arch=target.arch)


def _selection(record: readers.Record, skip_first: int):
    """Index of the tokens kept (positions >= skip_first): a slice when positions are 0..T-1."""
    pos = record.positions
    if pos is None or skip_first <= 0:
        return slice(None)
    if len(pos) and pos[0] == 0 and np.array_equal(pos, np.arange(len(pos))):
        return slice(skip_first, None)
    import torch

    return torch.from_numpy(pos >= skip_first)


def _stack(accs: Sequence[StatsAccumulator]) -> ChannelStats:
    return ChannelStats(
        np.concatenate([a.stats.count for a in accs]),
        np.concatenate([a.stats.sum for a in accs]),
        np.concatenate([a.stats.sumsq for a in accs]),
    )


def _shard_files(dumps: Sequence[Dump], shard: tuple[int, int] | None) -> list[tuple[Dump, Path, int]]:
    return [(d, f, f.stat().st_size) for d in dumps for f in d.reader.files(shard)]


def build_key(
    inputs: Sequence[Dump],
    *,
    atlas: Dump | None = None,
    shard: tuple[int, int] | None = None,
    piece_tokens: int = DEFAULT_PIECE_TOKENS,
    max_pieces: int = DEFAULT_MAX_PIECES,
    skip_first: int = DEFAULT_SKIP_FIRST,
) -> str:
    """Digest of everything a build's result depends on: settings, wiring, and this shard's files
    (relative path, size, mtime). Stored in the profile so ``--resume`` can skip a shard already built."""

    def spec(d: Dump) -> dict[str, Any]:
        files = []
        for f in d.reader.files(shard):
            st = f.stat()
            files.append([d.reader.rel(f), st.st_size, st.st_mtime_ns])
        ids = [d.ids.ids, d.ids.convention.value, d.ids.family] if d.ids else None
        return {
            "path": str(d.reader.root),
            "sources": d.slot_sources,
            "extras": d.extra_sources,
            "ids": ids,
            "files": files,
        }

    doc = {
        "format": [FORMAT, VERSION],
        "shard": list(shard) if shard else None,
        "settings": [piece_tokens, max_pieces, skip_first],
        "inputs": [spec(d) for d in inputs],
        "atlas": spec(atlas) if atlas is not None else None,
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def already_built(path: str | Path, key: str) -> bool:
    """True when ``path`` is a readable profile written by a build with this :func:`build_key`."""
    from hs_tracer.profile.model import Profile, ProfileError

    if not Path(path).is_file():
        return False
    try:
        return Profile.load(path).meta.get("build_key") == key
    except ProfileError:
        return False


def _accumulate_rows(
    dump: Dump, files: Sequence[tuple[Dump, Path, int]], skip_first: int, progress: BuildProgress
) -> tuple[NamedStats, int]:
    """All rows (slots + extras) of a dump as one :class:`NamedStats` (atlas)."""
    extra = {e: s for e, s in dump.extra_sources.items() if s not in dump.slot_sources}
    slots = StatsAccumulator(dump.num_slots, dump.hidden)
    rows = {e: StatsAccumulator(1, dump.hidden) for e in extra}
    for _d, file, size in files:
        tokens = 0
        for rec in dump.records(file):
            sel = _selection(rec, skip_first)
            slots.add(rec.slots[sel])
            for e, acc in rows.items():
                acc.add(rec.extras[e][sel][:, None])
            tokens += int(rec.slots[sel].shape[0])
        progress.update(size, tokens)
    names = list(dump.slot_sources) + list(extra.values())
    return NamedStats(names, _stack([slots, *rows.values()])), slots.tokens


def build_profile(
    inputs: Sequence[Dump],
    *,
    atlas: Dump | None = None,
    shard: tuple[int, int] | None = None,
    piece_tokens: int = DEFAULT_PIECE_TOKENS,
    max_pieces: int = DEFAULT_MAX_PIECES,
    skip_first: int = DEFAULT_SKIP_FIRST,
    progress: bool | None = None,
) -> Profile:
    """Stream every record of ``inputs`` (this shard's files only) into a profile.

    ``progress``: None shows a bar on a terminal and log lines otherwise (see
    :mod:`hs_tracer.profile.progress`), False nothing.
    """
    if not inputs:
        raise BuildError("no input dumps given")
    first = inputs[0]
    for d in inputs[1:]:
        if (d.slot_sources, d.hidden) != (first.slot_sources, first.hidden):
            raise BuildError(
                f"inputs disagree: {first.reader.root} has {first.slot_sources} x {first.hidden}, "
                f"{d.reader.root} has {d.slot_sources} x {d.hidden}"
            )
    k, h = first.num_slots, first.hidden
    slots = StatsAccumulator(k, h)
    pieces = PieceSample(k, h, piece_tokens, max_pieces)
    extra_names = sorted({s for d in inputs for s in d.extra_sources.values()})
    extras = {name: StatsAccumulator(1, h) for name in extra_names}
    work = _shard_files(inputs, shard)
    atlas_work = _shard_files([atlas], shard) if atlas is not None else []
    desc = f"profile shard {shard[0]}/{shard[1]}" if shard else "profile"
    bar = BuildProgress(sum(w[2] for w in work + atlas_work), desc, progress)
    records = skipped = 0
    for d, file, size in work:
        tokens = 0
        for rec in d.records(file):
            sel = _selection(rec, skip_first)
            x = rec.slots[sel]
            skipped += rec.slots.shape[0] - x.shape[0]
            add_record(slots, pieces, f"{d.reader.root.name}/{rec.key}", x)
            for e, src in d.extra_sources.items():  # a dump without an extra adds no counts to it
                extras[src].add(rec.extras[e][sel][:, None])
            tokens += int(x.shape[0])
            records += 1
        bar.update(size, tokens)

    meta: dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        "created_by": f"hs_tracer {_version}",
        "producer": first.layout.producer,
        "convention": first.ids.convention.value if first.ids else None,
        "layer_ids": first.ids.ids if first.ids else None,
        "ids_origin": first.ids.origin if first.ids else None,
        "family": first.ids.family if first.ids else None,
        "sources": list(first.slot_sources),
        "num_slots": k,
        "hidden_size": h,
        "num_layers": first.num_layers,
        "target_arch": first.target_arch,
        "dtype": first.layout.dtype,
        "tokens": slots.tokens,
        "records": records,
        "files": len(work),
        "nonfinite_values": slots.nonfinite,
        "skipped_tokens": skipped,
        "skip_first_positions": skip_first,
        "piece_tokens": piece_tokens,
        "max_pieces": max_pieces,
        "inputs": [{"producer": d.layout.producer, "path": str(d.reader.root)} for d in inputs],
        "shard_count": shard[1] if shard else None,
        "shards": [shard[0]] if shard else [],
        "complete": shard is None or shard[1] == 1,
        "build_key": build_key(
            inputs,
            atlas=atlas,
            shard=shard,
            piece_tokens=piece_tokens,
            max_pieces=max_pieces,
            skip_first=skip_first,
        ),
        "atlas": None,
    }
    if slots.tokens == 0 and shard is None:
        raise BuildError("no tokens read: is the shard empty or every position skipped?")
    atlas_stats = None
    if atlas is not None:
        atlas_stats, atlas_tokens = _accumulate_rows(atlas, atlas_work, skip_first, bar)
        meta["atlas"] = {
            "producer": atlas.layout.producer,
            "path": str(atlas.reader.root),
            "layer_ids": atlas.ids.ids if atlas.ids else None,
            "convention": atlas.ids.convention.value if atlas.ids else None,
            "tokens": atlas_tokens,
        }
    bar.close()
    return Profile(
        meta=meta,
        slots=slots.stats,
        pieces=pieces.arrays(),
        extras=NamedStats(extra_names, _stack(list(extras.values()))) if extras else None,
        atlas=atlas_stats,
    )

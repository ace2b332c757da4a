"""Building a reference profile as a library call: what ``hs-tracer profile build`` does, for the
command and for callers without a command line (the testbed).

:func:`build_profile_file` checks every input before any work, resolves the layer ids (the data,
``draft``, ``layer_ids`` with ``convention``, else the producer's default), streams the dumps into a
profile (:mod:`hs_tracer.profile.build`), measures each slot's source on a recomputation of the
target where it has weights, and writes the profile with what it found.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from hs_tracer.diagnosis.calibration import profile_findings
from hs_tracer.errors import InputError
from hs_tracer.findings import Finding, Severity
from hs_tracer.inputs.capture import check_capture
from hs_tracer.inputs.model_config import check_target, read_config
from hs_tracer.inputs.outputs import check_output
from hs_tracer.inputs.profile import load_profile
from hs_tracer.profile import build, expectation, token_rows
from hs_tracer.profile.build import Dump
from hs_tracer.profile.capture_format import is_capture_dir
from hs_tracer.profile.model import Profile, merge_profiles
from hs_tracer.sources import Convention, Family, family_of

if TYPE_CHECKING:
    from hs_tracer.diagnosis.recompute import Measurement


@dataclass
class BuildRequest:
    """``profile build``'s flags as typed values (defaults as the flags'): the command builds from one,
    and so does a caller without a command line (the testbed) instead of going through argv."""
    sources: list[Path]
    output: Path
    draft: Path | None = None
    layer_ids: str | None = None
    convention: str | None = None
    family: str | None = None
    target: Path | None = None
    num_layers: int | None = None
    shard: str | None = None
    atlas: Path | None = None
    atlas_layer_ids: str | None = None
    atlas_convention: str = "speculators"
    piece_tokens: int | None = None
    max_pieces: int | None = None
    skip_first: int | None = None
    expected_sequences: int = 64
    expected_data: list[Path] | None = None
    measure_sequences: int = 8
    measure_tokens: int = 512
    no_progress: bool = False
    resume: bool = False
    producer_version: str | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> BuildRequest:
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


def _ids(text: str | None, flag: str) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(v) for v in text.replace(" ", "").split(",") if v != ""]
    except ValueError:
        raise InputError(f"{flag} {text!r}: expected comma-separated integers, e.g. 1,29,57") from None


def parse_shard(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    try:
        i, n = (int(v) for v in text.split("/"))
    except ValueError:
        raise InputError(f"--shard {text!r}: expected i/n, e.g. 0/8") from None
    if not 0 <= i < n:
        raise InputError(f"--shard {text!r}: need 0 <= i < n")
    return i, n


def _check_build_inputs(args: BuildRequest) -> None:
    """Every input exists and is well formed, and the output replaces none of them: before any work."""
    inputs = [*args.sources, *(p for p in (args.draft, args.target, args.atlas) if p is not None)]
    for src in [*args.sources, *([args.atlas] if args.atlas else [])]:
        if not src.exists():
            raise InputError(src, "no such file or directory", "pass a SpecForge, speculators or capture dir")
        if src.is_dir() and is_capture_dir(src):
            check_capture(src)
    if args.target is not None:
        check_target(args.target)
    if args.draft is not None:
        read_config(args.draft, "--draft", "draft")
    for held in args.expected_data or []:
        if not (args.draft and args.target):
            raise InputError("--expected-data", "the expected acceptance is measured with --draft and "
                             "--target", "pass both, or leave --expected-data out")
        if not held.is_dir():
            raise InputError(held, "not a directory", "pass a SpecForge or speculators dump of held-out data")
    check_output(args.output, "-o", [*inputs, *(args.expected_data or [])])


def build_profile_file(args: BuildRequest) -> int:
    """Build, check and write the profile ``args`` asks for, printing what ``profile build`` prints;
    the exit status (1: the dump's rows hold other sources than its ids say)."""
    _check_build_inputs(args)
    target = build.read_target(args.target) if args.target else build.TargetInfo()
    if args.num_layers is not None:
        target.num_layers = args.num_layers
    convention = Convention.parse(args.convention) if args.convention else None
    family = (
        Family.parse(args.family).value
        if args.family
        else (family_of(target.arch).value if target.arch else None)
    )
    flag_ids = _ids(args.layer_ids, "--layer-ids")
    ids = build.ids_from_draft(args.draft) if args.draft else None
    if ids is not None and flag_ids is not None:
        raise InputError(
            f"--draft {args.draft} states layer ids {ids.ids} and --layer-ids gives {flag_ids}: "
            "pass one of them"
        )
    if ids is None and flag_ids is not None:
        if convention is None:
            raise InputError(
                "--layer-ids needs --convention (e.g. specforge for SpecForge draft-config ids)"
            )
        ids = build.IdSpec(flag_ids, convention, "flag")
    elif ids is not None and convention is not None:
        ids.convention = convention  # e.g. SpecForge data captured by SGLang on a DeepSeek target
    elif ids is None and convention is not None:
        ids = build.IdSpec(None, convention, "default")
    if ids is not None:
        ids.family = family
        if ids.convention is Convention.SGLANG_DRAFT_CONFIG and family is None:
            raise InputError(
                "--convention sglang_draft_config needs --family or --target (its architecture)"
            )
    dumps = [build.open_dump(path, ids=ids, target=target) for path in args.sources]
    atlas = None
    if args.atlas:
        atlas_ids = _ids(args.atlas_layer_ids, "--atlas-layer-ids")
        a_ids = (
            build.IdSpec(atlas_ids, Convention.parse(args.atlas_convention), "flag")
            if atlas_ids
            else None
        )
        atlas_target = build.TargetInfo(
            target.num_layers or dumps[0].num_layers, target.hidden_size, target.arch
        )
        atlas = build.open_dump(args.atlas, ids=a_ids, target=atlas_target, all_layers=True)
    kwargs = {
        k: v
        for k, v in (
            ("piece_tokens", args.piece_tokens),
            ("max_pieces", args.max_pieces),
            ("skip_first", args.skip_first),
        )
        if v is not None
    }
    shard = parse_shard(args.shard)
    key = build.build_key(dumps, atlas=atlas, shard=shard, **kwargs)
    if args.resume and build.already_built(args.output, key):
        print(f"{args.output}: already built from the same files and settings; skipped (--resume)")
        return 0
    measurement = measure_sources(args, dumps, shard, kwargs.get("skip_first", build.DEFAULT_SKIP_FIRST))
    profile = build.build_profile(
        dumps,
        atlas=atlas,
        shard=shard,
        progress=False if args.no_progress else None,
        **kwargs,
    )
    if profile.atlas is not None and profile.atlas.stats.hidden != profile.slots.hidden:
        raise InputError(f"--atlas {args.atlas}", f"hidden size {profile.atlas.stats.hidden} but the "
                         f"data is of hidden size {profile.slots.hidden}",
                         "pass the atlas dump of the same target")
    profile.meta["training_vocab_map"] = expectation.training_vocab_map(args.sources[0])
    if args.draft and args.target and args.expected_sequences > 0:
        profile.meta["expected_acceptance"] = expectation.measure_or_note(
            args.draft, args.target, args.expected_data or args.sources, sequences=args.expected_sequences,
            held_out=bool(args.expected_data))
    if args.producer_version:
        profile.meta["producer_version"] = args.producer_version
    record = record_measurement(profile, measurement) if measurement is not None else []
    findings = profile_findings(profile)  # before writing: nothing is written unless all of it succeeds
    profile.save(args.output)
    if measurement is not None:
        print("\n".join(measurement.lines()))
    print(profile.summary())
    for finding in [*record, *findings]:
        print("  " + finding.one_line())
    critical = [f for f in record if f.severity is Severity.CRITICAL]
    if critical:
        print(f"the dump's rows hold other sources than its ids say in slot(s) "
              f"{', '.join(str(f.slot) for f in critical)}: the profile records the measured sources "
              f"{profile.sources} as the trained sources")
    print(f"wrote {args.output}")
    return 1 if critical else 0


def measure_sources(args: BuildRequest, dumps: list[Dump], shard: tuple[int, int] | None,
                    skip_first: int) -> Measurement | None:
    """Recompute the target on a sample of the dumped sequences (every dump's sorted files, the same
    sample on every machine) and measure each slot's source. None, with one line saying why, where
    nothing is measured: no --target weights, --measure-sequences 0, a shard other than 0, a target
    too large for memory or one transformers cannot load, or a dump without whole sequences."""
    # Imported here: these import torch (about 2 s), which only a recomputation of the target needs.
    from hs_tracer.diagnosis.recompute import measure
    from hs_tracer.profile.target_forward import has_weights, load_target, too_large

    for flag, value, low in (("--measure-sequences", args.measure_sequences, 0),
                             ("--measure-tokens", args.measure_tokens, 1)):
        if value < low:
            raise InputError(f"{flag} {value}", f"needs at least {low}", "leave it out for the default")
    if args.target is None or args.measure_sequences == 0:
        return None
    if not has_weights(args.target):
        print(f"sources not measured: --target {args.target} has no safetensors weights (config only)",
              file=sys.stderr)
        return None
    if shard is not None and shard[0] != 0:
        print("sources not measured here: shard 0 measures them for the whole build", file=sys.stderr)
        return None
    problem = too_large(args.target)
    if problem is not None:
        print(f"sources not measured: --target {args.target}: {problem}", file=sys.stderr)
        return None
    owner = {f: d for d in dumps for f in d.reader.files()}
    sample = token_rows.sample(list(owner), lambda f: owner[f].records(f), sequences=args.measure_sequences,
                               tokens=args.measure_tokens, skip_first=skip_first)
    if not sample.sequences:
        why = ", ".join(f"{n} left out: {reason}" for reason, n in sorted(sample.left_out.items()))
        print(f"sources not measured: no whole sequence with its token ids in the dump ({why})",
              file=sys.stderr)
        return None
    try:
        return measure(load_target(args.target), sample, dumps[0].layout.dtype,
                       progress=False if args.no_progress else None)
    except InputError as exc:  # e.g. an architecture transformers cannot run; the config gives the depth
        print(f"sources not measured: {exc}", file=sys.stderr)
        return None


def record_measurement(profile: Profile, measurement: Measurement) -> list[Finding]:
    """Store the measurement in the profile's provenance (the measured sources become the trained
    sources, the stated ones are kept beside them) and return what disagrees with the stated ones."""
    from hs_tracer.diagnosis.recompute import (  # imports torch: see measure_sources
        trained_sources,
        training_findings,
    )

    stated = list(profile.meta["sources"])
    findings = training_findings(measurement.slots, stated, profile.meta)
    profile.meta["stated_sources"] = stated
    profile.meta["measured_sources"] = measurement.sources
    profile.meta["source_measurement"] = measurement.to_json()
    profile.meta["sources"] = trained_sources(measurement.slots, stated)
    return findings




def merge_profile_files(paths: list[Path], output: Path, *, require_complete: bool = False) -> int:
    """Sum shard profiles into ``output``, printing what ``profile merge`` prints; the exit status
    (1: a shard's measurement found other sources than its ids say)."""
    from hs_tracer.diagnosis.recompute import recorded_findings  # imports torch: see measure_sources

    check_output(output, "-o", paths)
    merged = merge_profiles([load_profile(p, flag="") for p in paths])
    if require_complete and not merged.meta.get("complete", True):
        missing = sorted(set(range(int(merged.meta["shard_count"]))) - set(merged.meta["shards"]))
        raise InputError(f"shards {missing} of {merged.meta['shard_count']} are missing; nothing written")
    merged.save(output)
    print(merged.summary())
    record = recorded_findings(merged.meta)
    for finding in record:
        print("  " + finding.one_line())
    print(f"wrote {output}")
    return 1 if any(f.severity is Severity.CRITICAL for f in record) else 0

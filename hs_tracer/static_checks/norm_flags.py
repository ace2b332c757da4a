"""Draft normalisation flags: which ones the serving engine applies, against the ones the draft was
measured with.

Why: ``norm_before_fc`` (one RMSNorm over the K*H input), EAGLE-3.1's ``fc_norm`` (per-slot norms
before fc) and ``norm_output`` (the post-norm hidden as the recurrent state) change the draft's math
without changing any shape. A flag the engine honours differently from the trainer leaves the
features right and only acceptance drops. SGLang (``models/llama_eagle3.py`` of its newest
supported release) reads ``norm_before_fc`` nested in ``eagle_config`` or at the top level,
``fc_norm`` / ``use_aux_norm`` and ``norm_output`` only at the top level, and has no
``norm_before_residual`` branch. vLLM (``models/llama_eagle3.py`` of its newest supported release)
reads ``norm_before_fc`` nested in ``eagle_config`` first, then at the top level, ``fc_norm``,
``norm_output`` and ``norm_before_residual`` at the top level; its reader of speculators' format
writes all four there, ``norm_before_residual`` true unless the config says otherwise.

The trained flags come from the profile's expected acceptance (the flags the draft config had when
``profile build`` measured it); without that, :mod:`hs_tracer.preflight.format_checks` still flags a
flag written where SGLang does not read it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hs_tracer.draft.norm_flags import FLAGS
from hs_tracer.findings import Code, Finding, Severity
from hs_tracer.sglang_releases import NEWEST_RELEASE
from hs_tracer.sources import NEWEST_VLLM


def served_flags(cfg: Mapping[str, Any], engine: str = "sglang") -> dict[str, bool]:
    """Each flag as the engine (``sglang`` or ``vllm``, its newest supported release) applies it."""
    nested = cfg.get("eagle_config") if isinstance(cfg.get("eagle_config"), dict) else {}
    if engine == "vllm":
        return {
            "norm_before_fc": bool(nested.get("norm_before_fc", cfg.get("norm_before_fc", False))),
            "fc_norm": bool(cfg.get("fc_norm")),
            "norm_output": bool(cfg.get("norm_output")),
            "norm_before_residual": bool(cfg.get("norm_before_residual", "speculators_model_type" in cfg)),
        }
    return {
        "norm_before_fc": bool(nested.get("norm_before_fc") or cfg.get("norm_before_fc")),
        "fc_norm": bool(cfg.get("fc_norm") or cfg.get("use_aux_norm")),
        "norm_output": bool(cfg.get("norm_output")),
        "norm_before_residual": False,
    }


def check_norm_flags(draft_config: Mapping[str, Any], trained: Mapping[str, bool] | None,
                     engine: str = "sglang", engine_version: str = "") -> list[Finding]:
    """``norm_flags`` (critical) for every flag the engine (``sglang`` or ``vllm``) applies differently
    from ``trained``."""
    if not trained or not draft_config:
        return []
    served = served_flags(draft_config, engine)
    if engine == "vllm":
        name, serving = "vLLM", f"vLLM {engine_version or NEWEST_VLLM}"
    else:
        name, serving = "SGLang", f"SGLang {NEWEST_RELEASE}"
    findings = []
    for flag in FLAGS:
        if flag not in trained or bool(trained[flag]) == served[flag]:
            continue
        where = "eagle_config or the top level" if flag == "norm_before_fc" else "the top level"
        fix = (f"set {flag} to {str(bool(trained[flag])).lower()} where {name} reads it ({where}), or "
               "rebuild the profile if the draft was retrained with it")
        if engine != "vllm" and flag == "norm_before_residual":  # no flag to set: SGLang has no branch
            fix = (f"{serving} has no norm_before_residual branch, whatever the config says: serve the draft "
                   f"with an engine that honours it (vLLM {NEWEST_VLLM}), or retrain it with "
                   "norm_before_residual false and rebuild the profile")
        findings.append(Finding(
            Code.NORM_FLAGS, Severity.CRITICAL,
            f"{serving} serves the draft with {flag}={str(served[flag]).lower()}; its expected "
            "acceptance "
            f"was measured with {flag}={str(bool(trained[flag])).lower()}: the features stay right, the "
            "draft's math changes and acceptance drops",
            fix,
            expected=str(bool(trained[flag])).lower(), observed=str(served[flag]).lower(),
            details={"flag": flag}))
    return findings

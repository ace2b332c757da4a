"""Draft normalisation flags: which ones the serving engine applies, against the ones the draft was
measured with.

Why: ``norm_before_fc`` (one RMSNorm over the K*H input), EAGLE-3.1's ``fc_norm`` (per-slot norms
before fc) and ``norm_output`` (the post-norm hidden as the recurrent state) change the draft's math
without changing any shape. A flag the engine honours differently from the trainer leaves the
features right and only acceptance drops. Where each engine reads each flag is its adapter's
(``Engine.served_flags``, ``Engine.honoured_flags``).

The trained flags come from the profile's expected acceptance (the flags the draft config had when
``profile build`` measured it); without that, :mod:`hs_tracer.preflight.format_checks` still flags a
flag written where SGLang does not read it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hs_tracer import engines
from hs_tracer.draft.norm_flags import FLAGS
from hs_tracer.findings import Code, Finding, Severity


def check_norm_flags(draft_config: Mapping[str, Any], trained: Mapping[str, bool] | None,
                     engine: str = engines.DEFAULT, engine_version: str = "") -> list[Finding]:
    """``norm_flags`` (critical) for every flag the engine (a registered name) applies differently
    from ``trained``; the engine says how it reads each flag (``Engine.served_flags``)."""
    if not trained or not draft_config:
        return []
    eng = engines.get(engine)
    served = eng.served_flags(draft_config)
    name = eng.display_name
    serving = f"{name} {eng.flags_release(engine_version)}"
    findings = []
    for flag in FLAGS:
        if flag not in trained or bool(trained[flag]) == served[flag]:
            continue
        where = "eagle_config or the top level" if flag == "norm_before_fc" else "the top level"
        fix = (f"set {flag} to {str(bool(trained[flag])).lower()} where {name} reads it ({where}), or "
               "rebuild the profile if the draft was retrained with it")
        if flag not in eng.honoured_flags:  # no flag to set: the engine's draft model has no branch
            others = [f"{o.display_name} {o.newest_release()}" for o in map(engines.get, engines.names())
                      if flag in o.honoured_flags]
            fix = (f"{serving} has no {flag} branch, whatever the config says: serve the draft "
                   f"with an engine that honours it ({', '.join(others) or 'none known'}), or retrain it "
                   f"with {flag} false and rebuild the profile")
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

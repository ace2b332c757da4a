"""Prometheus alert rules for hs_tracer, as code (rendered to deploy/prometheus/rules/hs-tracer.rules.yml).

Every rule is evaluated per scheduler process (no aggregation, so every label of the series -- model,
ranks, instance, and Kubernetes' namespace/pod -- reaches Alertmanager). Acceptance is computed from
the counters ("rates first, then divide"), and every acceptance rule needs a minimum of traffic in
its window so a nearly idle server does not page on noise. Each rule carries ``summary``,
``description`` and ``runbook_url`` (an anchor in docs/runbook.md). The unit tests are
deploy/prometheus/tests/*.test.yml, run with ``promtool test rules``.
"""

from __future__ import annotations

from typing import Any

from hs_tracer.diagnosis.findings import NOT_WIRING
from hs_tracer.diagnosis.matcher import Thresholds
from hs_tracer.export import prometheus as m

AL_FLOOR = 1.25
"""Mean accept length below which a draft is useless: a miswired draft sits at 1.0-1.1, a correct but
modest one (too little training data) at 1.6-2.7."""

DROP_FACTOR = 0.7
"""The acceptance-drop rule fires below this fraction of the trailing baseline (a 30% drop)."""

MIN_DRAFTS = 200
"""Request-steps a short window needs before an acceptance rule may judge it."""

BASELINE = "6h"
"""Length of the trailing baseline window, which ends where the current window starts."""

DROPPED_SHARE = 0.01
"""Share of step records dropped that makes the diagnosis unreliable."""

DRIFT_THRESHOLD = Thresholds().drift_factor
"""The drift score is expected as D(expected) / t_match, the slot's divergence from its trained source
in units of the calibrated match level (0 = identical); the online diagnosis calls a slot drifted
above ``drift_factor`` of them (hs_tracer.diagnosis.matcher), and so does this rule."""

NON_WIRING_CODES = "|".join(code.value for code in NOT_WIRING)
"""Critical findings with their own alert (drift, acceptance); the wiring alert leaves them out."""

RUNBOOK = "docs/runbook.md"
WHERE = ("{{ $labels.model }} on {{ $labels.instance }} "
         "(tp {{ $labels.tp_rank }}, pp {{ $labels.pp_rank }}, dp {{ $labels.dp_rank }})")


def runbook_anchor(alert: str) -> str:
    """The GitHub-style anchor of the runbook section titled ``alert``."""
    return alert.lower()


def _rule(alert: str, expr: str, for_: str, severity: str, summary: str, description: str) -> dict[str, Any]:
    return {
        "alert": alert,
        "expr": expr,
        "for": for_,
        "labels": {"severity": severity, "component": "hs_tracer"},
        "annotations": {
            "summary": summary,
            "description": description,
            "runbook_url": f"{RUNBOOK}#{runbook_anchor(alert)}",
        },
    }


def _acceptance_rules() -> list[dict[str, Any]]:
    return [
        _rule(
            "HsTracerAcceptLengthNearOne",
            f"(\n  1 + rate({m.ACCEPTED_TOKENS}_total[10m]) / rate({m.DRAFTS}_total[10m])\n)"
            f" < {AL_FLOOR}\nand increase({m.DRAFTS}_total[10m]) >= {MIN_DRAFTS}\n",
            "10m", "critical",
            "Draft accept length {{ $value | printf \"%.2f\" }} for " + WHERE,
            "Mean accept length has been below " + str(AL_FLOOR) + " for 10 minutes (currently "
            "{{ $value | printf \"%.2f\" }} tokens per verify, bonus included): the draft is almost never "
            "right, so speculative decoding is slower than none. This is the signature of a miswired "
            "draft (wrong aux hidden-state layers, a single hidden state instead of K, a missing d2t or "
            "lm_head); a correct draft, even a weak one, stays well above it.",
        ),
        _rule(
            "HsTracerAcceptanceDrop",
            f"(\n  rate({m.ACCEPTED_TOKENS}_total[15m]) / rate({m.DRAFT_TOKENS}_total[15m])\n)\n"
            f"< {DROP_FACTOR} * (\n"
            f"  rate({m.ACCEPTED_TOKENS}_total[{BASELINE}] offset 15m)\n"
            f"  / rate({m.DRAFT_TOKENS}_total[{BASELINE}] offset 15m)\n)\n"
            f"and increase({m.DRAFTS}_total[15m]) >= {MIN_DRAFTS}\n"
            f"and increase({m.DRAFTS}_total[{BASELINE}] offset 15m) >= {MIN_DRAFTS * 10}\n",
            "15m", "warning",
            "Draft acceptance dropped to {{ $value | humanizePercentage }} for " + WHERE,
            "Acceptance rate (accepted / proposed draft tokens) over the last 15 minutes is "
            "{{ $value | humanizePercentage }}, below " + f"{DROP_FACTOR:.0%}" + " of its own trailing "
            + BASELINE + " baseline, and has been for 15 minutes. Something changed under a draft that "
            "used to work: a redeploy with other serving arguments or another target checkpoint, or "
            "a change in the traffic mix.",
        ),
    ]


def _wiring_rules() -> list[dict[str, Any]]:
    return [
        _rule(
            "HsTracerCriticalWiringFinding",
            f'max without (severity) (\n  {m.FINDINGS}_total{{severity="critical", '
            f'code!~"{NON_WIRING_CODES}"}}\n) > 0\n',
            "0m", "critical",
            "Critical hs_tracer finding {{ $labels.code }} for " + WHERE,
            "hs_tracer raised a critical finding with code {{ $labels.code }} in this process "
            "({{ $value }} so far): the draft is, or will be, fed features it was not trained on. "
            "The scheduler log line starting with 'hs_tracer' names the slot, the expected and the "
            "observed source and the fix.",
        ),
        _rule(
            "HsTracerSlotSourceMismatch",
            f"{m.SLOT_MATCH_SCORE} >= 0\n"
            "and on (job, instance, model, tp_rank, pp_rank, dp_rank, slot)\n"
            f"{m.SLOT_MISMATCH} == 1\n",
            "5m", "critical",
            "Slot {{ $labels.slot }} is fed {{ $labels.observed_source }} instead of "
            "{{ $labels.expected_source }} for " + WHERE,
            "For 5 minutes the live features of draft-input slot {{ $labels.slot }} have matched "
            "{{ $labels.observed_source }} (score {{ $value | printf \"%.2f\" }}), while the draft "
            "was trained on {{ $labels.expected_source }}: the engine captures another layer than the "
            "training data did.",
        ),
        _rule(
            "HsTracerFeatureDrift",
            f"{m.SLOT_DRIFT_SCORE} > {DRIFT_THRESHOLD}\n",
            "30m", "warning",
            "Draft-input slot {{ $labels.slot }} drifted from its training features for " + WHERE,
            "For 30 minutes the per-channel statistics of slot {{ $labels.slot }} have been "
            "{{ $value | printf \"%.3g\" }} times the calibrated match level away from the reference "
            "profile of its trained source (drift above " + f"{DRIFT_THRESHOLD:g}" + "). The wiring is "
            "right if no slot mismatch is reported; the target or its inputs changed (checkpoint, dtype "
            "or quantization, prompt mix).",
        ),
    ]


def _health_rules() -> list[dict[str, Any]]:
    return [
        _rule(
            "HsTracerDisabled",
            f"{m.ENABLED} == 0\n",
            "5m", "warning",
            "hs_tracer switched itself off for " + WHERE,
            "hs_tracer turned tracing off in this scheduler after an internal error; serving goes on, "
            "but acceptance and wiring are no longer watched here. The scheduler log has the error.",
        ),
        _rule(
            "HsTracerHookErrors",
            f"increase({m.HOOK_ERRORS}_total[10m]) > 0\n",
            "0m", "warning",
            "hs_tracer hook errors for " + WHERE,
            "{{ $value | printf \"%.0f\" }} exception(s) were caught inside hs_tracer's hooks in the "
            "last 10 minutes; each switches tracing off in that process. Usually an SGLang version or "
            "code path the hooks do not know.",
        ),
        _rule(
            "HsTracerRecordsDropped",
            f"rate({m.RECORDS_DROPPED}_total[10m])\n"
            f"/ (rate({m.VERIFY_STEPS}_total[10m]) + rate({m.RECORDS_DROPPED}_total[10m]))\n"
            f"> {DROPPED_SHARE}\n",
            "15m", "warning",
            "hs_tracer drops {{ $value | humanizePercentage }} of step records for " + WHERE,
            "The recorder thread cannot keep up: {{ $value | humanizePercentage }} of verify-step "
            "records were dropped over the last 10 minutes, for 15 minutes. Serving is unaffected (the "
            "scheduler never waits), but acceptance figures and the diagnosis see only a sample.",
        ),
    ]


def groups() -> list[dict[str, Any]]:
    """The rule groups, as Prometheus' rule-file ``groups`` list."""
    return [
        {"name": "hs_tracer.acceptance", "interval": "1m", "rules": _acceptance_rules()},
        {"name": "hs_tracer.wiring", "interval": "1m", "rules": _wiring_rules()},
        {"name": "hs_tracer.health", "interval": "1m", "rules": _health_rules()},
    ]


def alert_names() -> list[str]:
    return [r["alert"] for g in groups() for r in g["rules"]]

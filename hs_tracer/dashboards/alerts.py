"""Prometheus alert rules for hs_tracer, as code (rendered to deploy/prometheus/rules/hs-tracer.rules.yml).

Every rule is evaluated per scheduler process (no aggregation, so every label of the series -- model,
ranks, instance, and Kubernetes' namespace/pod -- reaches Alertmanager). Acceptance is computed from
the counters ("rates first, then divide"), and every acceptance rule needs a minimum of traffic in
its window so a nearly idle server does not page on noise. Each rule carries ``summary``,
``description`` and an absolute ``runbook_url`` (:data:`RUNBOOK_BASE` plus the section anchor in
docs/runbook.md). The presence rules catch what the others cannot see: hs_tracer that never
loaded or is no longer scraped. The unit tests are
deploy/prometheus/tests/*.test.yml, run with ``promtool test rules``.
"""

from __future__ import annotations

from typing import Any

from hs_tracer.dashboards import engine_metrics as em
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

RUNBOOK = "docs/runbook.md"
RUNBOOK_BASE = "https://github.com/hs-tracer/hs_tracer/blob/main/" + RUNBOOK
"""Where a page's ``runbook_url`` points: docs/runbook.md as published with the project. The one
place to change it is ``hs-tracer dashboards build --runbook-base URL`` (your wiki's or fork's copy);
every rule's link is ``<base>#<alert name in lower case>``, so the section titles must stay."""
WHERE = ("{{ $labels.model }} on {{ $labels.instance }} "
         "(tp {{ $labels.tp_rank }}, pp {{ $labels.pp_rank }}, dp {{ $labels.dp_rank }})")
SCRAPED = "{{ $labels.instance }} (job {{ $labels.job }})"
LOADED_WITHIN = "1h"
"""How long a scrape target that served hs_tracer series still counts as one that should."""


def runbook_anchor(alert: str) -> str:
    """The GitHub-style anchor of the runbook section titled ``alert``."""
    return alert.lower()


def runbook_url(alert: str, base: str = RUNBOOK_BASE) -> str:
    """The absolute link a pager opens: ``base`` (an http(s) URL) plus the alert's section anchor."""
    if not base.startswith(("https://", "http://")):
        raise ValueError(f"runbook base {base!r} must be an absolute http(s) URL (a pager cannot open a "
                         "relative path)")
    return f"{base}#{runbook_anchor(alert)}"


def _rule(alert: str, expr: str, for_: str, severity: str, summary: str, description: str) -> dict[str, Any]:
    return {
        "alert": alert,
        "expr": expr,
        "for": for_,
        "labels": {"severity": severity, "component": "hs_tracer"},
        "annotations": {
            "summary": summary,
            "description": description,
            "runbook_url": runbook_url(alert),
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
            f'{m.ROOT_CAUSE_INFO}{{severity="critical", wiring="true"}} == 1\n',
            "0m", "critical",
            "Miswired draft on " + WHERE + ": {{ $labels.summary }}",
            "hs_tracer found a root cause that changes what the draft is fed ({{ $labels.cause }}): "
            "{{ $labels.summary }}. Fix: {{ $labels.fix }}. The slot alerts and acceptance alerts of "
            "this server are held back while this one fires (one page per incident); the scheduler "
            "log's line 'hs_tracer: root cause' and the report have the evidence.",
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


def _coverage_rules() -> list[dict[str, Any]]:
    """A server hs_tracer traces but cannot fully judge: no other alert can fire for what it skips."""
    return [
        _rule(
            "HsTracerChecksOff",
            f"{m.CHECK_ACTIVE} == 0\n",
            "10m", "warning",
            "hs_tracer does not check {{ $labels.check }} on " + WHERE + " ({{ $labels.reason }})",
            "hs_tracer traces this server but its {{ $labels.check }} check is off ({{ $labels.reason }}): "
            "slots needs a reference profile of this target, acceptance one that carries its expected "
            "acceptance, identity HS_TRACER_IDENTITY_EVERY above 0. Until it is back, no alert can fire "
            "for what that check watches. The scheduler log's line 'hs_tracer: not checked in this "
            "process' says the same.",
        ),
    ]


def _presence_rules() -> list[dict[str, Any]]:
    """hs_tracer that never loaded, or is no longer scraped: every other rule is silent then."""
    return [
        _rule(
            "HsTracerAbsent",
            f"absent({m.ENABLED})\n",
            "15m", "warning",
            "No hs_tracer metrics in Prometheus",
            "Prometheus has had no " + m.ENABLED + " series for 15 minutes: hs_tracer never loaded in "
            "any SGLang scheduler (HS_TRACER unset, invalid HS_TRACER_* settings, an SGLang release it "
            "does not support, the package missing from the image) or nothing scrapes it. Until it "
            "is back, no acceptance, wiring or drift alert can fire.",
        ),
        _rule(
            "HsTracerNotLoaded",
            f"group by (job, instance) ({em.sel(em.SGLANG_RUNNING_REQS, selector='')})\n"
            f"unless on (job, instance)\ngroup by (job, instance) ({m.ENABLED})\n",
            "15m", "warning",
            "SGLang on " + SCRAPED + " serves metrics without hs_tracer's",
            "SGLang's own metrics (" + em.SGLANG_RUNNING_REQS + ") are scraped from this target but no "
            "hs_tracer series for 15 minutes: the plugin is not running in this replica (HS_TRACER "
            "unset here, its settings invalid, an unsupported SGLang release, an image without "
            "hs_tracer). The scheduler log says which in its line starting with 'hs_tracer'.",
        ),
        _rule(
            "HsTracerScrapeDown",
            f"up == 0\nand on (job, instance)\ngroup by (job, instance) "
            f"(max_over_time({m.ENABLED}[{LOADED_WITHIN}]))\n",
            "5m", "warning",
            "The scrape of " + SCRAPED + " fails; it served hs_tracer metrics",
            "Prometheus has failed to scrape this target for 5 minutes (up == 0), and it served hs_tracer "
            "series within the last " + LOADED_WITHIN + ": the server is down or unreachable, or its "
            "/metrics endpoint moved. hs_tracer's alerts for it are blind until the scrape works again.",
        ),
    ]


def groups() -> list[dict[str, Any]]:
    """The rule groups, as Prometheus' rule-file ``groups`` list."""
    return [
        {"name": "hs_tracer.acceptance", "interval": "1m", "rules": _acceptance_rules()},
        {"name": "hs_tracer.wiring", "interval": "1m", "rules": _wiring_rules()},
        {"name": "hs_tracer.health", "interval": "1m", "rules": _health_rules()},
        {"name": "hs_tracer.coverage", "interval": "1m", "rules": _coverage_rules()},
        {"name": "hs_tracer.presence", "interval": "1m", "rules": _presence_rules()},
    ]


def with_runbook_base(rule_groups: list[dict[str, Any]], base: str) -> list[dict[str, Any]]:
    """``rule_groups`` with every ``runbook_url`` pointing at ``base`` instead of the default."""
    def relinked(rule: dict[str, Any]) -> dict[str, Any]:
        link = {"runbook_url": runbook_url(rule["alert"], base)}
        return {**rule, "annotations": {**rule["annotations"], **link}}

    return [{**g, "rules": [relinked(r) for r in g["rules"]]} for g in rule_groups]


def alert_names() -> list[str]:
    return [r["alert"] for g in groups() for r in g["rules"]]

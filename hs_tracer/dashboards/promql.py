"""PromQL building blocks shared by the dashboard and the alert rules.

Only metrics documented in docs/metrics.md are used (the exporter in
:mod:`hs_tracer.export.prometheus` defines them). Acceptance is always computed as "sum rates first,
then divide", never as an average of ratios, so the figures are exact across ranks and windows.
"""

from __future__ import annotations

RANKS = "tp_rank, pp_rank, dp_rank"
"""Rank labels every hs_tracer series carries."""

PER_RANK = f"model, instance, {RANKS}"
"""Grouping for "per model and rank": one series per emitting scheduler process."""

DASHBOARD_SELECTOR = 'job=~"$job", instance=~"$instance", model=~"$model"'
"""Matchers every dashboard query carries (dashboard-linter's job/instance rules, plus the model)."""

RATE_WINDOW = "$__rate_interval"

FULL_REJECTION = 'le="1.0"'
"""The accept-length bucket of full rejections (prometheus_client writes bucket bounds as floats)."""


def sel(metric: str, extra: str = "", selector: str = DASHBOARD_SELECTOR) -> str:
    """``metric{selector, extra}``."""
    inner = ", ".join(part for part in (selector, extra) if part)
    return f"{metric}{{{inner}}}"


def rate(metric: str, by: str, window: str = RATE_WINDOW, extra: str = "",
         selector: str = DASHBOARD_SELECTOR) -> str:
    """``sum by (by) (rate(metric{...}[window]))``."""
    return f"sum by ({by}) (rate({sel(metric, extra, selector)}[{window}]))"


def acceptance_rate(by: str, window: str = RATE_WINDOW, selector: str = DASHBOARD_SELECTOR) -> str:
    """Accepted / proposed draft tokens."""
    return (f"{rate('hs_tracer_accepted_tokens_total', by, window, selector=selector)}\n"
            f"  / {rate('hs_tracer_draft_tokens_total', by, window, selector=selector)}")


def mean_accept_length(by: str, window: str = RATE_WINDOW, selector: str = DASHBOARD_SELECTOR) -> str:
    """Tokens per request per verify pass, the bonus token included: 1 + accepted / drafts."""
    return (f"1 + {rate('hs_tracer_accepted_tokens_total', by, window, selector=selector)}\n"
            f"  / {rate('hs_tracer_drafts_total', by, window, selector=selector)}")


def per_position_rate(by: str, window: str = RATE_WINDOW, selector: str = DASHBOARD_SELECTOR) -> str:
    """Share of request-steps whose draft position ``position`` was accepted (unconditional)."""
    accepted = rate("hs_tracer_accepted_tokens_per_position_total", f"{by}, position", window,
                    selector=selector)
    return (f"{accepted}\n  / ignoring(position) group_left\n"
            f"    {rate('hs_tracer_drafts_total', by, window, selector=selector)}")


def full_rejection_share(by: str, window: str = RATE_WINDOW, selector: str = DASHBOARD_SELECTOR) -> str:
    """Share of request-steps whose accept length is 1 (every draft token rejected)."""
    return (f"{rate('hs_tracer_accept_length_bucket', by, window, FULL_REJECTION, selector)}\n"
            f"  / {rate('hs_tracer_accept_length_count', by, window, selector=selector)}")

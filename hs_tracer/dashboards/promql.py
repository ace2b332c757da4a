"""PromQL building blocks shared by the dashboard and the alert rules.

Metric names come from the exporter (:mod:`hs_tracer.export.prometheus`), where each is defined once;
docs/metrics.md documents them. Acceptance is always computed as "sum rates first,
then divide", never as an average of ratios, so the figures are exact across ranks and windows.
"""

from __future__ import annotations

from hs_tracer.export import prometheus as m

RANKS = ", ".join(label for label in m.BASE_LABELS if label.endswith("_rank"))
"""Rank labels every hs_tracer series carries (the exporter's, DP replica and attention-DP rank
included): grouping by them keeps one series per scheduler process."""

PER_RANK = f"model, instance, {RANKS}"
"""Grouping for "per model and rank": one series per emitting scheduler process."""

DASHBOARD_SELECTOR = 'job=~"$job", instance=~"$instance", model=~"$model"'
"""Matchers every dashboard query carries (dashboard-linter's job/instance rules, plus the model)."""

RATE_WINDOW = "$__rate_interval"

FULL_REJECTION = 'le="1.0"'
"""The accept-length bucket of full rejections (prometheus_client writes bucket bounds as floats)."""


def total(name: str) -> str:
    """A counter's series (prometheus_client appends ``_total``)."""
    return f"{name}_total"


def bucket(name: str) -> str:
    """A histogram's bucket series."""
    return f"{name}_bucket"


def sum_of(name: str) -> str:
    """A histogram's sum series."""
    return f"{name}_sum"


def count_of(name: str) -> str:
    """A histogram's count series."""
    return f"{name}_count"


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
    return (f"{rate(total(m.ACCEPTED_TOKENS), by, window, selector=selector)}\n"
            f"  / {rate(total(m.DRAFT_TOKENS), by, window, selector=selector)}")


def mean_accept_length(by: str, window: str = RATE_WINDOW, selector: str = DASHBOARD_SELECTOR) -> str:
    """Tokens per request per verify pass, the bonus token included: 1 + accepted / drafts."""
    return (f"1 + {rate(total(m.ACCEPTED_TOKENS), by, window, selector=selector)}\n"
            f"  / {rate(total(m.DRAFTS), by, window, selector=selector)}")


def per_position_rate(by: str, window: str = RATE_WINDOW, selector: str = DASHBOARD_SELECTOR) -> str:
    """Share of request-steps whose draft position ``position`` was accepted (unconditional)."""
    accepted = rate(total(m.ACCEPTED_PER_POSITION), f"{by}, position", window,
                    selector=selector)
    return (f"{accepted}\n  / ignoring(position) group_left\n"
            f"    {rate(total(m.DRAFTS), by, window, selector=selector)}")


def full_rejection_share(by: str, window: str = RATE_WINDOW, selector: str = DASHBOARD_SELECTOR) -> str:
    """Share of request-steps whose accept length is 1 (every draft token rejected)."""
    return (f"{rate(bucket(m.ACCEPT_LENGTH), by, window, FULL_REJECTION, selector)}\n"
            f"  / {rate(count_of(m.ACCEPT_LENGTH), by, window, selector=selector)}")

"""Grafana dashboards, Prometheus alert rules and the Kubernetes objects that carry them, as code.

:func:`generated_files` renders every generated file of the repository (the dashboard JSON, the
Prometheus rule file, the PrometheusRule and the dashboard ConfigMap); ``hs-tracer dashboards build``
writes them and tests/test_dashboards.py checks that the committed copies are byte-for-byte what the
code renders. Hand-written deployment files (compose, Prometheus/Collector/Tempo configs, promtool
tests) live next to them under deploy/ and grafana/provisioning/.
"""

from __future__ import annotations

from pathlib import Path

DASHBOARD_DIR = "grafana/dashboards"
RULES_FILE = "deploy/prometheus/rules/hs-tracer.rules.yml"
PROMETHEUS_RULE = "deploy/kubernetes/prometheusrule.yaml"
DASHBOARD_CONFIGMAP = "deploy/kubernetes/grafana-dashboard-configmap.yaml"


def generated_files(runbook_base: str | None = None) -> dict[str, str]:
    """Repository-relative path -> exact file content of every generated file (alert runbook links
    under ``runbook_base``; None: the default the committed files carry)."""
    import json

    from hs_tracer.dashboards import lint, manifests, overview

    dashboard = overview.render()
    exclusions = {rule: dict(panels) for rule, panels in lint.OVERVIEW_EXCLUSIONS.items()}
    return {
        f"{DASHBOARD_DIR}/{overview.FILENAME}": dashboard,
        f"{DASHBOARD_DIR}/.lint": manifests.lint_config(json.loads(dashboard)["title"], exclusions),
        RULES_FILE: manifests.rules_file(runbook_base),
        PROMETHEUS_RULE: manifests.prometheus_rule(runbook_base),
        DASHBOARD_CONFIGMAP: manifests.dashboard_configmap({overview.FILENAME: dashboard}),
    }


def dashboard_queries(rate_window: str = "5m", selection: str = ".+") -> dict[str, str]:
    """Every dashboard query, ready to send to Prometheus: ``"<panel title> [<refId>]" -> PromQL`` with
    ``$__rate_interval`` set to ``rate_window`` and the job/instance/model variables to ``selection``
    (a regex). For checking the dashboard against any Prometheus, e.g. one scraping a live engine."""
    import json

    from hs_tracer.dashboards import lint, overview

    values = {"job": selection, "instance": selection, "model": selection, "__rate_interval": rate_window}
    return {f"{title} [{ref}]": lint.substitute(expr, values)
            for title, ref, expr in lint.expressions(json.loads(overview.render()))}


def alert_queries() -> dict[str, str]:
    """Every alert rule's expression: ``alert name -> PromQL`` (a result series = the alert is pending
    or firing for that series)."""
    from hs_tracer.dashboards import alerts

    return {r["alert"]: r["expr"] for g in alerts.groups() for r in g["rules"]}


def write(root: Path, runbook_base: str | None = None) -> list[Path]:
    """Write every generated file under ``root`` (a repository checkout); returns the paths written."""
    written = []
    for rel, content in generated_files(runbook_base).items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content, encoding="utf-8")
        written.append(path)
    return written


def stale(root: Path, runbook_base: str | None = None) -> list[str]:
    """Generated files under ``root`` that are missing or differ from what the code renders."""
    out = []
    for rel, content in generated_files(runbook_base).items():
        path = root / rel
        if not path.is_file() or path.read_bytes() != content.encode("utf-8"):
            out.append(rel)
    return out

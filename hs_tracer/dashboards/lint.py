"""A lint of Grafana dashboard JSON: the grafana/dashboard-linter rules that apply to hs_tracer, in Python.

dashboard-linter is a Go tool whose module cannot be fetched here, so its rules are re-stated from
its documentation, with its rule names, and made a little stricter where that is free (units and
descriptions on *every* panel with queries, not only on time series and stats; data links may only
use variables the dashboard defines). PromQL *parsing* is not done here: :func:`promql_parse_errors`
hands the expressions to ``promtool`` (Prometheus' own parser); the checks below need only the
structure of the queries hs_tracer writes.

Exclusions work like dashboard-linter's ``.lint`` file: a rule name, the panel title and a reason.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

VALID_UNITS = frozenset({
    "none", "short", "string", "percent", "percentunit", "sci", "locale", "bool", "bool_yes_no",
    "bool_on_off", "ns", "µs", "ms", "s", "m", "h", "d", "dtdurations", "dtdurationms", "hertz",
    "cps", "ops", "reqps", "rps", "wps", "iops", "cpm", "opm", "rpm", "wpm", "bytes", "decbytes",
    "bits", "Bps", "bps", "dateTimeAsIso", "dateTimeFromNow",
})
"""Grafana unit ids (its value-format categories) hs_tracer's panels may use."""

RATE_INTERVAL = "$__rate_interval"
RATE_FUNCTIONS = ("rate", "irate")
COUNTER_FUNCTIONS = ("rate", "irate", "increase")
PROMQL_KEYWORDS = frozenset({
    "by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool",
    "offset", "inf", "nan",
})
VARIABLE_FUNCTIONS = ("label_values", "label_names", "metrics", "query_result")

# Grafana's built-in variables, with the sample values dashboard-linter substitutes for them.
GLOBAL_SAMPLES = {"__rate_interval": "5m", "__interval": "1m", "__range": "1h", "__interval_ms": "60000",
                  "__range_s": "3600", "__range_ms": "3600000"}


@dataclass(frozen=True)
class Problem:
    """One lint finding: which rule, where, what."""

    rule: str
    where: str
    message: str

    def __str__(self) -> str:
        return f"{self.rule}: {self.where}: {self.message}"


Exclusions = Mapping[str, Mapping[str, str]]
"""rule name -> panel title -> reason."""

_STARTUP_FINDINGS = ("static wiring findings are counted once at startup, usually before the first "
                     "scrape, so increase() would never see them; the raw counter since process start "
                     "is the point")

OVERVIEW_EXCLUSIONS: Exclusions = {
    "target-counter-agg-rule": {
        "Findings since the tracer started": _STARTUP_FINDINGS,
        "Findings over time": _STARTUP_FINDINGS,
    },
}
"""Exclusions for grafana/dashboards/hs-tracer-overview.json, with the reasons."""


# --- traversal -----------------------------------------------------------------------------------

def panels(dashboard: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, rows' collapsed children included, rows themselves excluded."""
    for p in dashboard.get("panels", []):
        if p.get("type") == "row":
            yield from p.get("panels", [])
        else:
            yield p


def targets(panel: Mapping[str, Any]) -> list[dict[str, Any]]:
    return list(panel.get("targets") or [])


def expressions(dashboard: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    """(panel title, refId, PromQL) of every Prometheus query in the dashboard."""
    return [(p.get("title", ""), t.get("refId", ""), t["expr"])
            for p in panels(dashboard) for t in targets(p) if t.get("expr")]


def variables(dashboard: Mapping[str, Any]) -> list[dict[str, Any]]:
    return list(dashboard.get("templating", {}).get("list", []))


def substitute(expr: str, values: Mapping[str, str]) -> str:
    """Replace ``$name`` / ``${name}`` / ``${name:fmt}`` with ``values[name]`` (or a global sample)."""
    def repl(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        if name in values:
            return values[name]
        if name in GLOBAL_SAMPLES:
            return GLOBAL_SAMPLES[name]
        raise KeyError(f"unknown variable ${name} in {expr!r}")

    return re.sub(r"\$\{([\w.]+)(?::\w+)?\}|\$(\w+)", repl, expr)


# --- PromQL structure (enough for the queries dashboards contain) ------------------------------------

_SELECTOR = re.compile(r"([A-Za-z_:][\w:]*)?\{([^{}]*)\}")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"' + r"|'(?:[^'\\]|\\.)*'")
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_IDENT = re.compile(r"[A-Za-z_:][\w:]*")


def selectors(expr: str) -> list[tuple[str, str, int, int]]:
    """(metric name, matcher text, start, end) of every ``name{...}`` selector in ``expr``."""
    return [(m.group(1) or "", m.group(2), m.start(), m.end()) for m in _SELECTOR.finditer(expr)]


def bare_selectors(expr: str) -> list[str]:
    """Metric names used without a ``{...}`` block (they cannot carry the required matchers)."""
    text = _SELECTOR.sub(" __sel__ ", expr)
    text = _STRING.sub(" ", text)
    text = _GROUPING.sub(" ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    out = []
    for m in _IDENT.finditer(text):
        name = m.group(0)
        rest = text[m.end():].lstrip()
        if name == "__sel__" or name.lower() in PROMQL_KEYWORDS or rest.startswith("("):
            continue
        if m.start() and (text[m.start() - 1].isdigit() or text[m.start() - 1] == "."):
            continue
        out.append(name)
    return out


def _has_matcher(matchers: str, label: str, value: str) -> bool:
    pattern = rf'(^|,)\s*{re.escape(label)}\s*=~\s*"{re.escape(value)}"\s*(,|$)'
    return re.search(pattern, matchers) is not None


def _enclosing_call(expr: str, start: int) -> str | None:
    m = re.search(r"([A-Za-z_]\w*)\s*\(\s*$", expr[:start])
    return m.group(1) if m else None


def _range_after(expr: str, end: int) -> str | None:
    m = re.match(r"\s*\[([^\]]+)\]", expr[end:])
    return m.group(1).strip() if m else None


# --- rules ---------------------------------------------------------------------------------------

def _datasource_vars(dashboard: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [v for v in variables(dashboard) if v.get("type") == "datasource"]


def _rule_template_datasource(d: Mapping[str, Any]) -> Iterator[Problem]:
    ds_vars = _datasource_vars(d)
    if not ds_vars:
        yield Problem("template-datasource-rule", "dashboard", "has no templated data source variable")
    for v in ds_vars:
        kind = str(v.get("query", ""))
        allowed = {f"{kind.lower()}_datasource"} | ({"datasource"} if len(ds_vars) == 1 else set())
        if v.get("name") not in allowed:
            yield Problem("template-datasource-rule", f"variable {v.get('name')}",
                          f"a {kind} data source variable should be named one of {sorted(allowed)}")
        labels = {f"{kind.capitalize()} data source"} | ({"Data source"} if len(ds_vars) == 1 else set())
        if v.get("label") not in labels:
            yield Problem("template-datasource-rule", f"variable {v.get('name')}",
                          f"should be labelled one of {sorted(labels)}")


def _prometheus_var_uids(d: Mapping[str, Any]) -> set[str]:
    names = [v["name"] for v in _datasource_vars(d) if v.get("query") == "prometheus"]
    return {f"${n}" for n in names} | {f"${{{n}}}" for n in names}


def _rule_template_job_instance(d: Mapping[str, Any]) -> Iterator[Problem]:
    prom_uids = _prometheus_var_uids(d)
    by_name = {v.get("name"): v for v in variables(d)}
    for name in ("job", "instance"):
        rule = f"template-{name}-rule"
        v = by_name.get(name)
        if v is None:
            yield Problem(rule, "dashboard", f"is missing the {name} variable")
            continue
        if (v.get("datasource") or {}).get("uid") not in prom_uids:
            yield Problem(rule, f"variable {name}", "should use the templated Prometheus data source")
        if v.get("type") != "query":
            yield Problem(rule, f"variable {name}", "should be a Prometheus query variable")
        if not v.get("multi"):
            yield Problem(rule, f"variable {name}", "should be a multi select")
        if v.get("allValue") != ".+":
            yield Problem(rule, f"variable {name}", "allValue should be '.+'")
        if v.get("label") != name.capitalize():
            yield Problem(rule, f"variable {name}", f"should be labelled {name.capitalize()!r}")


def _rule_template_queries(d: Mapping[str, Any]) -> Iterator[Problem]:
    for v in variables(d):
        if v.get("type") != "query":
            continue
        query = v.get("query")
        query = query.get("query", "") if isinstance(query, dict) else str(query or "")
        m = re.fullmatch(r"\s*([a-z_]+)\((.*)\)\s*", query, flags=re.S)
        if m is None or m.group(1) not in VARIABLE_FUNCTIONS:
            yield Problem("template-label-promql-rule", f"variable {v.get('name')}",
                          f"query {query!r} is not one of {', '.join(VARIABLE_FUNCTIONS)}(...)")
        if v.get("refresh") != 2:
            yield Problem("template-on-time-change-reload-rule", f"variable {v.get('name')}",
                          "should refresh on time range change (refresh: 2)")


def _rule_panel(d: Mapping[str, Any]) -> Iterator[Problem]:
    names = [v["name"] for v in _datasource_vars(d)]
    ds_uids = {f"${n}" for n in names} | {f"${{{n}}}" for n in names}
    for p in panels(d):
        where = f"panel {p.get('title')!r}"
        if not p.get("title") or not p.get("description"):
            yield Problem("panel-title-description-rule", where, "needs a title and a description")
        ts = targets(p)
        if p.get("type") in ("text", "news", "dashlist"):
            continue
        if not ts:
            yield Problem("panel-no-targets-rule", where, "has no queries")
            continue
        if (p.get("datasource") or {}).get("uid") not in ds_uids:
            yield Problem("panel-datasource-rule", where, "does not use a templated data source")
        for t in ts:
            if (t.get("datasource") or {}).get("uid") not in ds_uids:
                yield Problem("panel-datasource-rule", f"{where} query {t.get('refId')}",
                              "does not use a templated data source")
        unit = ((p.get("fieldConfig") or {}).get("defaults") or {}).get("unit")
        if unit not in VALID_UNITS:
            yield Problem("panel-units-rule", where, f"has no or an unknown unit: {unit!r}")


def _rule_targets(d: Mapping[str, Any]) -> Iterator[Problem]:
    for title, ref, expr in expressions(d):
        where = f"panel {title!r} query {ref}"
        for name in bare_selectors(expr):
            yield Problem("target-job-rule", where, f"selector {name} has no {{...}} for matchers")
        for name, matchers, start, end in selectors(expr):
            for label in ("job", "instance"):
                if not _has_matcher(matchers, label, f"${label}"):
                    yield Problem(f"target-{label}-rule", where,
                                  f'selector {name}{{{matchers}}} lacks {label}=~"${label}"')
            call = _enclosing_call(expr, start)
            window = _range_after(expr, end)
            if call in RATE_FUNCTIONS and window != RATE_INTERVAL:
                yield Problem("target-rate-interval-rule", where,
                              f"{call}() over [{window}], not [{RATE_INTERVAL}]")
            if name.endswith("_total") and (call not in COUNTER_FUNCTIONS or window is None):
                yield Problem("target-counter-agg-rule", where,
                              f"counter {name} is not inside rate(), irate() or increase()")


def _rule_link_variables(d: Mapping[str, Any]) -> Iterator[Problem]:
    """Links may only use variables the dashboard defines (or Grafana's ``__`` built-ins)."""
    names = {v.get("name") for v in variables(d)}
    links: list[tuple[str, dict[str, Any]]] = [("dashboard link", link) for link in d.get("links", [])]
    for p in panels(d):
        for link in ((p.get("fieldConfig") or {}).get("defaults") or {}).get("links", []) or []:
            links.append((f"panel {p.get('title')!r} data link", link))
    for where, link in links:
        for m in re.finditer(r"\$\{([\w.]+)(?::\w+)?\}", link.get("url", "")):
            name = m.group(1)
            if not name.startswith("__") and name not in names:
                yield Problem("link-variables-rule", where, f"uses undefined variable ${{{name}}}")


RULES = (_rule_template_datasource, _rule_template_job_instance, _rule_template_queries, _rule_panel,
         _rule_targets, _rule_link_variables)


def lint(dashboard: Mapping[str, Any], exclusions: Exclusions | None = None) -> list[Problem]:
    """Every problem of ``dashboard`` not excused by ``exclusions``."""
    excused = exclusions or {}
    out = []
    for rule in RULES:
        for problem in rule(dashboard):
            titles = excused.get(problem.rule, {})
            if any(problem.where.startswith(f"panel {t!r}") for t in titles):
                continue
            out.append(problem)
    return out


# --- PromQL parsing through promtool -------------------------------------------------------------

def promql_parse_errors(exprs: Iterable[str], promtool: str = "promtool") -> str:
    """Parse every expression with Prometheus' own parser (``promtool check rules`` on recording rules).

    Returns promtool's complaint, or ``""`` when every expression parses. The expressions must already
    have their dashboard variables substituted (:func:`substitute`).
    """
    rules = [{"record": f"hs_tracer_lint:expr_{i}", "expr": e} for i, e in enumerate(exprs)]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "exprs.rules.yml"
        path.write_text(yaml.safe_dump({"groups": [{"name": "lint", "rules": rules}]}))
        proc = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True)
    return "" if proc.returncode == 0 else (proc.stdout + proc.stderr).strip()

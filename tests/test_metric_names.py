"""Metric names have one home, the exporter: its live registry is what docs/metrics.md documents
(name, type, labels), and the dashboards and alert rules name nothing else."""

from __future__ import annotations

import re
from pathlib import Path

from hs_tracer import dashboards
from hs_tracer.export import prometheus
from hs_tracer.export.prometheus import BASE_LABELS, PrometheusExporter
from hs_tracer.records import Ranks

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs/metrics.md").read_text()
SUFFIXES = {"counter": "_total", "gauge": "", "histogram": ""}
# A metric table row: | `name{labels}` | type | ...
ROW = re.compile(r"^\| `(hs_tracer_[a-z_]+)(?:\{([a-z_,]*)\})?` \| (counter|gauge|histogram) \|", re.M)


def _registry_metrics() -> dict[str, tuple[str, tuple[str, ...]]]:
    """Documented name -> (type, labels beyond the base labels), read from a live exporter."""
    exporter = PrometheusExporter("m", Ranks(), serve=False)
    try:
        out = {}
        for collector in exporter.registry._collector_to_names:  # every metric object registered
            family = next(iter(collector.describe()))
            labels = tuple(n for n in collector._labelnames if n not in BASE_LABELS)
            out[family.name + SUFFIXES[family.type]] = (family.type, labels)
        return out
    finally:
        exporter.close()


def test_every_registered_metric_is_documented_with_its_type_and_labels() -> None:
    live = _registry_metrics()
    documented = {name: (kind, tuple(labels.split(",")) if labels else ())
                  for name, labels, kind in ROW.findall(DOC)}
    # The wiring info metric is documented as a paragraph with a label table of its own.
    kind, labels = live.pop(prometheus.WIRING_INFO)
    assert f"`{prometheus.WIRING_INFO}` ({kind}" in DOC
    assert all(f"`{label}`" in DOC for label in labels)
    assert documented == live


def test_exporter_name_constants_are_the_registered_names() -> None:
    constants = {v for k, v in vars(prometheus).items()
                 if k.isupper() and isinstance(v, str) and v.startswith("hs_tracer_")}
    live = {re.sub(r"_total$", "", name) for name in _registry_metrics()}
    assert constants == live


def test_dashboards_and_alerts_name_only_registered_metrics() -> None:
    live = {re.sub(r"_total$", "", name) for name in _registry_metrics()}
    queries = {**dashboards.dashboard_queries(), **dashboards.alert_queries()}
    used = {re.sub(r"_(total|bucket|sum|count)$", "", m)
            for expr in queries.values() for m in re.findall(r"\bhs_tracer_[a-z_]+", expr)}
    assert used and used <= live, used - live

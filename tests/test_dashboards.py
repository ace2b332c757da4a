"""The Grafana dashboard as code: the committed files are exactly what the code renders, the
dashboard passes the dashboard-linter rules (and the lint really catches each violation), every query
parses with Prometheus' own parser, it shows what an operator needs, links to the step traces, and
``hs-tracer dashboards build|push`` behave."""

from __future__ import annotations

import copy
import json
import re
import shutil
import threading
import urllib.parse
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

import hs_tracer.dashboards as dashboards
from hs_tracer.cli import main
from hs_tracer.dashboards import lint, overview
from hs_tracer.export.otel import SPAN_NAME
from tests.infra.prom import ensure_prometheus

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / dashboards.DASHBOARD_DIR / overview.FILENAME


def _dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


# --- generated files ------------------------------------------------------------------------------

def test_committed_files_are_what_the_code_renders() -> None:
    assert dashboards.stale(ROOT) == [], "run `hs-tracer dashboards build` and commit the result"


def test_build_command_reproduces_the_committed_files_byte_for_byte(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["dashboards", "build", "--root", str(tmp_path)]) == 0
    for rel in dashboards.generated_files():
        assert (tmp_path / rel).read_bytes() == (ROOT / rel).read_bytes(), rel
    assert main(["dashboards", "build", "--root", str(tmp_path), "--check"]) == 0
    (tmp_path / dashboards.RULES_FILE).write_text("groups: []\n")
    assert main(["dashboards", "build", "--root", str(tmp_path), "--check"]) == 1
    assert f"stale: {dashboards.RULES_FILE}" in capsys.readouterr().err


def test_build_outside_a_checkout_writes_nothing_without_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["dashboards", "build"]) == 2
    assert "--root" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_rendering_is_deterministic() -> None:
    assert overview.render() == overview.render()
    ids = [p["id"] for p in _dashboard()["panels"]]
    assert ids == list(range(1, len(ids) + 1))


# --- lint ------------------------------------------------------------------------------------------

def test_dashboard_passes_the_lint() -> None:
    problems = lint.lint(_dashboard(), lint.OVERVIEW_EXCLUSIONS)
    assert problems == [], "\n".join(map(str, problems))


def test_every_exclusion_is_needed() -> None:
    """An exclusion that excuses nothing is stale and must go (dashboard-linter's .lint discipline)."""
    raw = lint.lint(_dashboard())
    for rule, titles in lint.OVERVIEW_EXCLUSIONS.items():
        for title in titles:
            assert any(p.rule == rule and p.where.startswith(f"panel {title!r}") for p in raw), (rule, title)


def _first(d: dict[str, Any], kind: str) -> dict[str, Any]:
    return next(p for p in lint.panels(d) if p["type"] == kind)


def _var(d: dict[str, Any], name: str) -> dict[str, Any]:
    return next(v for v in lint.variables(d) if v["name"] == name)


def _mut_description(d: dict[str, Any]) -> None:
    _first(d, "timeseries")["description"] = ""


def _mut_unit(d: dict[str, Any]) -> None:
    del _first(d, "heatmap")["fieldConfig"]["defaults"]["unit"]


def _mut_bad_unit(d: dict[str, Any]) -> None:
    _first(d, "stat")["fieldConfig"]["defaults"]["unit"] = "tokens"


def _mut_datasource(d: dict[str, Any]) -> None:
    _first(d, "table")["datasource"] = {"type": "prometheus", "uid": "ddyfngn31dg5cf"}


def _mut_target_datasource(d: dict[str, Any]) -> None:
    _first(d, "timeseries")["targets"][0]["datasource"] = {"type": "prometheus", "uid": "prometheus"}


def _mut_rate_window(d: dict[str, Any]) -> None:
    t = _first(d, "timeseries")["targets"][0]
    t["expr"] = t["expr"].replace("[$__rate_interval]", "[5m]", 1)


def _mut_job_matcher(d: dict[str, Any]) -> None:
    t = _first(d, "timeseries")["targets"][0]
    t["expr"] = t["expr"].replace('job=~"$job", ', "", 1)


def _mut_bare_selector(d: dict[str, Any]) -> None:
    _first(d, "timeseries")["targets"][0]["expr"] = "max(hs_tracer_enabled)"


def _mut_counter(d: dict[str, Any]) -> None:
    _first(d, "timeseries")["targets"][0]["expr"] = \
        'sum(hs_tracer_drafts_total{job=~"$job", instance=~"$instance"})'


def _mut_no_job_var(d: dict[str, Any]) -> None:
    d["templating"]["list"] = [v for v in lint.variables(d) if v["name"] != "job"]


def _mut_single_select(d: dict[str, Any]) -> None:
    _var(d, "instance")["multi"] = False


def _mut_refresh(d: dict[str, Any]) -> None:
    _var(d, "model")["refresh"] = 1


def _mut_var_query(d: dict[str, Any]) -> None:
    _var(d, "model")["query"] = "hs_tracer_enabled"


def _mut_ds_var_name(d: dict[str, Any]) -> None:
    _var(d, overview.PROM_VAR)["name"] = "ds"


def _mut_no_ds_vars(d: dict[str, Any]) -> None:
    d["templating"]["list"] = [v for v in lint.variables(d) if v["type"] != "datasource"]


def _mut_link_variable(d: dict[str, Any]) -> None:
    d["links"][0]["url"] = d["links"][0]["url"].replace(overview.TRACES_VAR, "jaeger_datasource")


MUTATIONS: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "no description": (_mut_description, "panel-title-description-rule"),
    "no unit": (_mut_unit, "panel-units-rule"),
    "unknown unit": (_mut_bad_unit, "panel-units-rule"),
    "hard-coded panel datasource": (_mut_datasource, "panel-datasource-rule"),
    "hard-coded query datasource": (_mut_target_datasource, "panel-datasource-rule"),
    "fixed rate window": (_mut_rate_window, "target-rate-interval-rule"),
    "missing job matcher": (_mut_job_matcher, "target-job-rule"),
    "selector without matchers": (_mut_bare_selector, "target-job-rule"),
    "raw counter": (_mut_counter, "target-counter-agg-rule"),
    "no job variable": (_mut_no_job_var, "template-job-rule"),
    "single-select instance": (_mut_single_select, "template-instance-rule"),
    "variable not refreshed on time change": (_mut_refresh, "template-on-time-change-reload-rule"),
    "variable query not label_values": (_mut_var_query, "template-label-promql-rule"),
    "datasource variable misnamed": (_mut_ds_var_name, "template-datasource-rule"),
    "no datasource variable": (_mut_no_ds_vars, "template-datasource-rule"),
    "link to an undefined variable": (_mut_link_variable, "link-variables-rule"),
}


@pytest.mark.parametrize("case", sorted(MUTATIONS))
def test_lint_catches(case: str) -> None:
    mutate, rule = MUTATIONS[case]
    d = copy.deepcopy(_dashboard())
    mutate(d)
    rules = {p.rule for p in lint.lint(d, lint.OVERVIEW_EXCLUSIONS)}
    assert rule in rules, f"{case}: expected {rule}, got {sorted(rules)}"


# --- PromQL ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def promtool() -> str:
    ensure_prometheus()
    path = shutil.which("promtool")
    assert path
    return path


def test_every_query_parses(promtool: str) -> None:
    d = _dashboard()
    values = {"job": ".+", "instance": ".+", "model": ".+"}
    exprs = [lint.substitute(e, values) for _t, _r, e in lint.expressions(d)]
    for v in lint.variables(d):
        if v["type"] == "query":  # label_values(SELECTOR, label): the selector must parse
            exprs.append(lint.substitute(v["query"][len("label_values("):].rsplit(",", 1)[0], values))
    assert len(exprs) > 30
    assert lint.promql_parse_errors(exprs, promtool) == ""


def test_parse_check_rejects_broken_promql(promtool: str) -> None:
    errors = lint.promql_parse_errors(["sum by (model) (rate(hs_tracer_drafts_total[5m])"], promtool)
    assert "parse error" in errors


# --- content --------------------------------------------------------------------------------------

def _exprs(d: dict[str, Any]) -> str:
    return "\n".join(e for _t, _r, e in lint.expressions(d))


def test_dashboard_shows_what_issue_8_asks_for() -> None:
    d = _dashboard()
    titles = {p["title"] for p in lint.panels(d)}
    for title in ("Acceptance rate per model and rank", "Mean accept length per model and rank",
                  "Per-position acceptance", "Accept-length distribution",
                  "Slot sources: expected vs observed",
                  "Slot feature drift", "Wiring read at startup", "Findings since the tracer started",
                  "Tracer enabled", "Host overhead per verify step"):
        assert title in titles
    by_title = {p["title"]: p for p in lint.panels(d)}
    per_rank = by_title["Acceptance rate per model and rank"]["targets"][0]["expr"]
    for label in ("model", "tp_rank", "pp_rank", "dp_rank"):
        assert label in per_rank.split("/")[0]
    assert 'position' in by_title["Per-position acceptance"]["targets"][0]["expr"]
    heat = by_title["Accept-length distribution"]
    assert heat["type"] == "heatmap" and heat["targets"][0]["format"] == "heatmap"
    slots = by_title["Slot sources: expected vs observed"]
    assert slots["type"] == "table" and {t["refId"] for t in slots["targets"]} == {"A", "B"}
    exprs = _exprs(d)
    for metric in ("hs_tracer_accepted_tokens_total", "hs_tracer_draft_tokens_total",
                   "hs_tracer_drafts_total",
                   "hs_tracer_accepted_tokens_per_position_total", "hs_tracer_accept_length_bucket",
                   "hs_tracer_slot_match_score", "hs_tracer_slot_mismatch", "hs_tracer_slot_drift_score",
                   "hs_tracer_wiring_info", "hs_tracer_findings_total", "hs_tracer_enabled",
                   "hs_tracer_records_dropped_total", "hs_tracer_hook_errors_total",
                   "hs_tracer_spans_dropped_total", "hs_tracer_host_overhead_seconds_bucket"):
        assert metric in exprs, metric


def test_dashboard_uses_only_documented_metrics() -> None:
    doc = (ROOT / "docs/metrics.md").read_text()
    used = set(re.findall(r"\bhs_tracer_[a-z_]+", _exprs(_dashboard())))
    undocumented = {m for m in used
                    if f"`{m}" not in doc and f"`{re.sub(r'_(bucket|sum|count)$', '', m)}`" not in doc}
    assert used and not undocumented


def _explore_panes(url: str) -> dict[str, Any]:
    query = urllib.parse.urlparse(url).query
    panes = urllib.parse.parse_qs(query)["panes"][0]
    return json.loads(panes)


def test_trace_links_open_the_step_spans_in_the_templated_tempo_datasource() -> None:
    d = _dashboard()
    tempo = _var(d, overview.TRACES_VAR)
    assert tempo["type"] == "datasource" and tempo["query"] == "tempo"
    links = [link["url"] for link in d["links"]]
    links += [link["url"] for p in lint.panels(d)
              for link in p.get("fieldConfig", {}).get("defaults", {}).get("links", [])]
    assert len(links) >= 3  # the dashboard link and the two per-rank acceptance panels
    for url in links:
        panes = _explore_panes(url)
        [pane] = panes.values()
        assert pane["datasource"] == f"${{{overview.TRACES_VAR}}}"
        [query] = pane["queries"]
        assert query["queryType"] == "traceql"
        assert f'name = "{SPAN_NAME}"' in query["query"]  # the span hs_tracer.export.otel emits
    per_series = [u for u in links if "__field.labels.model" in u]
    assert per_series and all("span.hs_tracer.model" in _explore_panes(u)["traces"]["queries"][0]["query"]
                              for u in per_series)
    # every span attribute the links filter on is one hs_tracer's exporter sets
    import hs_tracer.export.otel as otel

    source = Path(otel.__file__).read_text()
    for url in per_series:
        for attr in re.findall(r"span\.([\w.]+)", _explore_panes(url)["traces"]["queries"][0]["query"]):
            assert f'"{attr}"' in source, attr


def test_configmap_and_prometheusrule_carry_the_generated_content() -> None:
    import yaml

    cm = yaml.safe_load((ROOT / dashboards.DASHBOARD_CONFIGMAP).read_text())
    assert cm["data"][overview.FILENAME] == DASHBOARD.read_text()
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    rule = yaml.safe_load((ROOT / dashboards.PROMETHEUS_RULE).read_text())
    rules_file = yaml.safe_load((ROOT / dashboards.RULES_FILE).read_text())
    assert rule["kind"] == "PrometheusRule" and rule["spec"]["groups"] == rules_file["groups"]


# --- push -----------------------------------------------------------------------------------------

def test_push_without_token_is_a_usage_error(monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("GRAFANA_TOKEN", raising=False)
    assert main(["dashboards", "push", "--url", "http://127.0.0.1:9"]) == 2
    err = capsys.readouterr().err
    assert "GRAFANA_TOKEN" in err and "service-account token" in err


def test_push_without_grafana_client_names_the_package(monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "grafana_client"
                        else real(name, *a))
    monkeypatch.setenv("GRAFANA_TOKEN", "t")
    assert main(["dashboards", "push", "--url", "http://127.0.0.1:9"]) == 2
    assert "grafana-client is not installed" in capsys.readouterr().err


class _GrafanaApi:
    """Grafana's HTTP API for folders and dashboards, as far as `push` uses it (the endpoints and
    payloads of Grafana's documented API); records what it received."""

    def __init__(self, token: str) -> None:
        self.token = token
        self.folders: dict[str, str] = {}
        self.dashboards: list[dict[str, Any]] = []
        self.auth: list[str] = []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        api = self

        class Handler(BaseHTTPRequestHandler):
            def _reply(self, status: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _authorised(self) -> bool:
                api.auth.append(self.headers.get("Authorization", ""))
                if self.headers.get("Authorization") != f"Bearer {api.token}":
                    self._reply(401, {"message": "invalid API key"})
                    return False
                return True

            def do_GET(self) -> None:
                if not self._authorised():
                    return
                uid = self.path.rsplit("/", 1)[-1]
                if self.path.startswith("/api/folders/") and uid in api.folders:
                    self._reply(200, {"uid": uid, "title": api.folders[uid]})
                else:
                    self._reply(404, {"message": "folder not found"})

            def do_POST(self) -> None:
                if not self._authorised():
                    return
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path == "/api/folders":
                    api.folders[body["uid"]] = body["title"]
                    self._reply(200, {"uid": body["uid"], "title": body["title"]})
                elif self.path == "/api/dashboards/db":
                    api.dashboards.append(body)
                    uid = body["dashboard"]["uid"]
                    self._reply(200, {"uid": uid, "url": f"/d/{uid}/x", "version": len(api.dashboards),
                                      "status": "success"})
                else:
                    self._reply(404, {"message": "not found"})

            def log_message(self, format: str, *args: Any) -> None:
                pass

        return Handler


@pytest.fixture
def grafana_api() -> Iterator[_GrafanaApi]:
    api = _GrafanaApi(token="glsa_test_token")
    thread = threading.Thread(target=api.server.serve_forever, daemon=True)
    thread.start()
    yield api
    api.server.shutdown()
    api.server.server_close()


def test_push_uploads_through_grafana_client(grafana_api: _GrafanaApi, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("GRAFANA_TOKEN", grafana_api.token)
    assert main(["dashboards", "push", "--url", grafana_api.url]) == 0
    assert main(["dashboards", "push", "--url", grafana_api.url]) == 0  # second push: folder exists
    assert set(grafana_api.auth) == {f"Bearer {grafana_api.token}"}
    assert grafana_api.folders == {"hs-tracer": "hs_tracer"}
    assert len(grafana_api.dashboards) == 2
    sent = grafana_api.dashboards[0]
    assert sent["folderUid"] == "hs-tracer" and sent["overwrite"] is True
    assert sent["dashboard"] == _dashboard()
    assert f"{grafana_api.url}/d/{overview.UID}/x" in capsys.readouterr().out


def test_push_with_a_rejected_token_says_so(grafana_api: _GrafanaApi, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("GRAFANA_TOKEN", "wrong")
    assert main(["dashboards", "push", "--url", grafana_api.url]) == 1
    assert "rejected the token" in capsys.readouterr().err
    assert grafana_api.dashboards == []


def test_per_rank_grouping_is_the_exporters_label_set() -> None:
    """Every label a live exporter puts on its series, beyond the model and the metric's own
    labels, is in PER_RANK: two schedulers that differ only in a rank never merge on a panel."""
    from hs_tracer.dashboards import promql
    from hs_tracer.export.prometheus import PrometheusExporter
    from hs_tracer.records import Ranks

    exporter = PrometheusExporter("m", Ranks(tp=1, pp=0, dp=1, attn_dp=1), serve=False)
    try:
        labels = {name for family in exporter.registry.collect() for sample in family.samples
                  for name in sample.labels if name.endswith("_rank")}
    finally:
        exporter.close()
    assert labels == {"tp_rank", "pp_rank", "dp_rank", "attn_dp_rank"}
    assert labels <= set(promql.PER_RANK.split(", "))


def test_engine_metric_names_are_the_installed_sglang_ones() -> None:
    """The serving row and the presence alert read SGLang's own series: each name must be one the
    installed SGLang defines (its metrics collector's source), with the type the queries assume."""
    import importlib.util

    from hs_tracer.dashboards import engine_metrics as em

    spec = importlib.util.find_spec("sglang.srt.observability.metrics_collector")
    assert spec is not None and spec.origin
    source = Path(spec.origin).read_text()
    for name in em.SGLANG_METRICS:
        assert f'name="{name}"' in source, name
    for name, kind in ((em.SGLANG_GENERATION_TOKENS, "Counter"), (em.SGLANG_GEN_THROUGHPUT, "Gauge"),
                       (em.SGLANG_ITL, "Histogram"), (em.SGLANG_TTFT, "Histogram"),
                       (em.SGLANG_RUNNING_REQS, "Gauge")):
        at = source.index(f'name="{name}"')
        assert source[:at].rstrip().rsplit("=", 1)[-1].strip().startswith(f"{kind}("), name


def test_dashboard_shows_serving_expectation_and_restarts() -> None:
    """Beside acceptance: SGLang's throughput and latency (is speculation paying off?), the accept
    length the profile expects, and a restart/redeploy annotation."""
    d = _dashboard()
    by_title = {p["title"]: p for p in lint.panels(d)}
    for title, needle in (("Generation throughput", "generation_tokens"),
                          ("Inter-token latency", "inter_token_latency_seconds_bucket"),
                          ("Time to first token", "time_to_first_token_seconds_bucket")):
        exprs = " ".join(t["expr"] for t in by_title[title]["targets"])
        assert needle in exprs and 'sglang[:_]' in exprs, title
    accept = by_title["Mean accept length per model and rank"]["targets"]
    assert [t["refId"] for t in accept] == ["A", "B"]
    assert "hs_tracer_expected_accept_length" in accept[1]["expr"]
    [restarts] = d["annotations"]["list"]
    assert "hs_tracer_start_time_seconds" in restarts["expr"] and restarts["enable"] is True

"""The hs_tracer Grafana dashboard, as code (grafana-foundation-sdk builders).

One dashboard, six rows: acceptance (with the accept length the profile expects), SGLang's own
throughput and latency, draft-input features per slot, wiring, findings, tracer health; restarts
and redeploys are annotations. It follows dashboard-linter's conventions (checked by
:mod:`hs_tracer.dashboards.lint`): templated data sources, ``job``/``instance`` variables on every
query, ``$__rate_interval`` in every ``rate()``, a unit and a description on every panel. Sampled
``hs_tracer.verify_step`` spans are one click away: a dashboard link and data links on the
acceptance panels open them in Explore on the templated Tempo data source.
"""

from __future__ import annotations

import json
import urllib.parse
from typing import Any

from grafana_foundation_sdk.builders import common as common_b
from grafana_foundation_sdk.builders import dashboard as dash_b
from grafana_foundation_sdk.builders import heatmap, stat, table, timeseries
from grafana_foundation_sdk.builders import prometheus as prom_b
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as common_m
from grafana_foundation_sdk.models import dashboard as dash_m
from grafana_foundation_sdk.models import prometheus as prom_m

from hs_tracer.dashboards import engine_metrics as em
from hs_tracer.dashboards import promql as q
from hs_tracer.export import prometheus as m

UID = "hs-tracer-overview"
FILENAME = "hs-tracer-overview.json"
PROM_VAR = "prometheus_datasource"
TRACES_VAR = "tempo_datasource"
SPAN_NAME = "hs_tracer.verify_step"  # hs_tracer.export.otel.SPAN_NAME (not imported: no OTel import here)

RESTART_MARK_S = 120
"""A (re)start or redeploy is marked for this long after a scheduler process began exporting."""

PROM = dash_m.DataSourceRef(type_val="prometheus", uid=f"${{{PROM_VAR}}}")
ACCEPT_LEGEND = "{{model}} {{instance}} tp{{tp_rank}} pp{{pp_rank}} dp{{dp_rank}}"
SLOT_LEGEND = "{{model}} {{instance}} pp{{pp_rank}} dp{{dp_rank}} slot {{slot}}"


# --- small builders -------------------------------------------------------------------------------

def _target(expr: str, legend: str = "", ref: str = "A", *, instant: bool = False,
            fmt: prom_m.PromQueryFormat | None = None) -> prom_b.Dataquery:
    t = prom_b.Dataquery().expr(expr).ref_id(ref).datasource(PROM)
    t = t.instant() if instant else t.range()
    if legend:
        t = t.legend_format(legend)
    if fmt is not None:
        t = t.format(fmt)
    return t


def _thresholds(*steps: tuple[float | None, str]) -> dash_b.ThresholdsConfig:
    return (dash_b.ThresholdsConfig().mode(dash_m.ThresholdsMode.ABSOLUTE)
            .steps([dash_m.Threshold(value=v, color=c) for v, c in steps]))


def _explore_traces_url(traceql: str) -> str:
    """Grafana Explore on the templated Tempo data source, running ``traceql`` over the shown range.

    The URL is percent-encoded except for Grafana's ``${...}`` variables, which Grafana
    interpolates before opening the link (values inserted with ``:percentencode``).
    """
    panes = {"traces": {
        "datasource": f"${{{TRACES_VAR}}}",
        "queries": [{"refId": "A", "datasource": {"type": "tempo", "uid": f"${{{TRACES_VAR}}}"},
                     "queryType": "traceql", "query": traceql, "limit": 20}],
        "range": {"from": "${__from}", "to": "${__to}"},
    }}
    encoded = urllib.parse.quote(json.dumps(panes, separators=(",", ":")), safe="${}:._")
    return f"/explore?schemaVersion=1&panes={encoded}"


def _step_traces_link(title: str = "Sampled verify-step traces of this series") -> dash_b.DashboardLink:
    traceql = (f'{{ name = "{SPAN_NAME}" && span.hs_tracer.model = "${{__field.labels.model:percentencode}}"'
               ' && span.hs_tracer.pp_rank = ${__field.labels.pp_rank} }')
    return dash_b.DashboardLink(title).url(_explore_traces_url(traceql)).target_blank(True)


def _timeseries(title: str, description: str, unit: str, targets: list[prom_b.Dataquery], *,
                span: int = 12, height: int = 8, min_val: float | None = None,
                max_val: float | None = None, step: bool = False,
                trace_links: bool = False) -> timeseries.Panel:
    p = (timeseries.Panel().title(title).description(description).datasource(PROM).unit(unit)
         .span(span).height(height)
         .legend(common_b.VizLegendOptions().display_mode(common_m.LegendDisplayMode.TABLE)
                 .placement(common_m.LegendPlacement.BOTTOM).show_legend(True).calcs(["lastNotNull"])))
    for t in targets:
        p = p.with_target(t)
    if min_val is not None:
        p = p.min(min_val)
    if max_val is not None:
        p = p.max(max_val)
    if step:
        p = p.line_interpolation(common_m.LineInterpolation.STEP_AFTER)
    if trace_links:
        p = p.data_links([_step_traces_link()])
    return p


def _stat(title: str, description: str, unit: str, expr: str, thresholds: dash_b.ThresholdsConfig,
          *, decimals: int = 2) -> stat.Panel:
    return (stat.Panel().title(title).description(description).datasource(PROM).unit(unit)
            .decimals(decimals).span(6).height(4).with_target(_target(expr))
            .thresholds(thresholds).color_mode(common_m.BigValueColorMode.BACKGROUND)
            .graph_mode(common_m.BigValueGraphMode.AREA)
            .reduce_options(common_b.ReduceDataOptions().calcs(["lastNotNull"]).values(False)))


def _table() -> table.Panel:
    return table.Panel().show_header(True).cell_height(common_m.TableCellHeight.SM)


def _organize(exclude: list[str], rename: dict[str, str]) -> dash_m.DataTransformerConfig:
    return dash_m.DataTransformerConfig(id_val="organize", options={
        "excludeByName": {name: True for name in exclude}, "renameByName": rename})


def _labels_table(title: str, description: str, expr: str, *, span: int, height: int,
                  exclude: list[str]) -> table.Panel:
    """One row per series of an info-style metric (value 1), its labels as the columns."""
    return (_table().title(title).description(description).datasource(PROM).unit("none")
            .span(span).height(height)
            .with_target(_target(expr, instant=True, fmt=prom_m.PromQueryFormat.TABLE))
            .with_transformation(_organize(["Time", "Value", "__name__", "job", *exclude], {})))


def _two_states(zero: tuple[str, str], one: tuple[str, str]) -> list[dash_m.DynamicConfigValue]:
    """A 0/1 column shown as two coloured words, ``(text, colour)`` for each value."""
    return [
        dash_m.DynamicConfigValue(id_val="mappings", value=[
            {"type": "value", "options": {
                "0": {"text": zero[0], "color": zero[1], "index": 0},
                "1": {"text": one[0], "color": one[1], "index": 1}}}]),
        dash_m.DynamicConfigValue(id_val="custom.cellOptions", value={"type": "color-background"}),
    ]


# --- rows ------------------------------------------------------------------------------------------

def _acceptance_row(d: dash_b.Dashboard) -> dash_b.Dashboard:
    d = d.with_row(dash_b.Row("Acceptance"))
    all_sel = "model"
    d = d.with_panel(_stat(
        "Mean accept length", "Tokens produced per request per verify pass, the bonus token included, "
        "over the selection (1 + accepted draft tokens / request-steps). Near 1.0 the draft is useless: "
        "the signature of a miswired draft (runbook: HsTracerAcceptLengthNearOne).", "none",
        q.mean_accept_length(all_sel),
        _thresholds((None, "red"), (1.25, "orange"), (1.6, "green"))))
    d = d.with_panel(_stat(
        "Acceptance rate", "Accepted / proposed draft tokens over the selection.", "percentunit",
        q.acceptance_rate(all_sel), _thresholds((None, "red"), (0.1, "orange"), (0.3, "green"))))
    d = d.with_panel(_stat(
        "Full rejections", "Share of request-steps whose every draft token was rejected (accept length "
        "1). A correct draft rarely exceeds a few tens of percent; near 100% means miswired.",
        "percentunit", q.full_rejection_share(all_sel),
        _thresholds((None, "green"), (0.6, "orange"), (0.9, "red"))))
    d = d.with_panel(_stat(
        "Verify passes", "Batched verify passes per second seen by hs_tracer over the selection.", "ops",
        q.rate(q.total(m.VERIFY_STEPS), "model"), _thresholds((None, "blue"))))
    d = d.with_panel(_timeseries(
        "Acceptance rate per model and rank", "Accepted / proposed draft tokens, per scheduler process "
        "that traces (model, instance, ranks). Click a series for the sampled verify-step traces.",
        "percentunit", [_target(q.acceptance_rate(q.PER_RANK), ACCEPT_LEGEND)],
        min_val=0, max_val=1, trace_links=True))
    d = d.with_panel(_timeseries(
        "Mean accept length per model and rank", "Tokens per request per verify pass, bonus included "
        "(1 + accepted / drafts), per scheduler process, beside the accept length the draft reaches on "
        "its own training data at the served draft steps (from the reference profile; absent without "
        "one): a live line far below its expected line is a draft fed the wrong features or tokens. "
        "Click a series for the sampled traces.",
        "none", [_target(q.mean_accept_length(q.PER_RANK), ACCEPT_LEGEND),
                 _target(f"max by ({q.PER_RANK}) ({q.sel(m.EXPECTED_ACCEPT_LENGTH)})",
                         ACCEPT_LEGEND + " expected (training data)", "B")], min_val=1,
        trace_links=True))
    d = d.with_panel(_timeseries(
        "Per-position acceptance", "Share of request-steps whose draft position i (0-based) was "
        "accepted; non-increasing in i. A healthy draft falls off gradually; a miswired one is near 0 "
        "from position 0.", "percentunit",
        [_target(q.per_position_rate("model"), "{{model}} position {{position}}")],
        min_val=0, max_val=1))
    d = d.with_panel(_timeseries(
        "Accept-length quantiles", "p10 / p50 / p90 of the accept length per request-step (bonus "
        "included), from the accept-length histogram.", "none",
        [_target(f"histogram_quantile({qq}, {q.rate(q.bucket(m.ACCEPT_LENGTH), 'model, le')})",
                 f"{{{{model}}}} p{int(qq * 100)}", ref)
         for qq, ref in ((0.1, "A"), (0.5, "B"), (0.9, "C"))], min_val=1))
    d = d.with_panel(
        heatmap.Panel().title("Accept-length distribution")
        .description("Request-steps per second by accept-length bucket (bonus included). Mass in the "
                     "lowest bucket (1) means full rejections.")
        .datasource(PROM).unit("short").span(12).height(8)
        .with_target(_target(q.rate(q.bucket(m.ACCEPT_LENGTH), "le"), "{{le}}",
                             fmt=prom_m.PromQueryFormat.HEATMAP))
        .calculate(False).show_tooltip().show_legend()
        .y_axis(heatmap.YAxisConfig().unit("short").axis_label("accept length (tokens)"))
        .cell_values(heatmap.CellValues().unit("reqps")))
    d = d.with_panel(_timeseries(
        "Full rejections per model and rank", "Share of request-steps with accept length 1, per "
        "scheduler process.", "percentunit",
        [_target(q.full_rejection_share(q.PER_RANK), ACCEPT_LEGEND)], min_val=0, max_val=1))
    return d


def _slots_row(d: dash_b.Dashboard) -> dash_b.Dashboard:
    d = d.with_row(dash_b.Row("Draft input features per slot"))
    slot_table = (
        _table().title("Slot sources: expected vs observed")
        .description("Per slot of the draft input: the canonical source the draft was trained on "
                     "(expected_source), the source the live features match best (observed_source), "
                     "the match score (0..1) and whether they differ (a wiring mismatch).")
        .datasource(PROM).unit("none").decimals(3).span(24).height(8)
        .with_target(_target(f"{q.sel(m.SLOT_MATCH_SCORE)} >= 0", ref="A", instant=True,
                             fmt=prom_m.PromQueryFormat.TABLE))
        .with_target(_target(f"max by ({q.PER_RANK}, slot) ({q.sel(m.SLOT_MISMATCH)})",
                             ref="B", instant=True, fmt=prom_m.PromQueryFormat.TABLE))
        .with_transformation(dash_m.DataTransformerConfig(id_val="merge", options={}))
        .with_transformation(_organize(["Time", "__name__", "job"],
                                       {"Value #A": "match score", "Value #B": "mismatch"}))
        .override_by_name("mismatch", _two_states(("ok", "green"), ("MISMATCH", "red"))))
    d = d.with_panel(slot_table)
    d = d.with_panel(_timeseries(
        "Slot wiring mismatch", "1 while a slot's observed source differs from the source the draft "
        "was trained on (runbook: HsTracerSlotSourceMismatch).", "bool_yes_no",
        [_target(f"max by ({q.PER_RANK}, slot) ({q.sel(m.SLOT_MISMATCH)})", SLOT_LEGEND)],
        min_val=0, max_val=1, step=True))
    d = d.with_panel(_timeseries(
        "Slot match score", "Similarity (0..1) of each slot's live features to the reference profile "
        "of its best-matching source; the legend names observed and expected sources.", "none",
        [_target(f"{q.sel(m.SLOT_MATCH_SCORE)} >= 0",
                 SLOT_LEGEND + ": {{observed_source}} (trained on {{expected_source}})")],
        min_val=0, max_val=1))
    d = d.with_panel(_timeseries(
        "Slot feature drift", "Drift of each slot's per-channel statistics from the reference of its "
        "expected source over the last diagnosis window, in units of the calibrated match level (0 = "
        "identical; above 4 the diagnosis reports feature_drift; runbook: HsTracerFeatureDrift).", "none",
        [_target(f"max by ({q.PER_RANK}, slot) ({q.sel(m.SLOT_DRIFT_SCORE)})", SLOT_LEGEND)],
        min_val=0))
    d = d.with_panel(_timeseries(
        "Slot identification evidence", "How sure each slot's source is. Measured (same-token "
        "identity, the default): the relative error of the slot's rows against the source named "
        "(0 = equal) and against the nearest other candidate (what a whole layer adds). From the "
        "statistics alone: the score gap between the best and the second-best source (small = "
        "ambiguous). A series is absent until its evidence exists.", "none",
        [_target(f"max by ({q.PER_RANK}, slot) ({q.sel(m.SLOT_MEASURED_ERROR)})",
                 SLOT_LEGEND + " measured error", "A"),
         _target(f"max by ({q.PER_RANK}, slot) ({q.sel(m.SLOT_MEASURED_RUNNER_UP_ERROR)})",
                 SLOT_LEGEND + " nearest other's error", "B"),
         _target(f"max by ({q.PER_RANK}, slot) ({q.sel(m.SLOT_MATCH_MARGIN)})",
                 SLOT_LEGEND + " statistical margin", "C")], min_val=0))
    d = d.with_panel(_timeseries(
        "Slot RMS", "RMS of each slot's finite draft-input values in the last exported verify step "
        "(hidden-state scale). Slots fed the same layer show the same RMS.", "none",
        [_target(f"max by ({q.PER_RANK}, slot) ({q.sel(m.SLOT_RMS)})", SLOT_LEGEND)]))
    d = d.with_panel(_timeseries(
        "Non-finite draft-input values", "NaN/Inf values per second in each slot's draft input.", "cps",
        [_target(q.rate(q.total(m.SLOT_NONFINITE), f"{q.PER_RANK}, slot"), SLOT_LEGEND)],
        min_val=0))
    return d


def _wiring_row(d: dash_b.Dashboard) -> dash_b.Dashboard:
    d = d.with_row(dash_b.Row("Wiring"))
    d = d.with_panel(_labels_table(
        "Wiring read at startup",
        "How the target's hidden states are wired into the draft, per scheduler process: captured layer "
        "ids (SGLang's convention), the ids in the draft config, canonical source per slot, expected "
        "width K*H vs the draft fc input width.",
        f"{q.sel(m.WIRING_INFO)} == 1", span=24, height=6, exclude=[]))
    d = d.with_panel(_timeseries(
        "Draft input width", "Columns of the draft's input features in the last verify step: K*H with "
        "aux hidden states, H without (compare with expected_width in the wiring table).", "none",
        [_target(f"max by ({q.PER_RANK}) ({q.sel(m.DRAFT_INPUT_WIDTH)})", ACCEPT_LEGEND)],
        step=True))
    return d


def _findings_row(d: dash_b.Dashboard) -> dash_b.Dashboard:
    d = d.with_row(dash_b.Row("Root causes, checks and findings"))
    d = d.with_panel(_labels_table(
        "Root causes now",
        "What is wrong on each server, one row per root cause, with the fix: what the alerts page for "
        "(runbook: HsTracerCriticalWiringFinding). Empty while no server has one.",
        f"{q.sel(m.ROOT_CAUSE_INFO)} == 1", span=16, height=8, exclude=["engine"]))
    d = d.with_panel(
        _table().title("Checks")
        .description("Which checks hs_tracer runs on each server: slots (live slot sources against "
                     "training), acceptance (live against expected) and identity (same-token "
                     "measurement). A check that is off says why; no alert can fire for what it would "
                     "watch (runbook: HsTracerChecksOff).")
        .datasource(PROM).unit("none").span(8).height(8)
        .with_target(_target(f"max by (model, instance, check, reason) ({q.sel(m.CHECK_ACTIVE)})",
                             instant=True, fmt=prom_m.PromQueryFormat.TABLE))
        .with_transformation(_organize(["Time"], {"Value": "on"}))
        .override_by_name("on", _two_states(("OFF", "orange"), ("on", "green"))))
    d = d.with_panel(
        _table().title("Findings since the tracer started")
        .description("Findings raised per process since it started, by stable code and severity: the "
                     "evidence under the root causes. Static wiring findings are raised once at startup. "
                     "Empty while no server raised one. docs/runbook.md explains each.")
        .datasource(PROM).unit("none").decimals(0).span(12).height(8)
        .with_target(_target(f"sum by (model, instance, code, severity) "
                             f"({q.sel(q.total(m.FINDINGS))}) > 0", instant=True,
                             fmt=prom_m.PromQueryFormat.TABLE))
        .with_transformation(_organize(["Time"], {"Value": "count"})))
    d = d.with_panel(_timeseries(
        "Findings over time", "Findings raised since each process started, by code and severity; a "
        "step up is a new finding. (Cumulative on purpose: findings raised at startup, before the first "
        "scrape, would be invisible to increase().)", "short",
        [_target(f"sum by (model, code, severity) ({q.sel(q.total(m.FINDINGS))})",
                 "{{model}} {{severity}} {{code}}")], min_val=0, step=True))
    return d


def _serving_row(d: dash_b.Dashboard) -> dash_b.Dashboard:
    """SGLang's own throughput and latency: whether speculation pays off at all."""
    d = d.with_row(dash_b.Row("Serving (SGLang's own metrics)"))
    window = q.RATE_WINDOW
    d = d.with_panel(_timeseries(
        "Generation throughput", "Tokens SGLang generates per second per instance (its "
        "generation_tokens_total counter), and its own gen_throughput gauge. Speculation pays off when "
        "this rises with the accept length; an accept length near 1 with throughput below a plain "
        "deployment's is speculation slower than none. Needs SGLang's --enable-metrics.", "short",
        [_target(f"sum by (instance) (rate({em.sel(em.SGLANG_GENERATION_TOKENS)}[{window}]))",
                 "{{instance}} generated tokens/s", "A"),
         _target(f"sum by (instance) ({em.sel(em.SGLANG_GEN_THROUGHPUT)})",
                 "{{instance}} gen_throughput (SGLang's gauge)", "B")], span=8, min_val=0))
    for title, metric, what in (
            ("Inter-token latency", em.SGLANG_ITL, "time between two output tokens of a request: what "
             "speculative decoding is meant to shorten"),
            ("Time to first token", em.SGLANG_TTFT, "time from a request's arrival to its first token "
             "(prefill; the draft's extend adds to it)")):
        buckets = f"sum by (instance, le) (rate({em.sel(q.bucket(metric))}[{window}]))"
        d = d.with_panel(_timeseries(
            title, f"p50 and p99 per instance of SGLang's {metric} histogram: {what}.", "s",
            [_target(f"histogram_quantile({qq}, {buckets})", f"{{{{instance}}}} p{int(qq * 100)}", ref)
             for qq, ref in ((0.5, "A"), (0.99, "B"))], span=8, min_val=0))
    return d


def _health_row(d: dash_b.Dashboard) -> dash_b.Dashboard:
    d = d.with_row(dash_b.Row("Tracer health and overhead"))
    d = d.with_panel(_timeseries(
        "Tracer enabled", "1 while tracing is on in the process; 0 after hs_tracer switched itself off "
        "on an internal error (serving continues; runbook: HsTracerDisabled).", "bool_on_off",
        [_target(f"min by ({q.PER_RANK}) ({q.sel(m.ENABLED)})", ACCEPT_LEGEND)],
        span=8, min_val=0, max_val=1, step=True))
    d = d.with_panel(_timeseries(
        "Dropped records, hook errors, dropped spans", "Per second: step records dropped on a full "
        "recorder queue, exceptions caught in hooks, spans dropped by the exporter.", "cps",
        [_target(q.rate(q.total(m.RECORDS_DROPPED), "model, instance"),
                 "{{model}} {{instance}} records dropped", "A"),
         _target(q.rate(q.total(m.HOOK_ERRORS), "model, instance"),
                 "{{model}} {{instance}} hook errors", "B"),
         _target(q.rate(q.total(m.SPANS_DROPPED), "model, instance"),
                 "{{model}} {{instance}} spans dropped", "C")], span=8, min_val=0))
    d = d.with_panel(_timeseries(
        "Time since last exported step", "Seconds since the newest verify step hs_tracer exported. A "
        "growing value with traffic flowing means the producer stopped, not that all is well.", "s",
        [_target(f"time() - max by ({q.PER_RANK}) ({q.sel(m.LAST_STEP_TIMESTAMP)})",
                 ACCEPT_LEGEND)], span=8, min_val=0))
    d = d.with_panel(_timeseries(
        "Host overhead per verify step", "Host (CPU) time hs_tracer's per-step hooks add to the "
        "scheduler thread: p50, p99 and mean per verify pass.", "s",
        [_target(f"histogram_quantile(0.5, {q.rate(q.bucket(m.HOST_OVERHEAD), 'model, le')})",
                 "{{model}} p50", "A"),
         _target(f"histogram_quantile(0.99, {q.rate(q.bucket(m.HOST_OVERHEAD), 'model, le')})",
                 "{{model}} p99", "B"),
         _target(f"{q.rate(q.sum_of(m.HOST_OVERHEAD), 'model')}\n"
                 f"  / {q.rate(q.count_of(m.HOST_OVERHEAD), 'model')}", "{{model}} mean", "C")],
        min_val=0))
    d = d.with_panel(_timeseries(
        "Scheduler time spent in hs_tracer", "Share of the scheduler process's time hs_tracer takes "
        "(seconds per second): its per-step hooks on the scheduler thread, and its recorder thread's "
        "CPU time, which holds the same GIL and which no hook's time shows.", "percentunit",
        [_target(q.rate(q.sum_of(m.HOST_OVERHEAD), "model, instance"),
                 "{{model}} {{instance}} hooks", "A"),
         _target(q.rate(q.total(m.THREAD_CPU), "model, instance"),
                 "{{model}} {{instance}} recorder thread", "B")], min_val=0))
    return d


# --- the dashboard ---------------------------------------------------------------------------------

def _query_variable(name: str, query: str) -> dash_b.QueryVariable:
    return (dash_b.QueryVariable(name).label(name.capitalize())
            .datasource(PROM).query(query).multi(True).include_all(True).all_value(".+")
            .refresh(dash_m.VariableRefresh.ON_TIME_RANGE_CHANGED).sort(dash_m.VariableSort.ALPHABETICAL_ASC)
            .current(dash_m.VariableOption(selected=True, text="All", value="$__all")))


def build() -> dash_b.Dashboard:
    """The overview dashboard builder."""
    d = (dash_b.Dashboard("hs_tracer: EAGLE-3 draft wiring and acceptance").uid(UID)
         .description("Acceptance, per-slot feature identity and drift, wiring, findings and tracer "
                      "health from hs_tracer (docs/metrics.md, docs/runbook.md).")
         .tags(["hs_tracer", "sglang", "speculative-decoding"]).editable().timezone("browser")
         .time("now-1h", "now").refresh("30s").tooltip(dash_m.DashboardCursorSync.CROSSHAIR)
         .with_variable(dash_b.DatasourceVariable(PROM_VAR).label("Prometheus data source")
                        .type("prometheus"))
         .with_variable(dash_b.DatasourceVariable(TRACES_VAR).label("Tempo data source").type("tempo"))
         .with_variable(_query_variable("job", f"label_values({m.ENABLED}, job)"))
         .with_variable(_query_variable("instance", f'label_values({m.ENABLED}{{job=~"$job"}}, instance)'))
         .with_variable(_query_variable(
             "model", f'label_values({m.ENABLED}{{job=~"$job", instance=~"$instance"}}, model)'))
         .link(dash_b.DashboardLink("Sampled verify-step traces (Tempo)")
               .type(dash_m.DashboardLinkType.LINK).icon("external link").target_blank(True)
               .tooltip(f"Explore {SPAN_NAME} spans of the selected time range")
               .url(_explore_traces_url(f'{{ name = "{SPAN_NAME}" }}'))))
    d = d.annotation(dash_b.AnnotationQuery().name("hs_tracer (re)starts").datasource(PROM).enable(True)
                     .icon_color("purple")
                     .expr(f"time() - max by (model, instance) ({q.sel(m.START_TIME)}) < {RESTART_MARK_S}"))
    for row in (_acceptance_row, _serving_row, _slots_row, _wiring_row, _findings_row, _health_row):
        d = row(d)
    return d


def render() -> str:
    """The dashboard as committed JSON: sorted keys, 2-space indent, trailing newline."""
    model: Any = build().build()
    for i, panel in enumerate(model.panels, start=1):  # stable ids: permalinks and data links survive
        panel.id_val = i
    return json.dumps(model, cls=JSONEncoder, sort_keys=True, indent=2, ensure_ascii=False) + "\n"

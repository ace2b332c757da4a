"""The operator's drill: live traced servers through a real Prometheus and a real Alertmanager to the
pages an on-call engineer gets.

Three traced testbed servers run as production runs them (SGLang's HTTP server with
``--enable-metrics``, :mod:`hs_tracer_testbed.serve`): the draft as configured, the ``ids_shifted``
miswiring, and the configured draft given another model's profile (a server hs_tracer cannot judge).
Prometheus loads the project's own scrape config and rule file, Alertmanager the project's own
alertmanager.yml with a webhook receiver in this process; only their intervals and ``for`` durations
are shortened (minutes become seconds), and hs_tracer's diagnosis window (256 rows instead of 2048),
so the drill takes minutes. Everything listens on the loopback and is stopped at the end.

Asserted: the miswiring is exactly one notification, naming the server, the root cause and the fix,
with a runbook link into a section of docs/runbook.md; the correct server none; the blind server its
own warning; every query of the shipped dashboard returns series; the log lines the docs quote are
what the servers log.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

import hs_tracer.dashboards as dashboards
from hs_tracer.dashboards import alerts
from tests.engine_runs import REPO, child_env
from tests.infra.alertmanager import AlertmanagerServer, WebhookReceiver
from tests.infra.net import free_port, http_get, wait_until
from tests.infra.prom import PrometheusServer

pytestmark = pytest.mark.engine

SHORTER = 60  # every interval and `for` of the project's configs: minutes become seconds
ENV = {"HS_TRACER_WINDOW_TOKENS": "256"}  # hs_tracer's defaults otherwise (identity 1 in 32 prefills)
CONFIGURED, MISWIRED, BLIND = "configured", "ids_shifted", "blind"
SETTLE_S = 45.0  # after the pages came: longer than every shortened `for` that could still fire


def _shorter(duration: str, factor: float) -> str:
    """A Prometheus duration divided by ``factor`` (at least 1 s, except 0)."""
    seconds = sum(int(n) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[u]
                  for n, u in re.findall(r"(\d+)(ms|s|m|h)", duration))
    return "0s" if seconds == 0 else f"{max(1, round(seconds / factor))}s"


@dataclass
class Server:
    name: str
    port: int
    proc: subprocess.Popen[bytes]
    log: Path

    @property
    def instance(self) -> str:
        return f"127.0.0.1:{self.port}"

    def generate(self, prompts: list[str] | str, max_new_tokens: int, stream: bool = False) -> None:
        """One request to SGLang's /generate (streamed: SGLang observes inter-token latency only
        between the chunks of a streamed answer)."""
        body = json.dumps({"text": prompts, "stream": stream, "sampling_params": {
            "max_new_tokens": max_new_tokens, "temperature": 0.0}}).encode()
        req = urllib.request.Request(f"http://{self.instance}/generate", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as resp:
            assert resp.status == 200
            resp.read()

    def up(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"server {self.name} exited with {self.proc.returncode}:\n"
                                 f"{self.text()[-6000:]}")
        return http_get(f"http://{self.instance}/health", timeout_s=2.0) is not None

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def _start(name: str, work: Path, draft: str, profile: Path | None) -> Server:
    port = free_port()
    log = work / f"{name}.log"
    args = [sys.executable, "-m", "hs_tracer_testbed.serve", "--port", str(port), "--draft", draft]
    if profile is not None:
        args += ["--profile", str(profile)]
    with open(log, "wb") as out:
        proc = subprocess.Popen(args, env={**child_env(), **ENV}, cwd=REPO, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    return Server(name, port, proc, log)


def _prometheus_config(servers: list[Server], rules: Path, prom_port: int,
                       am: AlertmanagerServer) -> dict[str, Any]:
    """deploy/prometheus/prometheus.yml with the servers as its SGLang job, this drill's Alertmanager
    and rule file, and every interval shortened."""
    cfg = yaml.safe_load((REPO / "deploy/prometheus/prometheus.yml").read_text())
    # rules are evaluated every second; scrapes keep 5 s so that a busy server's /metrics answers in
    # time (a failed scrape makes its series stale and an alert resolve and fire again: another page)
    cfg["global"] = {**cfg["global"], "scrape_interval": "5s", "scrape_timeout": "5s",
                     "evaluation_interval": _shorter(cfg["global"]["evaluation_interval"], SHORTER)}
    cfg["rule_files"] = [str(rules)]
    cfg["alerting"]["alertmanagers"] = [{"static_configs": [{"targets": [f"127.0.0.1:{am.port}"]}]}]
    here = {"sglang": [s.instance for s in servers], "prometheus": [f"127.0.0.1:{prom_port}"],
            "alertmanager": [f"127.0.0.1:{am.port}"]}
    cfg["scrape_configs"] = [{**job, "static_configs": [{"targets": here[job["job_name"]]}]}
                             for job in cfg["scrape_configs"] if job["job_name"] in here]
    assert {job["job_name"] for job in cfg["scrape_configs"]} == set(here)
    return cfg


def _rules(out: Path) -> Path:
    """deploy/prometheus/rules/hs-tracer.rules.yml with every group interval and `for` shortened."""
    spec = yaml.safe_load((REPO / "deploy/prometheus/rules/hs-tracer.rules.yml").read_text())
    for group in spec["groups"]:
        group["interval"] = _shorter(group["interval"], SHORTER)
        for rule in group["rules"]:
            rule["for"] = _shorter(rule["for"], SHORTER)
    out.write_text(json.dumps(spec))
    return out


def _alertmanager_config(receiver: WebhookReceiver) -> dict[str, Any]:
    """deploy/alertmanager/alertmanager.yml with every receiver posting to ``receiver`` and its waits
    shortened (30 s of grouping become 1 s)."""
    cfg = yaml.safe_load((REPO / "deploy/alertmanager/alertmanager.yml").read_text())
    for key in ("group_wait", "group_interval", "repeat_interval"):
        cfg["route"][key] = _shorter(cfg["route"][key], 30)
    for r in cfg["receivers"]:
        r["webhook_configs"] = [{"url": receiver.url, "send_resolved": False}]
    return cfg


@dataclass
class Drill:
    servers: dict[str, Server]
    prom: PrometheusServer
    am: AlertmanagerServer
    receiver: WebhookReceiver

    def pages(self, server: str) -> list[dict[str, Any]]:
        """The firing notifications about one server."""
        instance = self.servers[server].instance
        return [n for n in self.receiver.notifications
                if n["status"] == "firing" and n["groupLabels"].get("instance") == instance]

    def page(self, server: str) -> dict[str, Any]:
        """The one notification about ``server`` (an error naming every one if there are several)."""
        pages = self.pages(server)
        seen = [[(a["labels"]["alertname"], a["status"], a["startsAt"]) for a in p["alerts"]] for p in pages]
        assert len(pages) == 1, f"{len(pages)} pages for the {server} server: {seen}"
        return pages[0]


@pytest.fixture(scope="module")
def drill(testbed, tmp_path_factory: pytest.TempPathFactory, small_profile: Path) -> Iterator[Drill]:
    from hs_tracer_testbed.corpus import prompts
    from hs_tracer_testbed.demo import testbed_profile

    testbed_profile(testbed)  # built before three servers race to build it
    work = tmp_path_factory.mktemp("drill")
    receiver = WebhookReceiver().start()
    am = AlertmanagerServer(_alertmanager_config(receiver), work / "alertmanager")
    servers = {name: _start(name, work, draft, profile) for name, draft, profile in (
        (CONFIGURED, "configured", None), (MISWIRED, "ids_shifted", None),
        (BLIND, "configured", small_profile))}
    prom = None
    try:
        am.start()
        prom_port = free_port()
        prom = PrometheusServer([], work / "prometheus", port=prom_port, config=_prometheus_config(
            list(servers.values()), _rules(work / "rules.yml"), prom_port, am)).start()
        for s in servers.values():
            wait_until(s.up, 600, f"the {s.name} server on {s.instance}", interval_s=1.0)
        for seed in (1, 2, 3):  # enough rows for a diagnosis window; the first prefill is measured
            for s in servers.values():
                s.generate(prompts(seed=seed, n=8), 40)
        for s in servers.values():
            s.generate(prompts(seed=4, n=1)[0], 24, stream=True)
        d = Drill(servers, prom, am, receiver)
        wait_until(lambda: d.pages(MISWIRED) and d.pages(BLIND), 180, "the miswiring's and the blind "
                   "server's pages", interval_s=1.0)
        time.sleep(SETTLE_S)
        yield d
    finally:
        for s in servers.values():
            s.stop()
        if prom is not None:
            prom.stop()
        am.stop()
        receiver.stop()


def _runbook_sections() -> set[str]:
    text = (REPO / "docs/runbook.md").read_text()
    return {alerts.runbook_anchor(m) for m in re.findall(r"^## (\S+)\s*$", text, re.M)}


def _assert_runbook_link(url: str, alert: str) -> None:
    base, anchor = url.split("#")
    assert base == alerts.RUNBOOK_BASE and base.endswith("docs/runbook.md")
    assert anchor == alerts.runbook_anchor(alert) and anchor in _runbook_sections(), url


def test_the_miswiring_is_one_page_with_its_cause_fix_and_runbook(drill: Drill) -> None:
    page = drill.page(MISWIRED)
    assert page["receiver"] == "hs-tracer-critical"
    (alert,) = [a for a in page["alerts"] if a["status"] == "firing"]
    labels, ann = alert["labels"], alert["annotations"]
    assert labels["alertname"] == "HsTracerCriticalWiringFinding"
    assert labels["instance"] == drill.servers[MISWIRED].instance and labels["cause"] == "layer_ids"
    trained, fed = "[block:1, block:3, block:4]", "[embedding, block:1, block:2]"
    assert f"make SGLang feed {fed}; the draft was trained on {trained}" in ann["summary"]
    assert "Fix: set eagle_config.eagle_aux_hidden_state_layer_ids to [1, 3, 4]" in ann["description"]
    _assert_runbook_link(ann["runbook_url"], "HsTracerCriticalWiringFinding")
    # the symptoms reached Alertmanager and are held back by the cause
    held = {a["labels"]["alertname"] for a in drill.am.alerts()
            if a["labels"].get("instance") == drill.servers[MISWIRED].instance and a["status"]["inhibitedBy"]}
    assert "HsTracerSlotSourceMismatch" in held


def test_the_correct_server_is_never_paged(drill: Drill) -> None:
    assert drill.pages(CONFIGURED) == []
    active = [a["labels"]["alertname"] for a in drill.am.alerts()
              if a["labels"].get("instance") == drill.servers[CONFIGURED].instance]
    assert active == []


def test_a_server_with_another_models_profile_says_it_is_not_watched(drill: Drill) -> None:
    page = drill.page(BLIND)
    assert page["receiver"] == "hs-tracer-warning"
    off = {(a["labels"]["alertname"], a["labels"]["check"], a["labels"]["reason"]) for a in page["alerts"]}
    assert off == {("HsTracerChecksOff", "slots", "profile_mismatch"),
                   ("HsTracerChecksOff", "acceptance", "profile_mismatch")}
    for a in page["alerts"]:
        _assert_runbook_link(a["annotations"]["runbook_url"], "HsTracerChecksOff")


def test_every_dashboard_query_returns_series_from_the_live_servers(drill: Drill) -> None:
    queries = dashboards.dashboard_queries(rate_window="10m")
    empty = [f"{where}: {expr}" for where, expr in queries.items() if not drill.prom.query(expr)]
    assert not empty, "queries without series:\n" + "\n".join(empty)


def test_the_log_lines_the_docs_quote_are_what_the_servers_log(drill: Drill) -> None:
    """docs/runbook.md and docs/deploy.md quote the scheduler's lines; every quoted hs_tracer line is
    in a live server's log (the hook count is what the scheduler registered)."""
    logs = {name: s.text() for name, s in drill.servers.items()}
    runbook = (REPO / "docs/runbook.md").read_text().replace("\n", " ")
    quoted = {q for q in re.findall(r"`(hs_tracer: [^`(]+?)(?: \(\.\.\.\))?`", runbook) if "..." not in q}
    deploy = (REPO / "docs/deploy.md").read_text()
    loaded = deploy[deploy.index("when it loaded:"):].split("```")[1]  # the block of a loaded tracer
    quoted |= set(loaded.strip().splitlines())
    assert any("hooks registered" in q for q in quoted), quoted
    for q in sorted(quoted):
        assert any(q in log for log in logs.values()), f"no server logs {q!r}"
    assert "hs_tracer: root cause [critical] the draft config's layer ids" in logs[MISWIRED]
    assert "hs_tracer: not checked in this process: slots (profile_mismatch); acceptance (profile_mismatch)" \
        in logs[BLIND]

"""deploy/ validated offline (Docker and Kubernetes do not run here): every file parses, and every
cross-reference holds -- mounted files exist, every host:port one component sends to is a service
that exposes and listens on that port, pipelines and routes name defined components, Kubernetes
selectors select and named ports exist. Prometheus' own config check runs through promtool."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

from hs_tracer.dashboards import RULES_FILE, alerts, overview
from tests.infra.prom import ensure_prometheus

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "kubernetes"
DEPLOY_DOC = ROOT / "docs/deploy.md"

# Ports the stock images listen on when their config does not say otherwise.
IMAGE_DEFAULT_PORTS = {"prometheus": {9090}, "alertmanager": {9093}, "grafana": {3000}}


def _yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def _expand(value: str) -> str:
    """Compose's ``${VAR:-default}`` / ``${VAR}`` with the defaults (what `docker compose config` does
    with an empty environment)."""
    return re.sub(r"\$\{(\w+)(?::?-([^}]*))?\}", lambda m: m.group(2) or "", value)


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return _yaml(DEPLOY / "docker-compose.yml")


def _services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return compose["services"]


def _bind_mounts(service: dict[str, Any]) -> list[tuple[Path, PurePosixPath]]:
    out = []
    for spec in service.get("volumes", []):
        source, target = _expand(spec).split(":")[:2]
        if source.startswith((".", "/")):
            out.append(((DEPLOY / source).resolve(), PurePosixPath(target)))
    return out


def _host_path(service: dict[str, Any], container_path: str) -> Path | None:
    """Where a path inside the container comes from on the host, if it is under a bind mount."""
    p = PurePosixPath(container_path)
    for source, target in _bind_mounts(service):
        if p == target or target in p.parents:
            return source / p.relative_to(target)
    return None


def _listening(compose: dict[str, Any]) -> dict[str, set[int]]:
    """Ports each service listens on, read from its own config where it has one."""
    ports = {name: set(IMAGE_DEFAULT_PORTS.get(name, set())) for name in _services(compose)}
    sglang_cmd = " ".join(_expand(a) for a in _services(compose)["sglang"]["command"])
    ports["sglang"] |= {int(m) for m in re.findall(r"--port[= ](\d+)", sglang_cmd)}
    tempo = _yaml(DEPLOY / "tempo/tempo.yaml")
    ports["tempo"].add(tempo["server"]["http_listen_port"])
    for proto in tempo["distributor"]["receivers"]["otlp"]["protocols"].values():
        ports["tempo"].add(int(proto["endpoint"].rsplit(":", 1)[1]))
    collector = _yaml(DEPLOY / "otel-collector/config.yaml")
    for proto in collector["receivers"]["otlp"]["protocols"].values():
        ports["otel-collector"].add(int(proto["endpoint"].rsplit(":", 1)[1]))
    ports["otel-collector"].add(int(collector["extensions"]["health_check"]["endpoint"].rsplit(":", 1)[1]))
    return ports


def _references(compose: dict[str, Any]) -> list[tuple[str, str, int]]:
    """(where, host, port) of every network address one component of the stack sends to."""
    refs: list[tuple[str, str, int]] = []
    prom = _yaml(DEPLOY / "prometheus/prometheus.yml")
    for job in prom["scrape_configs"]:
        for sc in job.get("static_configs", []):
            for target in sc["targets"]:
                host, port = target.rsplit(":", 1)
                host = "prometheus" if host == "localhost" else host  # its self-scrape
                refs.append((f"prometheus job {job['job_name']}", host, int(port)))
    for am in prom["alerting"]["alertmanagers"]:
        for sc in am["static_configs"]:
            for target in sc["targets"]:
                host, port = target.rsplit(":", 1)
                refs.append(("prometheus alerting", host, int(port)))
    collector = _yaml(DEPLOY / "otel-collector/config.yaml")
    for name, exporter in collector["exporters"].items():
        host, port = exporter["endpoint"].rsplit(":", 1)
        refs.append((f"collector exporter {name}", host, int(port)))
    for ds in _yaml(ROOT / "grafana/provisioning/datasources/datasources.yaml")["datasources"]:
        m = re.match(r"https?://([\w.-]+):(\d+)", ds["url"])
        assert m, ds["url"]
        refs.append((f"grafana datasource {ds['name']}", m.group(1), int(m.group(2))))
    sglang = _services(compose)["sglang"]
    args = [_expand(a) for a in sglang["command"]]
    args += [_expand(str(v)) for v in sglang["environment"].values()]
    for text in args:
        for host, port in re.findall(r"(?:--otlp-traces-endpoint=|https?://)([\w.-]+):(\d+)", text):
            refs.append(("sglang", host, int(port)))
    return refs


# --- compose ---------------------------------------------------------------------------------------

def test_compose_has_the_whole_stack(compose: dict[str, Any]) -> None:
    assert set(_services(compose)) == {"sglang", "prometheus", "alertmanager", "otel-collector", "tempo",
                                       "grafana"}
    sglang = _services(compose)["sglang"]
    assert sglang["environment"]["HS_TRACER"] == "1"
    command = [_expand(a) for a in sglang["command"]]
    assert "--enable-metrics" in command and "--speculative-algorithm=EAGLE3" in command


def test_compose_mounts_exist_and_volumes_are_declared(compose: dict[str, Any]) -> None:
    declared = set(compose.get("volumes", {}))
    for name, service in _services(compose).items():
        for spec in service.get("volumes", []):
            source = _expand(spec).split(":")[0]
            if source.startswith((".", "/")):
                assert (DEPLOY / source).exists(), f"{name}: mount source {source} missing"
            elif not source.startswith("~"):
                assert source in declared, f"{name}: named volume {source} not declared"
        for dep in service.get("depends_on", []):
            assert dep in _services(compose), f"{name} depends on unknown service {dep}"


def test_compose_config_files_named_on_command_lines_are_mounted(compose: dict[str, Any]) -> None:
    checked = 0
    for name, service in _services(compose).items():
        command = service.get("command", [])
        for arg in command if isinstance(command, list) else command.split():
            m = re.match(r"-?-config(?:\.file)?=(/\S+)", _expand(arg))
            if m:
                host = _host_path(service, m.group(1))
                assert host is not None and host.is_file(), f"{name}: {m.group(1)} is not a mounted file"
                checked += 1
    assert checked == 4  # prometheus, alertmanager, collector, tempo


def test_compose_build_context_and_dockerfile(compose: dict[str, Any]) -> None:
    build = _services(compose)["sglang"]["build"]
    context = (DEPLOY / build["context"]).resolve()
    dockerfile = context / build["dockerfile"]
    assert context == ROOT and dockerfile.is_file()
    for line in dockerfile.read_text().splitlines():
        if line.startswith("COPY "):
            for src in line.split()[1:-1]:
                assert (context / src).exists(), f"Dockerfile copies missing {src}"
    assert build["args"]["SGLANG_IMAGE"]


def test_every_address_is_a_service_that_exposes_and_listens_on_it(compose: dict[str, Any]) -> None:
    services = _services(compose)
    listening = _listening(compose)
    for name, service in services.items():
        exposed = {int(p) for p in service.get("expose", [])}
        assert exposed <= listening[name], f"{name} exposes {exposed - listening[name]} it does not listen on"
    refs = _references(compose)
    assert len(refs) >= 10
    for where, host, port in refs:
        assert host in services, f"{where}: unknown host {host}"
        exposed = {int(p) for p in services[host].get("expose", [])}
        assert port in listening[host] and port in exposed, f"{where}: {host}:{port} not served"


def test_prometheus_config_passes_promtool_and_loads_the_rules() -> None:
    ensure_prometheus()
    promtool = shutil.which("promtool")
    assert promtool
    proc = subprocess.run([promtool, "check", "config", str(DEPLOY / "prometheus/prometheus.yml")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS: 1 rule files found" in proc.stdout
    prom = _yaml(DEPLOY / "prometheus/prometheus.yml")
    matched = sorted((DEPLOY / "prometheus").glob(prom["rule_files"][0]))
    assert matched == [ROOT / RULES_FILE]


def test_grafana_provisioning_matches_the_stack_and_the_dashboard(compose: dict[str, Any]) -> None:
    grafana = _services(compose)["grafana"]
    provisioning = _host_path(grafana, "/etc/grafana/provisioning")
    assert provisioning == ROOT / "grafana/provisioning"
    [provider] = _yaml(provisioning / "dashboards/dashboards.yaml")["providers"]
    dash_dir = _host_path(grafana, provider["options"]["path"])
    assert dash_dir == ROOT / "grafana/dashboards" and (dash_dir / overview.FILENAME).is_file()
    sources = _yaml(provisioning / "datasources/datasources.yaml")["datasources"]
    types = {ds["type"] for ds in sources}
    assert {"prometheus", "tempo"} <= types  # the dashboard's two datasource variables
    [prom_ds] = [ds for ds in sources if ds["type"] == "prometheus"]
    scrape = _yaml(DEPLOY / "prometheus/prometheus.yml")["global"]["scrape_interval"]
    assert prom_ds["jsonData"]["timeInterval"] == scrape  # $__rate_interval is derived from it
    assert sum(1 for ds in sources if ds.get("isDefault")) == 1


@pytest.fixture(scope="module")
def amtool() -> str:
    """Alertmanager's own config checker, from Debian's prometheus-alertmanager package (installed on
    first use, its service never started: a temporary policy-rc.d forbids it)."""
    path = shutil.which("amtool")
    if path is None:
        policy = Path("/usr/sbin/policy-rc.d")
        created = not policy.exists()
        if created:
            policy.write_text("#!/bin/sh\nexit 101\n")
            policy.chmod(0o755)
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        cmd = ["apt-get", "-y", "-q", "install", "--no-install-recommends", "prometheus-alertmanager"]
        try:
            if subprocess.run(cmd, env=env, capture_output=True).returncode != 0:
                subprocess.run(["apt-get", "-q", "update"], env=env, capture_output=True, check=True)
                subprocess.run(cmd, env=env, capture_output=True, check=True)
        finally:
            if created:
                policy.unlink()
        path = shutil.which("amtool")
    assert path, "amtool missing: apt-get install prometheus-alertmanager (as root)"
    return path


def test_alertmanager_config_passes_amtool(amtool: str) -> None:
    proc = subprocess.run([amtool, "check-config", str(DEPLOY / "alertmanager/alertmanager.yml")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


@pytest.mark.parametrize("rule", [r for g in alerts.groups() for r in g["rules"]], ids=lambda r: r["alert"])
def test_every_alert_routes_to_the_receiver_of_its_severity(amtool: str, rule: dict[str, Any]) -> None:
    labels = [f"alertname={rule['alert']}", *(f"{k}={v}" for k, v in rule["labels"].items()),
              "model=m", "instance=node0:30000"]
    proc = subprocess.run([amtool, "config", "routes", "test",
                           f"--config.file={DEPLOY / 'alertmanager/alertmanager.yml'}", *labels],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip() == f"hs-tracer-{rule['labels']['severity']}"


def test_alertmanager_routes_and_inhibitions_name_real_receivers_and_alerts() -> None:
    am = _yaml(DEPLOY / "alertmanager/alertmanager.yml")
    receivers = {r["name"] for r in am["receivers"]}

    def walk(route: dict[str, Any]) -> None:
        assert route["receiver"] in receivers
        for child in route.get("routes", []):
            walk(child)

    walk(am["route"])
    names = set(alerts.alert_names())
    for rule in am["inhibit_rules"]:
        for key in ("source_matchers", "target_matchers"):
            for matcher in rule[key]:
                m = re.fullmatch(r'alertname=~?"([\w|]+)"', matcher)
                assert m and set(m.group(1).split("|")) <= names, matcher
    labels = {r["labels"]["component"] for g in alerts.groups() for r in g["rules"]}
    assert labels == {"hs_tracer"} and 'component="hs_tracer"' in am["route"]["routes"][0]["matchers"]


def test_collector_pipelines_use_defined_components() -> None:
    col = _yaml(DEPLOY / "otel-collector/config.yaml")
    for name, pipeline in col["service"]["pipelines"].items():
        assert name.split("/")[0] == "traces"
        for kind in ("receivers", "processors", "exporters"):
            for component in pipeline.get(kind, []):
                assert component in col[kind], f"{name}: {kind} {component} undefined"
    for ext in col["service"].get("extensions", []):
        assert ext in col["extensions"]


# --- Kubernetes ------------------------------------------------------------------------------------

def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


@pytest.fixture(scope="module")
def k8s() -> dict[tuple[str, str], dict[str, Any]]:
    objects: dict[tuple[str, str], dict[str, Any]] = {}
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in _docs(path):
            assert doc["apiVersion"] and doc["metadata"]["name"], path
            key = (doc["kind"], doc["metadata"]["name"])
            assert key not in objects, f"duplicate {key}"
            objects[key] = doc
    return objects


def _matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def _pod_labels(sts: dict[str, Any]) -> list[dict[str, str]]:
    """The labels of each pod the StatefulSet makes (the controller adds the pod index)."""
    template = sts["spec"]["template"]["metadata"]["labels"]
    return [{**template, "apps.kubernetes.io/pod-index": str(i),
             "statefulset.kubernetes.io/pod-name": f"{sts['metadata']['name']}-{i}"}
            for i in range(sts["spec"]["replicas"])]


def _container_ports(sts: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for c in sts["spec"]["template"]["spec"]["containers"]
            for p in c.get("ports", [])}


def test_kustomization_lists_existing_files_and_one_monitor() -> None:
    kust = _yaml(K8S / "kustomization.yaml")
    for res in kust["resources"]:
        assert (K8S / res).is_file(), res
    monitors = [r for r in kust["resources"] if r in ("podmonitor.yaml", "servicemonitor.yaml")]
    assert len(monitors) == 1, "apply a PodMonitor or a ServiceMonitor, never both (duplicate series)"


def test_k8s_selectors_select_and_named_ports_exist(k8s: dict[tuple[str, str], dict[str, Any]]) -> None:
    sts = k8s[("StatefulSet", "sglang")]
    pods = _pod_labels(sts)
    ports = _container_ports(sts)
    assert _matches(sts["spec"]["selector"]["matchLabels"], pods[0])
    for (kind, name), obj in k8s.items():
        if kind == "Service":
            selected = [p for p in pods if _matches(obj["spec"]["selector"], p)]
            assert selected, f"Service {name} selects no pod"
            for port in obj["spec"]["ports"]:
                assert port["targetPort"] in ports, f"Service {name}: no container port {port['targetPort']}"
    # the HTTP service (and so /metrics) is the one pod that runs SGLang's HTTP server
    http = k8s[("Service", "sglang")]
    assert [p["apps.kubernetes.io/pod-index"] for p in pods if _matches(http["spec"]["selector"], p)] == ["0"]

    pm = k8s[("PodMonitor", "sglang-hs-tracer")]
    assert [p for p in pods if _matches(pm["spec"]["selector"]["matchLabels"], p)] == [pods[0]]
    for ep in pm["spec"]["podMetricsEndpoints"]:
        assert ep["port"] in ports and ep["path"] == "/metrics"

    sm = k8s[("ServiceMonitor", "sglang-hs-tracer")]
    selector = sm["spec"]["selector"]["matchLabels"]
    services = [o for (kind, _n), o in k8s.items()
                if kind == "Service" and _matches(selector, o["metadata"]["labels"])]
    assert [s["metadata"]["name"] for s in services] == ["sglang"]
    for ep in sm["spec"]["endpoints"]:
        assert ep["port"] in {p["name"] for p in services[0]["spec"]["ports"]} and ep["path"] == "/metrics"


def test_statefulset_wiring(k8s: dict[tuple[str, str], dict[str, Any]]) -> None:
    sts = k8s[("StatefulSet", "sglang")]
    headless = k8s[("Service", sts["spec"]["serviceName"])]
    assert headless["spec"]["clusterIP"] == "None"
    [container] = sts["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    nnodes = int(next(a for a in args if a.startswith("--nnodes=")).split("=")[1])
    assert nnodes == sts["spec"]["replicas"]
    dist = next(a for a in args if a.startswith("--dist-init-addr=")).split("=")[1]
    host, port = dist.rsplit(":", 1)
    assert host == f"{sts['metadata']['name']}-0.{headless['metadata']['name']}"
    assert int(port) in _container_ports(sts).values()
    http_port = int(next(a for a in args if a.startswith("--port=")).split("=")[1])
    assert _container_ports(sts)["http"] == http_port
    assert "--enable-metrics" in args
    env = container["env"]
    defined: set[str] = set()
    for var in env:  # $(VAR) may only refer to variables defined before it
        for ref in re.findall(r"\$\((\w+)\)", str(var.get("value", ""))):
            assert ref in defined, f"{var['name']} uses $({ref}) before it is defined"
        defined.add(var["name"])
    for arg in args:
        for ref in re.findall(r"\$\((\w+)\)", arg):
            assert ref in defined, f"argument {arg} uses undefined $({ref})"
    assert {v["name"]: v.get("value") for v in env}["HS_TRACER"] == "1"
    volumes = {v["name"] for v in sts["spec"]["template"]["spec"]["volumes"]}
    assert {m["name"] for m in container["volumeMounts"]} <= volumes


def test_external_prerequisites_are_documented(k8s: dict[tuple[str, str], dict[str, Any]]) -> None:
    """What the manifests reference but do not create must be named in docs/deploy.md."""
    doc = DEPLOY_DOC.read_text()
    sts = k8s[("StatefulSet", "sglang")]
    spec = sts["spec"]["template"]["spec"]
    externals = [v["persistentVolumeClaim"]["claimName"] for v in spec["volumes"]
                 if "persistentVolumeClaim" in v]
    externals += [c["image"] for c in spec["containers"]]
    env = {v["name"]: v.get("value", "") for v in spec["containers"][0]["env"]}
    externals.append(env["OTEL_COLLECTOR_HOST"])
    externals.append(env["HS_TRACER_PROFILE"].rsplit("/", 1)[1])
    for item in externals:
        assert item in doc, f"docs/deploy.md does not mention {item}"
    for name in ("grafana_dashboard", "ruleSelector", "podMonitorSelector", "serviceMonitorSelector"):
        assert name in doc


def test_deploy_doc_walks_through_the_compose_stack(compose: dict[str, Any]) -> None:
    doc = DEPLOY_DOC.read_text()
    for needle in ("docker compose up", "env.example", "hs-tracer dashboards push", "GRAFANA_TOKEN",
                   "promtool test rules", "hs-tracer dashboards build", "kubectl apply -k deploy/kubernetes"):
        assert needle in doc, needle
    for name, service in _services(compose).items():
        for mapping in service.get("ports", []):
            host_port = _expand(mapping).split(":")[0]
            assert host_port in doc, f"docs/deploy.md does not say where {name} is reachable ({host_port})"


# --- SGLang's own parser on the serving flags ------------------------------------------------------

_PARSE = """
import argparse, json, sys
from sglang.srt.server_args import ServerArgs
out = []
for args in json.loads(sys.stdin.read()):
    parser = argparse.ArgumentParser(exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    out.append(vars(parser.parse_args(args)))
print(json.dumps(out, default=str))
"""


def test_serving_flags_parse_with_the_installed_sglang(compose: dict[str, Any],
                                                       k8s: dict[tuple[str, str], dict[str, Any]]) -> None:
    """The launch flags in the compose file and the StatefulSet are real SGLang 0.5.23 flags."""
    compose_args = [_expand(a) for a in _services(compose)["sglang"]["command"][3:]]
    [container] = k8s[("StatefulSet", "sglang")]["spec"]["template"]["spec"]["containers"]
    env = {v["name"]: v.get("value", "0") for v in container["env"]}
    env["POD_INDEX"] = "1"
    k8s_args = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in container["args"]]
    proc = subprocess.run([sys.executable, "-c", _PARSE], input=json.dumps([compose_args, k8s_args]),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    composed, stateful = json.loads(proc.stdout.strip().splitlines()[-1])
    for ns in (composed, stateful):
        assert ns["speculative_algorithm"] == "EAGLE3" and ns["enable_metrics"] is True
        assert ns["enable_trace"] is True and ns["port"] == 30000
    assert composed["otlp_traces_endpoint"] == "otel-collector:4317"
    assert stateful["nnodes"] == 2 and stateful["node_rank"] == 1 and stateful["tp_size"] == 16


def test_deploy_doc_for_an_existing_fleet() -> None:
    """docs/deploy.md's Part 0: every supported release in its matrix, every HS_TRACER_* variable, and
    the log lines it quotes are the ones the code writes."""
    from hs_tracer import config
    from hs_tracer.inputs import env
    from hs_tracer.integrations.sglang import releases as sglang_releases
    from hs_tracer.integrations.sglang import versions

    doc = (ROOT / "docs/deploy.md").read_text()
    part0 = doc[doc.index("## Part 0"):doc.index("## Part 1")]
    for release in sglang_releases.SUPPORTED_VERSIONS:
        assert f"| SGLang | {release}, {release}.postN | yes" in part0, release
    for name in config.VARIABLES:
        assert f"`{name}" in part0, name
    version = versions.installed_version()
    assert versions.installed_family() is not None
    # the hook count is what a live scheduler logs: tests/test_drill.py checks the whole line
    assert f"hs_tracer: {sglang_releases.support(version)}; " in part0
    _cfg, line = env.validate({"HS_TRACER": "1", "HS_TRACER_CAPTUR_DIR": "/x"})
    assert f"{line}\n" in part0
    unsupported = (f"hs_tracer: tracing stays off: sglang 0.5.10 is not a supported release "
                   f"({sglang_releases.supported_text()})")
    assert f"{unsupported}\n" in part0
    assert "hs_tracer: tracing on (tp 0, pp 0, dp 0): " in part0 and "dashboards push" in part0
    assert "'hs_tracer[dashboards]'" in part0 and "Import" in part0 and "--runbook-base" in part0

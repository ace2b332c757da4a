"""A third engine is one package (tests/fake_engine/) plus its registration: through the registry's
entry-point group it installs its hooks, feeds the core's step path, runs the export process and the
analysis, publishes its Prometheus series, writes a live report with a verdict, answers
``hs-tracer check --engine fake``, and uninstalls back to the engine's own functions. No real
engine: the fake engine's own code hands its hooks real tensors on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hs_tracer import engines
from hs_tracer.cli import main as cli

REPO = Path(__file__).resolve().parents[1]
ENTRY = "fake = tests.fake_engine.engine:ENGINE"

RUNS = r"""
import json, sys, time, urllib.request
from pathlib import Path
from hs_tracer import engines
from hs_tracer.config import TracerConfig
from tests.fake_engine import serving, state

ports, report_dir = [int(p) for p in sys.argv[1].split(",")], Path(sys.argv[2])
NAMES = ("load", "draft_extend", "verify")
originals = {n: serving.Runner.__dict__[n] for n in NAMES}
eng = engines.get("fake")  # not built in: found through its entry point

def scrape(port, name):
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
            if ln.startswith(name + "{")}

def wait(cond, what):
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if cond():
                return
        except (OSError, ValueError, KeyError, TypeError):
            pass
        time.sleep(0.1)
    raise SystemExit(f"timed out waiting for {what}")

def run(port, draft_states):
    out = {}
    reports = report_dir / str(draft_states)
    n = eng.install(TracerConfig(metrics_port=port, window_tokens=16, report_dir=reports, export="process"))
    out["installed"] = n
    out["wrapped"] = all(serving.Runner.__dict__[k] is not originals[k] for k in NAMES)
    runner = serving.Runner({"num_layers": 8, "hidden_size": 8, "aux_layer_ids": [1, 4, 7],
                             "draft_states": draft_states})
    runner.load()
    st = state.SLOT.state
    for i in range(30):
        runner.step(serving.Batch([serving.Request("a"), serving.Request("b")], [1 + i % 4, 2]))
    wait(lambda: list(scrape(port, "hs_tracer_verify_steps_total").values()) == [30.0],
         "30 steps on /metrics")
    report_path = next(reports.glob("*.json"))
    wait(lambda: json.loads(report_path.read_text())["diagnosis"]["acceptance"]["steps"] == 60, "the report")
    out["series"] = scrape(port, "hs_tracer_verify_steps_total")
    out["wiring_info"] = scrape(port, "hs_tracer_wiring_info")
    out["report"] = json.loads(report_path.read_text())
    out["digested"] = st.steps.decode.closes
    recorder = st.recorder
    export = recorder.export.proc
    out["export_pid"] = export.pid
    eng.uninstall()
    recorder.join(30)
    export.wait(30)
    out["recorder_stopped"] = not recorder.is_alive()
    out["restored"] = all(serving.Runner.__dict__[k] is originals[k] for k in NAMES)
    out["after"] = runner.step(serving.Batch([serving.Request("a")], [3]))  # the engine goes on
    out["state_after"] = state.SLOT.state is None
    return out

print("RESULT " + json.dumps({"healthy": run(ports[0], 3), "miswired": run(ports[1], 4),
                              "pid": __import__("os").getpid()}))
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    from tests.infra.net import free_port

    dist = tmp_path_factory.mktemp("dist")
    info = dist / "hs_tracer_fake_engine-1.0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: hs-tracer-fake-engine\nVersion: 1.0.0\n")
    (info / "entry_points.txt").write_text(f"[{engines.ENTRY_POINT_GROUP}]\n{ENTRY}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HS_TRACER")}
    env["PYTHONPATH"] = os.pathsep.join([str(dist), str(REPO), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", RUNS, f"{free_port()},{free_port()}",
                           str(tmp_path_factory.mktemp("reports"))],
                          capture_output=True, text=True, timeout=600, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stderr[-5000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def test_the_fake_engine_is_traced_through_the_core_and_the_export_process(runs: dict) -> None:
    run = runs["healthy"]
    assert run["installed"] == 3 and run["wrapped"]
    report = run["report"]
    assert report["engine"] == "fake" and report["hooks_applied"] and report["hook_errors"] == 0
    assert report["export"]["mode"] == "process" and report["export"]["pid"] != runs["pid"]
    assert report["wiring"]["sources"] == ["block:0", "block:3", "block:6"]
    assert report["wiring"]["engine"] == "fake" and report["wiring"]["engine_version"] == "1.0.0"
    acceptance = report["diagnosis"]["acceptance"]
    assert acceptance["mean_accept_length"] == pytest.approx((sum(1 + i % 4 for i in range(30)) + 60) / 60)
    assert run["digested"] > 0  # the probe closed diagnosis windows over the draft's input
    (series,) = run["series"]
    assert 'engine="fake"' in series
    (info,) = run["wiring_info"]
    assert 'engine="fake"' in info and 'engine_version="1.0.0"' in info
    assert 'sources="block:0,block:3,block:6"' in info


def test_the_live_report_carries_the_verdict_the_wiring_earns(runs: dict) -> None:
    healthy, miswired = runs["healthy"]["report"]["diagnosis"], runs["miswired"]["report"]["diagnosis"]
    assert healthy["status"] == "ok" and healthy["findings"] == []
    assert miswired["status"] == "miswired"
    assert [f["code"] for f in miswired["findings"] if f["severity"] == "critical"] == [
        "draft_input_width_mismatch"]


@pytest.mark.parametrize("name", ["healthy", "miswired"])
def test_uninstall_restores_the_engines_functions_and_stops_tracing(runs: dict, name: str) -> None:
    run = runs[name]
    assert run["restored"] and run["state_after"] and run["recorder_stopped"]
    assert run["after"] == [3]


@pytest.fixture
def registered():
    engines.register("fake", ENTRY.split(" = ")[1])
    yield
    engines.unregister("fake")


def _config(path: Path, **cfg: object) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize(("states", "code"), [(3, 0), (4, 1)])
def test_check_engine_fake(registered: None, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                           states: int, code: int) -> None:
    target = _config(tmp_path / "target", architectures=["FakeForCausalLM"], num_hidden_layers=8,
                     hidden_size=8, num_attention_heads=2, vocab_size=32)
    draft = _config(tmp_path / "draft", architectures=["LlamaForCausalLMEagle3"], hidden_size=8,
                    num_attention_heads=2, vocab_size=32, eagle_aux_hidden_state_layer_ids=[1, 4, 7],
                    num_aux_hidden_states=states)
    assert cli(["check", "--engine", "fake==1.0.0", "--draft", str(draft), "--target", str(target)]) == code
    out = capsys.readouterr().out
    assert "engine: fake==1.0.0 feeds block:0, block:3, block:6" in out
    verdict = "verdict: " + ("nothing to do" if code == 0 else "fix this")
    assert out.strip().splitlines()[-1].startswith(verdict)


def test_an_unknown_engine_is_one_line_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["check", "--engine", "nosuch", "--draft", "d", "--target", "t"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--engine nosuch is not supported (one of: sglang, vllm" in err[0]

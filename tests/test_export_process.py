"""hs_tracer's export process: the pipe protocol, and the process itself fed by the real per-step hooks
with real SGLang objects (metrics scraped over HTTP from it, the report it writes, its lifetime, and
what happens when it dies). The real engine runs it too (tests/test_engine_eagle.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hs_tracer.export import channel
from hs_tracer.export.batch import ARRAYS, StepBatch

REPO = Path(__file__).resolve().parents[1]


def _batch(rng: np.random.Generator, steps: int, slots: int) -> StepBatch:
    sizes = rng.integers(0, 5, steps)
    landed = rng.integers(0, steps + 1)
    return StepBatch(steps=np.arange(1, steps + 1), time_unix_ns=rng.integers(0, 1 << 62, steps),
                     num_draft_tokens=np.full(steps, 4), host_s=rng.random(steps), sizes=sizes,
                     lengths=rng.integers(1, 5, int(sizes.sum())), digest_steps=np.arange(1, landed + 1),
                     digest_tokens=rng.integers(0, 40, landed),
                     digest_raws=rng.random((landed, slots, 5)).astype(np.float32), max_accept_length=4,
                     input_width=24)


@pytest.mark.parametrize("cut", [1, 7, 64, 4096])
def test_messages_cross_the_pipe_unchanged_however_it_splits_them(cut: int) -> None:
    rng = np.random.default_rng(cut)
    batches = [_batch(rng, n, 3) for n in (1, 5, 64)]
    wire = b"".join(channel.encode("steps", {"n": i}, [getattr(b, a) for a in ARRAYS])
                    for i, b in enumerate(batches))
    reader, got = channel.Reader(), []
    for start in range(0, len(wire), cut):
        got += reader.feed(wire[start:start + cut])
    assert [meta["n"] for _kind, meta, _arrays in got] == [0, 1, 2]
    for batch, (kind, _meta, arrays) in zip(batches, got, strict=True):
        assert kind == "steps"
        for name, array in zip(ARRAYS, arrays, strict=True):
            np.testing.assert_array_equal(array, getattr(batch, name))
            assert array.dtype == getattr(batch, name).dtype


def test_a_message_larger_than_the_pipe_is_written_whole_from_the_arrays_own_memory() -> None:
    """The recorder writes batches as buffer lists (no copies); a pipe takes a few MB in several
    partial writes, which must neither lose nor repeat a byte."""
    import os
    import threading

    rng = np.random.default_rng(0)
    batch = _batch(rng, 4096, 3)
    batch.lengths = rng.integers(1, 5, 3 << 20).astype(np.int8)  # 3 MB: several pipe fills
    parts = channel.frame("steps", {"n": 0}, [getattr(batch, a) for a in ARRAYS])
    parts += channel.frame("window", {}, [np.zeros(0), np.ones((2, 3))])  # an empty array too
    rd, wr = os.pipe()
    chunks: list[bytes] = []
    reader = threading.Thread(target=lambda: chunks.extend(iter(lambda: os.read(rd, 1 << 16), b"")))
    reader.start()
    channel.write_all(wr, parts)
    os.close(wr)
    reader.join()
    os.close(rd)
    received = b"".join(chunks)
    assert received == b"".join(bytes(p) for p in parts)
    (_k, _m, arrays), (kind, _m2, window) = channel.Reader().feed(received)
    np.testing.assert_array_equal(arrays[ARRAYS.index("lengths")], batch.lengths)
    assert kind == "window" and window[0].size == 0 and window[1].sum() == 6


def test_a_window_sent_in_the_probes_dtypes_arrives_as_float64_sums() -> None:
    """The recorder folds windows in the snapshot slots' int32/float32 and sends them so; the export
    process turns them into float64 before the analysis adds them to its totals of the whole run."""
    from hs_tracer.export.process import window_from_message
    from hs_tracer.fingerprint.stats import ChannelStats

    sent = ChannelStats(np.full((2, 3), 7, np.int32), np.full((2, 3), 0.5, np.float32),
                        np.full((2, 3), 0.25, np.float32))
    message = channel.encode("window", {}, [sent.count, sent.sum, sent.sumsq])
    (kind, _meta, arrays), = channel.Reader().feed(message)
    got = window_from_message(arrays)
    assert kind == "window" and {a.dtype for a in (got.count, got.sum, got.sumsq)} == {np.dtype(np.float64)}
    total = ChannelStats(np.full((2, 3), 2.0**31), np.zeros((2, 3)), np.zeros((2, 3)))  # past int32
    total.add(got)
    assert total.count[0, 0] == 2.0**31 + 7 and total.sum.sum() == 3.0


@pytest.mark.parametrize("damage", ["object dtype", "short body", "long body", "not json", "huge"])
def test_reader_refuses_anything_it_did_not_write(damage: str) -> None:
    good = channel.encode("window", {}, [np.zeros((2, 3))])
    head_len, body_len = channel.FRAME.unpack_from(good)
    header = good[channel.FRAME.size:channel.FRAME.size + head_len]
    body = good[channel.FRAME.size + head_len:]
    if damage == "object dtype":
        header = header.replace(b"<f8", b"|O0")
    elif damage == "short body":
        body = body[:-8]
    elif damage == "long body":
        body = body + bytes(8)
    elif damage == "not json":
        header = b"{" + header[1:-1]
    elif damage == "huge":
        body_len = channel.MAX_MESSAGE
    if damage != "huge":
        head_len, body_len = len(header), len(body)
    with pytest.raises(channel.ChannelError):
        channel.Reader().feed(channel.FRAME.pack(head_len, body_len) + header + body)


SCHEDULER = r"""
import json, os, signal, sys, time, urllib.request
from pathlib import Path
from types import SimpleNamespace
from hs_tracer_testbed.runtime.inproc import init_world_of_one
init_world_of_one()
import torch
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
from sglang.srt.managers.utils import GenerationBatchResult
from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.sampling.sampling_params import SamplingParams
from hs_tracer.config import TracerConfig
from hs_tracer.integrations.sglang import hooks

from tests.infra.tiny_tracer import H, K, NDT, started
port, report_dir = int(sys.argv[1]), Path(sys.argv[2])
st = started(TracerConfig(metrics_port=port, window_tokens=16, report_dir=report_dir, export="process"))
batch = ScheduleBatch(reqs=[Req(r, "", [1, 2, 3], SamplingParams(max_new_tokens=8)) for r in "ab"])

def step(lengths):
    res = GenerationBatchResult(logits_output=LogitsProcessorOutput(
        next_token_logits=None, hidden_states=torch.randn(2 * NDT, K * H)))
    hooks.before_draft_extend_for_decode(SimpleNamespace(), batch, res)
    res.accept_lens = torch.tensor(lengths, dtype=torch.int32)
    res.speculative_num_draft_tokens = NDT
    return hooks.after_resolve_spec_v2_tokens(None, None, res, batch.copy())

def scrape(name):
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return [float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(name + "{")]

def wait(cond, what):
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if cond():
                return
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.1)
    raise SystemExit(f"timed out waiting for {what}")

for i in range(30):
    step([1 + i % 4, 2])
report_path = report_dir / f"scheduler-{os.getpid()}.json"
wait(lambda: scrape("hs_tracer_verify_steps_total") == [30.0], "30 verify steps on /metrics")
wait(lambda: json.loads(report_path.read_text())["diagnosis"]["acceptance"]["steps"] == 60, "the report")
out = {"scheduler_pid": os.getpid(), "where": st.recorder.where(),
       "accepted": scrape("hs_tracer_accepted_tokens_total"),
       "thread_cpu": scrape("hs_tracer_thread_cpu_seconds_total"),
       "report": json.loads(report_path.read_text())}

os.kill(st.recorder.export.proc.pid, signal.SIGKILL)   # the export process dies under serving
returned = [step([2, 2]) for _ in range(50)]           # serving goes on
wait(lambda: not st.enabled, "tracing to switch itself off")
# the switch is set before the report is rewritten (a failure writes it after): wait for the file too
wait(lambda: not json.loads(report_path.read_text())["enabled"], "the report to say tracing is off")
out.update(enabled=st.enabled, reason=st.disabled_reason, returned=returned,
           report_after=json.loads(report_path.read_text()))
print("RESULT " + json.dumps(out), flush=True)
"""


@pytest.fixture(scope="module")
def scheduler(tmp_path_factory: pytest.TempPathFactory) -> dict:
    from tests.infra.net import free_port

    report_dir = tmp_path_factory.mktemp("reports")
    proc = subprocess.run([sys.executable, "-c", SCHEDULER, str(free_port()), str(report_dir)],
                          capture_output=True, text=True, timeout=900, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-5000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def test_exporters_run_in_their_own_process(scheduler: dict) -> None:
    where = scheduler["where"]
    assert where["mode"] == "process" and where["pid"] != scheduler["scheduler_pid"]
    assert scheduler["report"]["export"] == where


def test_export_process_serves_the_schedulers_metrics_and_writes_its_report(scheduler: dict) -> None:
    assert scheduler["accepted"] == [sum(i % 4 for i in range(30)) + 30]  # accepted = length - 1
    report = scheduler["report"]
    assert report["pid"] == scheduler["scheduler_pid"] and report["enabled"]
    assert report["probes"]["decode_steps"] == 30
    acceptance = report["diagnosis"]["acceptance"]
    assert acceptance["mean_accept_length"] == pytest.approx((sum(1 + i % 4 for i in range(30)) + 60) / 60)
    # the recorder thread's CPU time in the scheduler process crosses with the batches
    cost = report["overhead"]
    assert cost["verify_steps"] == 30 and cost["thread_cpu_us_per_step"] > 0 and cost["hook_us_per_step"] > 0
    assert cost["kernel_gpu_us_per_step"] is None  # on the CPU
    assert len(scheduler["thread_cpu"]) == 1 and scheduler["thread_cpu"][0] > 0


def test_export_process_dying_switches_tracing_off_not_serving(scheduler: dict) -> None:
    assert not scheduler["enabled"]
    assert "export process" in scheduler["reason"]
    assert scheduler["returned"] == [None] * 50  # the hooks never changed SGLang's results
    after = scheduler["report_after"]
    assert not after["enabled"] and after["disabled_reason"] == scheduler["reason"]


def test_export_process_never_outlives_its_scheduler(scheduler: dict, tmp_path: Path) -> None:
    """The pipe closes when the scheduler process exits, however it ends: the export process exits."""
    import os
    import signal
    import time

    from tests.infra.net import free_port

    script = SCHEDULER.split("for i in range(30):")[0] + (
        "step([2, 2])\nwait(lambda: st.recorder.export is not None, 'the export process')\n"
        "print('PID', st.recorder.export.proc.pid, flush=True)\ntime.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", script, str(free_port()), str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=REPO)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    export_pid = int(line.split()[1])
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(30)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _alive(export_pid):
        time.sleep(0.1)
    assert not _alive(export_pid)


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/stat").read_text().split(") ")[-1].split()[0]
    except OSError:
        return False
    return status != "Z"  # a zombie has exited (only its parent may reap it)


def test_scheduler_exports_itself_when_the_export_process_cannot_start(tmp_path: Path) -> None:
    """No interpreter to start it with: the exporters run in the scheduler process, tracing stays on."""
    from tests.infra.net import free_port

    script = SCHEDULER.replace("st = started(", "sys.executable = '/nonexistent/python'\nst = started(", 1)
    script = script.split("for i in range(30):")[0] + (
        "for i in range(30):\n    step([1 + i % 4, 2])\n"
        "wait(lambda: scrape('hs_tracer_verify_steps_total') == [30.0], '30 verify steps on /metrics')\n"
        "report_path = report_dir / f'scheduler-{os.getpid()}.json'\n"
        "steps = lambda: json.loads(report_path.read_text())['diagnosis']['acceptance']['steps']\n"
        "wait(lambda: steps() == 60, 'the report')\n"
        "print('RESULT ' + json.dumps({'where': st.recorder.where(), 'enabled': st.enabled,\n"
        "                              'report': json.loads(report_path.read_text())}), flush=True)\n")
    proc = subprocess.run([sys.executable, "-c", script, str(free_port()), str(tmp_path)],
                          capture_output=True, text=True, timeout=900, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert "cannot start the export process" in proc.stderr
    out = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))[len("RESULT "):])
    assert out["where"] == {"mode": "thread"} and out["enabled"]
    assert out["report"]["export"] == {"mode": "thread"}


def test_export_process_writes_sglangs_multiprocess_metrics(tmp_path: Path) -> None:
    """SGLang with --enable-metrics sets PROMETHEUS_MULTIPROC_DIR before it starts the schedulers: the
    export process inherits it and writes hs_tracer's series there, where SGLang's /metrics reads them."""
    import os

    from tests.infra.net import free_port

    mp_dir = tmp_path / "prometheus"
    mp_dir.mkdir()
    script = SCHEDULER.split("for i in range(30):")[0] + (
        "from prometheus_client import CollectorRegistry, generate_latest, multiprocess\n"
        "def aggregated(name):\n"
        "    registry = CollectorRegistry()\n"
        "    multiprocess.MultiProcessCollector(registry, path=os.environ['PROMETHEUS_MULTIPROC_DIR'])\n"
        "    text = generate_latest(registry).decode()\n"
        "    return [float(ln.rsplit(' ', 1)[1]) for ln in text.splitlines() if ln.startswith(name + '{')]\n"
        "for i in range(30):\n    step([1 + i % 4, 2])\n"
        "wait(lambda: aggregated('hs_tracer_verify_steps_total') == [30.0], 'the multiprocess files')\n"
        "files = sorted(os.listdir(os.environ['PROMETHEUS_MULTIPROC_DIR']))\n"
        "print('RESULT ' + json.dumps({'where': st.recorder.where(), 'files': files}))\n")
    proc = subprocess.run([sys.executable, "-c", script, str(free_port()), str(tmp_path)],
                          capture_output=True, text=True, timeout=900, cwd=REPO,
                          env={**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(mp_dir)})
    assert proc.returncode == 0, proc.stderr[-5000:]
    out = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))[len("RESULT "):])
    assert out["where"]["mode"] == "process"
    assert any(name.endswith(f"_{out['where']['pid']}.db") for name in out["files"])  # the export process's

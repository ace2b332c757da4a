"""Load and faults on the real CPU engine with tracing on (results: docs/reliability.md).

``soak``: the CPU testbed (real SGLang 0.5.23, EAGLE-3) serves many concurrent requests for a while
with HS_TRACER=1; the scheduler's RSS is sampled throughout, and at the end hs_tracer's own counters
(scraped from its /metrics) are compared with SGLang's per-request counts (``spec_verify_ct`` and the
accepted drafts, ``spec_num_correct_drafts`` from 0.5.12 on, in each response's meta_info).

``faults``: one traced engine serving request batches while, in turn, the OTLP collector is slow
(accepts, never answers) and then down (refused), hs_tracer's /metrics has stalled scrapers hanging on
it, the capture directory sits on a small tmpfs that fills up (ENOSPC), and the report directory is
removed. Every request must complete, tracing must stay on with counts equal to SGLang's, capture
must stop with one log line, and the report must come back.

Run in a fresh process (the CPU runtime must be prepared before SGLang is imported)::

    python benchmarks/soak.py soak --duration 300 --concurrency 32 --out benchmarks/results/soak.json
    python benchmarks/soak.py faults --out benchmarks/results/faults.json

``faults`` mounts a tmpfs: it runs itself under ``unshare --mount`` (``--map-root-user`` when not
root) so the mount is private to it and goes away with it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from provenance import source_state
from scrape import counters

REPO = Path(__file__).resolve().parents[1]
COUNTERS = ("hs_tracer_drafts_total", "hs_tracer_accepted_tokens_total", "hs_tracer_verify_steps_total",
            "hs_tracer_records_dropped_total", "hs_tracer_hook_errors_total", "hs_tracer_enabled",
            "hs_tracer_spans_dropped_total")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict[str, float]:
    """hs_tracer's counters from its own /metrics, summed over label sets."""
    return counters(port, COUNTERS)


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


class BlackHole:
    """A TCP server that accepts connections and never answers (a hung collector); ``close()`` makes
    the port refuse connections (a collector that is down)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.held: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.held.append(conn)

    def close(self) -> None:
        self.sock.close()
        for conn in self.held:
            conn.close()


def stalled_scrapers(port: int, n: int) -> list[socket.socket]:
    """``n`` clients that connect to /metrics and send half a request, then hang."""
    out = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
        out.append(s)
    return out


class Server:
    """One traced testbed engine and the bookkeeping of what SGLang itself reported."""

    def __init__(self, work: Path, extra_env: dict[str, str], max_new_tokens: int) -> None:
        from hs_tracer_testbed import ensure_testbed
        from hs_tracer_testbed.corpus import prompts as corpus_prompts
        from hs_tracer_testbed.demo import testbed_profile

        tb = ensure_testbed(progress=False)
        self.report_dir = work / "reports"
        self.metrics_port = _free_port()
        self.env = {
            "HS_TRACER": "1",
            "HS_TRACER_PROFILE": str(testbed_profile(tb)),
            "HS_TRACER_REPORT_DIR": str(self.report_dir),
            "HS_TRACER_METRICS_PORT": str(self.metrics_port),
            "HS_TRACER_METRICS_ADDR": "127.0.0.1",
            "HS_TRACER_WINDOW_TOKENS": "512",
            **extra_env,
        }
        self.prompts = corpus_prompts(seed=4321, n=64)
        self.max_new_tokens = max_new_tokens
        from hs_tracer.integrations.sglang.versions import installed_meta_counters

        self.accepted_key = installed_meta_counters().accepted_drafts  # meta_info's key, as results name it
        self.sglang = {"requests": 0, "completion_tokens": 0, "spec_verify_ct": 0, self.accepted_key: 0}
        self.incomplete = 0
        from hs_tracer_testbed.runtime.launcher import start_engine

        # The KV cache is capped by max_total_tokens; a larger static fraction only keeps SGLang's
        # free-memory probe from failing when other processes on a shared machine allocate meanwhile.
        self.engine = start_engine(tb.target, tb.draft, env=self.env, mem_fraction_static=0.3)

    def scheduler_pid(self) -> int:
        files = sorted(self.report_dir.glob("scheduler-*.json"))
        if not files:
            raise RuntimeError(f"no scheduler report in {self.report_dir}")
        return int(files[0].name.split("-")[1].split(".")[0])

    def batch(self, requests: int, concurrency: int, deadline: float | None = None) -> None:
        """``requests`` requests (or until ``deadline``) with ``concurrency`` in flight."""
        params = {"temperature": 0.0, "max_new_tokens": self.max_new_tokens, "ignore_eos": True}
        left = [requests]

        async def worker(w: int) -> None:
            i = w
            while left[0] > 0 and (deadline is None or time.monotonic() < deadline):
                left[0] -= 1
                out = await self.engine.async_generate(self.prompts[i % len(self.prompts)], params)
                meta = out["meta_info"]
                self.sglang["requests"] += 1
                self.sglang["completion_tokens"] += int(meta["completion_tokens"])
                self.sglang["spec_verify_ct"] += int(meta.get("spec_verify_ct", 0))
                self.sglang[self.accepted_key] += int(meta.get(self.accepted_key, 0))
                if int(meta["completion_tokens"]) != self.max_new_tokens:
                    self.incomplete += 1
                i += concurrency

        async def run() -> None:
            await asyncio.gather(*(worker(w) for w in range(concurrency)))

        self.engine.loop.run_until_complete(run())

    def settled_metrics(self, timeout_s: float = 60.0) -> dict[str, float]:
        """hs_tracer's counters once the recorder has caught up (two equal scrapes 3 s apart)."""
        last, deadline = None, time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            now = scrape(self.metrics_port)
            if now == last:
                return now
            last = now
            time.sleep(3.0)
        return last or {}

    def report(self) -> dict[str, Any]:
        return json.loads((self.report_dir / f"scheduler-{self.scheduler_pid()}.json").read_text())

    def shutdown(self) -> None:
        self.engine.shutdown()


def agreement(m: dict[str, float], sglang: dict[str, int], accepted_key: str) -> dict[str, Any]:
    return {
        "hs_tracer": {"drafts": int(m.get("hs_tracer_drafts_total", -1)),
                      "accepted_tokens": int(m.get("hs_tracer_accepted_tokens_total", -1)),
                      "verify_steps": int(m.get("hs_tracer_verify_steps_total", -1)),
                      "records_dropped": int(m.get("hs_tracer_records_dropped_total", -1)),
                      "hook_errors": int(m.get("hs_tracer_hook_errors_total", -1)),
                      "spans_dropped": int(m.get("hs_tracer_spans_dropped_total", -1)),
                      "enabled": int(m.get("hs_tracer_enabled", -1))},
        "sglang": dict(sglang),
        "drafts_equal": int(m.get("hs_tracer_drafts_total", -1)) == sglang["spec_verify_ct"],
        "accepted_equal": (int(m.get("hs_tracer_accepted_tokens_total", -1))
                           == sglang[accepted_key]),
    }


def machine() -> dict[str, Any]:
    return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "host": platform.node(),
            "cpus": os.cpu_count(), "load_avg_1m": os.getloadavg()[0], "python": platform.python_version()}


def soak(args: argparse.Namespace) -> dict[str, Any]:
    env = {"HS_TRACER_QUEUE_SIZE": str(args.queue_size)} if args.queue_size else {}
    with tempfile.TemporaryDirectory(prefix="hs-tracer-soak-") as tmp:
        t0 = time.monotonic()
        srv = Server(Path(tmp), env, args.max_new_tokens)
        start_s = time.monotonic() - t0
        try:
            srv.batch(args.concurrency, args.concurrency)  # warm up: the scheduler reports its pid
            pid = srv.scheduler_pid()
            samples: list[tuple[float, int, int]] = []
            stop = threading.Event()
            began = time.monotonic()

            def sample() -> None:
                while not stop.is_set():
                    now = round(time.monotonic() - began, 1)
                    samples.append((now, rss_bytes(pid), srv.sglang["requests"]))
                    stop.wait(args.sample_s)

            thread = threading.Thread(target=sample, daemon=True)
            thread.start()
            srv.batch(10**9, args.concurrency, deadline=began + args.duration)
            stop.set()
            thread.join()
            served_s = time.monotonic() - began
            metrics = srv.settled_metrics()
            samples.append((round(time.monotonic() - began, 1), rss_bytes(pid), srv.sglang["requests"]))
        finally:
            srv.shutdown()
    rss = [r for _t, r, _n in samples]
    quarter = max(len(rss) // 4, 1)
    first, last = rss[:quarter], rss[-quarter:]
    return {
        "mode": "soak", "machine": machine(), "engine_start_s": round(start_s, 1),
        "duration_s": round(served_s, 1), "concurrency": args.concurrency,
        "max_new_tokens": args.max_new_tokens, "queue_size": args.queue_size or 1024,
        "requests": srv.sglang["requests"], "incomplete_requests": srv.incomplete,
        "requests_per_s": round(srv.sglang["requests"] / served_s, 2),
        "counts": agreement(metrics, srv.sglang, srv.accepted_key),
        "scheduler_rss_mib": {"first_quarter_median": round(sorted(first)[len(first) // 2] / 2**20, 1),
                              "last_quarter_median": round(sorted(last)[len(last) // 2] / 2**20, 1),
                              "min": round(min(rss) / 2**20, 1), "max": round(max(rss) / 2**20, 1)},
        "rss_samples": [{"t_s": t, "rss_mib": round(r / 2**20, 1), "requests": n} for t, r, n in samples],
    }


def faults(args: argparse.Namespace) -> dict[str, Any]:
    phases: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="hs-tracer-faults-") as tmp:
        work = Path(tmp)
        disk = work / "disk"
        disk.mkdir()
        tmpfs_bytes = args.tmpfs_kib * 1024
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={tmpfs_bytes}", "tmpfs", str(disk)], check=True)
        log = work / "server.log"
        saved_err = os.dup(2)
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(fd, 2)  # the engine's processes inherit it: their log lines are counted below
        collector = BlackHole()
        srv = None
        scrapers: list[socket.socket] = []
        env = {"HS_TRACER_CAPTURE_DIR": str(disk / "capture"), "HS_TRACER_CAPTURE_RATE": "1",
               "HS_TRACER_SPAN_SAMPLE": "1",
               "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://127.0.0.1:{collector.port}/v1/traces",
               "OTEL_EXPORTER_OTLP_TIMEOUT": "2"}
        try:
            srv = Server(work, env, args.max_new_tokens)
            def phase(name: str) -> None:
                before = dict(srv.sglang)
                t = time.monotonic()
                srv.batch(args.requests, args.concurrency)
                phases.append({"phase": name, "requests": srv.sglang["requests"] - before["requests"],
                               "seconds": round(time.monotonic() - t, 1)})

            phase("otlp collector slow (accepts, never answers); capture filling a small tmpfs")
            collector.close()
            phase("otlp collector down (connection refused)")
            scrapers = stalled_scrapers(srv.metrics_port, 16)
            phase("16 stalled scrapers hanging on hs_tracer's /metrics")
            shutil.rmtree(srv.report_dir)
            phase("report dir removed")
            metrics = srv.settled_metrics()
            recreated = any(srv.report_dir.glob("scheduler-*.json"))
            report = srv.report()
        finally:
            for s in scrapers:
                s.close()
            if srv is not None:
                srv.shutdown()
            os.dup2(saved_err, 2)
            disk_used = shutil.disk_usage(disk)
            subprocess.run(["umount", "-l", str(disk)], check=False)
        lines = log.read_text(errors="replace").splitlines()
    tracer_lines = [ln for ln in lines if "hs_tracer" in ln]
    return {
        "mode": "faults", "machine": machine(), "phases": phases,
        "requests": srv.sglang["requests"], "incomplete_requests": srv.incomplete,
        "counts": agreement(metrics, srv.sglang, srv.accepted_key),
        "capture": {"tmpfs_bytes": tmpfs_bytes, "tmpfs_used_bytes": disk_used.used,
                    "sink": report.get("capture_sink"),
                    "stopped_log_lines": [ln for ln in tracer_lines if "capture stopped" in ln]},
        "report_recreated": recreated,
        "tracer_enabled": report.get("enabled"), "disabled_reason": report.get("disabled_reason"),
        "tracer_error_lines": [ln for ln in tracer_lines if "ERROR" in ln or "Traceback" in ln],
        "traceback_lines": sum("Traceback" in ln for ln in lines),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="mode", required=True)
    s = sub.add_parser("soak")
    s.add_argument("--duration", type=float, default=300.0)
    s.add_argument("--concurrency", type=int, default=32)
    s.add_argument("--max-new-tokens", type=int, default=32)
    s.add_argument("--queue-size", type=int, default=0, help="HS_TRACER_QUEUE_SIZE (default: unset)")
    s.add_argument("--sample-s", type=float, default=5.0)
    f = sub.add_parser("faults")
    f.add_argument("--requests", type=int, default=16, help="requests per phase")
    f.add_argument("--concurrency", type=int, default=8)
    f.add_argument("--max-new-tokens", type=int, default=16)
    f.add_argument("--tmpfs-kib", type=int, default=384, help="size of the capture disk (it fills up)")
    for q in (s, f):
        q.add_argument("--out", type=Path, help="write the JSON result here")
        q.add_argument("--in-namespace", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.mode == "faults" and not args.in_namespace:
        # A private mount namespace for the tmpfs (and root inside it when not root outside).
        cmd = ["unshare", "--mount", *([] if os.geteuid() == 0 else ["--map-root-user"]),
               sys.executable, *sys.argv, "--in-namespace"]
        sys.exit(subprocess.run(cmd).returncode)
    result = soak(args) if args.mode == "soak" else faults(args)
    result["source"] = source_state(Path(__file__).resolve().parents[1])  # the commit measured
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print("SOAK-RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()

"""A real Prometheus server for tests (Debian's ``prometheus`` package), with PromQL over HTTP.

Each :class:`PrometheusServer` is its own process with a private config and TSDB directory on a free
port, scraping the given targets every ``scrape_interval``; the packaged service is never used.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
from pathlib import Path
from typing import Any

from .net import free_port, http_get, wait_until

INSTALL_SCRIPT = Path(__file__).with_name("prometheus.sh")


def ensure_prometheus() -> str:
    """Path of the ``prometheus`` binary, installing Debian's package first if it is missing."""
    binary = shutil.which("prometheus")
    if binary is None:
        subprocess.run(["bash", str(INSTALL_SCRIPT)], check=True)
        binary = shutil.which("prometheus")
    if binary is None:
        raise RuntimeError(f"prometheus is not installed and {INSTALL_SCRIPT} could not install it; "
                           "run it as root (apt-get install prometheus)")
    return binary


class PrometheusServer:
    """``prometheus`` scraping ``targets`` (``host:port``) as job ``job``. Use as a context manager."""

    def __init__(self, targets: list[str], workdir: Path, *, job: str = "hs_tracer",
                 scrape_interval: str = "500ms", binary: str | None = None,
                 config: dict[str, Any] | None = None, port: int | None = None) -> None:
        self.targets = targets
        self.job = job
        self.workdir = workdir
        self.scrape_interval = scrape_interval
        self.binary = binary or ensure_prometheus()
        self.port = port or free_port()
        self.config = config  # a whole prometheus.yml (rule files, alerting) instead of the minimal one
        self._proc: subprocess.Popen[bytes] | None = None
        self._log = workdir / "prometheus.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _config(self) -> str:
        # JSON is valid YAML: no YAML dependency for the tests.
        if self.config is not None:
            return json.dumps(self.config)
        return json.dumps({
            "global": {"scrape_interval": self.scrape_interval, "scrape_timeout": self.scrape_interval,
                       "evaluation_interval": "15s"},
            "scrape_configs": [{"job_name": self.job, "static_configs": [{"targets": self.targets}]}],
        })

    def start(self, timeout_s: float = 60.0) -> PrometheusServer:
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = self.workdir / "prometheus.yml"
        config.write_text(self._config())
        with open(self._log, "wb") as log:
            self._proc = subprocess.Popen(
                [self.binary, f"--config.file={config}", f"--storage.tsdb.path={self.workdir / 'tsdb'}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
                stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_until(self._ready, timeout_s, f"prometheus ready on {self.url}", interval_s=0.1)
        except TimeoutError:
            self.stop()
            raise RuntimeError(f"prometheus did not become ready; its log:\n{self.log()}") from None
        return self

    def _ready(self) -> bool:
        if self._proc is not None and self._proc.poll() is not None:
            raise RuntimeError(f"prometheus exited with {self._proc.returncode}; its log:\n{self.log()}")
        return http_get(f"{self.url}/-/ready", timeout_s=1.0) is not None

    def log(self) -> str:
        return self._log.read_text(errors="replace") if self._log.exists() else ""

    def stop(self) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        try:
            self._proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._proc = None

    def __enter__(self) -> PrometheusServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- PromQL ---------------------------------------------------------------------------------

    def query(self, promql: str) -> list[dict[str, Any]]:
        """An instant query at the current time; the raw ``result`` list (vector results)."""
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": promql, "time": time.time()})
        body = http_get(url, timeout_s=10.0)
        if body is None:
            raise RuntimeError(f"PromQL query failed: {promql}")
        answer = json.loads(body)
        if answer.get("status") != "success":
            raise RuntimeError(f"PromQL {promql!r}: {answer}")
        data = answer["data"]
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        return data["result"]

    def vector(self, promql: str) -> list[tuple[dict[str, str], float]]:
        """(labels, value) per series of an instant query."""
        return [(r["metric"], float(r["value"][1])) for r in self.query(promql)]

    def value(self, promql: str) -> float:
        """The single value of an instant query; an error if it returns no or several series."""
        result = self.vector(promql)
        if len(result) != 1:
            raise AssertionError(f"PromQL {promql!r} returned {len(result)} series: {result}")
        return result[0][1]

    def wait_for_scrape(self, after_unix_s: float, timeout_s: float = 60.0) -> None:
        """Wait until every target has been scraped successfully by a scrape that started after
        ``after_unix_s`` (so it saw everything recorded before that moment)."""
        job = self.job
        n = len(self.targets)

        def scraped() -> bool:
            ok = self.vector(f'up{{job="{job}"}} == 1 and timestamp(up{{job="{job}"}}) > {after_unix_s}')
            return len(ok) == n

        wait_until(scraped, timeout_s, f"a fresh successful scrape of {self.targets}", interval_s=0.1)

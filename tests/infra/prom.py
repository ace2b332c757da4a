"""A real Prometheus server for tests (Debian's ``prometheus`` package), with PromQL over HTTP.

Each :class:`PrometheusServer` is its own process with a private config and TSDB directory on a free
port, scraping the given targets every ``scrape_interval``; the packaged service is never used.
"""

from __future__ import annotations

import json
import time
import urllib.parse
from pathlib import Path
from typing import Any

from .daemon import Daemon, ensure_binary
from .net import http_get, wait_until


def ensure_prometheus() -> str:
    """Path of the ``prometheus`` binary, installing Debian's package first if it is missing."""
    return ensure_binary("prometheus", "prometheus")


class PrometheusServer(Daemon):
    """``prometheus`` scraping ``targets`` (``host:port``) as job ``job``, or running ``config`` (a
    whole prometheus.yml as a dict: rule files, alerting) instead. Use as a context manager."""

    name = "prometheus"
    config_name = "prometheus.yml"

    def __init__(self, targets: list[str], workdir: Path, *, job: str = "hs_tracer",
                 scrape_interval: str = "500ms", binary: str | None = None,
                 config: dict[str, Any] | None = None, port: int | None = None) -> None:
        super().__init__(workdir, binary or ensure_prometheus(), port)
        self.targets = targets
        self.job = job
        self.scrape_interval = scrape_interval
        self.config = config

    def config_text(self) -> str:
        # JSON is valid YAML: no YAML dependency for the tests.
        if self.config is not None:
            return json.dumps(self.config)
        return json.dumps({
            "global": {"scrape_interval": self.scrape_interval, "scrape_timeout": self.scrape_interval,
                       "evaluation_interval": "15s"},
            "scrape_configs": [{"job_name": self.job, "static_configs": [{"targets": self.targets}]}],
        })

    def command(self, config: Path) -> list[str]:
        return [self.binary, f"--config.file={config}", f"--storage.tsdb.path={self.workdir / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"]

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

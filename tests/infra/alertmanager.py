"""A real Alertmanager for tests (Debian's ``prometheus-alertmanager``) and the webhook receiver its
notifications go to.

:class:`AlertmanagerServer` runs one process with a private config, storage and port (clustering
off); :class:`WebhookReceiver` is an HTTP server in this process that keeps every notification posted
to it, as a pager would receive them.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from .daemon import Daemon, ensure_binary
from .net import http_get


def ensure_alertmanager() -> str:
    """Path of the ``prometheus-alertmanager`` binary, installing Debian's package first if missing."""
    return ensure_binary("prometheus-alertmanager", "prometheus-alertmanager")


class WebhookReceiver:
    """Collects Alertmanager's webhook notifications (one JSON body per notification)."""

    def __init__(self) -> None:
        self.notifications: list[dict[str, Any]] = []
        received = self.notifications
        lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with lock:
                    received.append(json.loads(body))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def start(self) -> WebhookReceiver:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class AlertmanagerServer(Daemon):
    """``prometheus-alertmanager`` with ``config`` (an alertmanager.yml as a dict) on a free port,
    clustering off."""

    name = "alertmanager"
    config_name = "alertmanager.yml"

    def __init__(self, config: dict[str, Any], workdir: Path, binary: str | None = None) -> None:
        super().__init__(workdir, binary or ensure_alertmanager())
        self.config = config

    def config_text(self) -> str:
        return json.dumps(self.config)  # JSON is valid YAML

    def command(self, config: Path) -> list[str]:
        return [self.binary, f"--config.file={config}", f"--storage.path={self.workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}", "--cluster.listen-address=",
                "--log.level=warn"]

    def alerts(self) -> list[dict[str, Any]]:
        """The alerts Alertmanager holds now (API v2), with their inhibited/silenced status."""
        body = http_get(f"{self.url}/api/v2/alerts", timeout_s=5.0)
        return json.loads(body) if body else []

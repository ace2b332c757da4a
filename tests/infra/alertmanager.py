"""A real Alertmanager for tests (Debian's ``prometheus-alertmanager``) and the webhook receiver its
notifications go to.

:class:`AlertmanagerServer` runs one process with a private config, storage and port (clustering
off); :class:`WebhookReceiver` is an HTTP server in this process that keeps every notification posted
to it, as a pager would receive them.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from .net import free_port, http_get, wait_until
from .prom import INSTALL_SCRIPT


def ensure_alertmanager() -> str:
    """Path of the ``prometheus-alertmanager`` binary, installing Debian's package first if missing."""
    binary = shutil.which("prometheus-alertmanager")
    if binary is None:
        subprocess.run(["bash", str(INSTALL_SCRIPT)], check=True)
        binary = shutil.which("prometheus-alertmanager")
    if binary is None:
        raise RuntimeError(f"prometheus-alertmanager is not installed and {INSTALL_SCRIPT} could not "
                           "install it; run it as root (apt-get install prometheus-alertmanager)")
    return binary


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


class AlertmanagerServer:
    """``prometheus-alertmanager`` with ``config`` (an alertmanager.yml as a dict) on a free port."""

    def __init__(self, config: dict[str, Any], workdir: Path, binary: str | None = None) -> None:
        self.config = config
        self.workdir = workdir
        self.binary = binary or ensure_alertmanager()
        self.port = free_port()
        self._proc: subprocess.Popen[bytes] | None = None
        self._log = workdir / "alertmanager.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 60.0) -> AlertmanagerServer:
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = self.workdir / "alertmanager.yml"
        config.write_text(json.dumps(self.config))  # JSON is valid YAML
        with open(self._log, "wb") as log:
            self._proc = subprocess.Popen(
                [self.binary, f"--config.file={config}", f"--storage.path={self.workdir / 'data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--cluster.listen-address=",
                 "--log.level=warn"], stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_until(self._ready, timeout_s, f"alertmanager ready on {self.url}", interval_s=0.1)
        except TimeoutError:
            self.stop()
            raise RuntimeError(f"alertmanager did not become ready; its log:\n{self.log()}") from None
        return self

    def _ready(self) -> bool:
        if self._proc is not None and self._proc.poll() is not None:
            raise RuntimeError(f"alertmanager exited with {self._proc.returncode}; its log:\n{self.log()}")
        return http_get(f"{self.url}/-/ready", timeout_s=1.0) is not None

    def alerts(self) -> list[dict[str, Any]]:
        """The alerts Alertmanager holds now (API v2), with their inhibited/silenced status."""
        body = http_get(f"{self.url}/api/v2/alerts", timeout_s=5.0)
        return json.loads(body) if body else []

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

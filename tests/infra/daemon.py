"""The one way the tests run a packaged daemon (Debian's prometheus, prometheus-alertmanager): the
binary installed on first use by tests/infra/prometheus.sh, its own process with a private config and
storage on a free loopback port, ready when its ``/-/ready`` answers, its log kept for a failure."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import TypeVar

from .net import free_port, http_get, wait_until

INSTALL_SCRIPT = Path(__file__).with_name("prometheus.sh")
D = TypeVar("D", bound="Daemon")


def ensure_binary(name: str, package: str) -> str:
    """Path of ``name``, installing Debian's ``package`` (with the other daemons') if it is missing."""
    binary = shutil.which(name)
    if binary is None:
        subprocess.run(["bash", str(INSTALL_SCRIPT)], check=True)
        binary = shutil.which(name)
    if binary is None:
        raise RuntimeError(f"{name} is not installed and {INSTALL_SCRIPT} could not install it; run it as "
                           f"root (apt-get install {package})")
    return binary


class Daemon:
    """One daemon process; subclasses say how it starts (:meth:`command`) from its config file."""

    name = "daemon"
    config_name = "config.yml"

    def __init__(self, workdir: Path, binary: str, port: int | None = None) -> None:
        self.workdir = workdir
        self.binary = binary
        self.port = port or free_port()
        self._proc: subprocess.Popen[bytes] | None = None
        self._log = workdir / f"{self.name}.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def config_text(self) -> str:
        raise NotImplementedError

    def command(self, config: Path) -> list[str]:
        raise NotImplementedError

    def start(self: D, timeout_s: float = 60.0) -> D:
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = self.workdir / self.config_name
        config.write_text(self.config_text())
        with open(self._log, "wb") as log:
            self._proc = subprocess.Popen(self.command(config), stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_until(self._ready, timeout_s, f"{self.name} ready on {self.url}", interval_s=0.1)
        except TimeoutError:
            self.stop()
            raise RuntimeError(f"{self.name} did not become ready; its log:\n{self.log()}") from None
        return self

    def _ready(self) -> bool:
        if self._proc is not None and self._proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited with {self._proc.returncode}; its log:\n{self.log()}")
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

    def __enter__(self: D) -> D:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

"""pytest plugin with the real-server fixtures; tests/conftest.py lists it in ``pytest_plugins``.

* ``prometheus_factory(targets, **kw) -> PrometheusServer`` starts a real Prometheus scraping the
  targets (installs Debian's package on first use if missing); stopped at test teardown.
* ``otlp_receiver`` is a running :class:`OtlpReceiver`; ``otlp_receiver_factory(**kw)`` makes more
  (slow or failing ones).
* ``free_port`` returns a free TCP port.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from .net import free_port as _free_port
from .otlp import OtlpReceiver
from .prom import PrometheusServer, ensure_prometheus


@pytest.fixture(scope="session")
def prometheus_binary() -> str:
    return ensure_prometheus()


@pytest.fixture
def prometheus_factory(prometheus_binary: str, tmp_path: Path) -> Iterator[Callable[..., PrometheusServer]]:
    servers: list[PrometheusServer] = []

    def start(targets: list[str], **kw: Any) -> PrometheusServer:
        workdir = tmp_path / f"prometheus{len(servers)}"
        server = PrometheusServer(targets, workdir, binary=prometheus_binary, **kw)
        servers.append(server)
        return server.start()

    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def otlp_receiver_factory() -> Iterator[Callable[..., OtlpReceiver]]:
    receivers: list[OtlpReceiver] = []

    def start(**kw: Any) -> OtlpReceiver:
        receiver = OtlpReceiver(**kw).start()
        receivers.append(receiver)
        return receiver

    yield start
    for receiver in receivers:
        receiver.stop()


@pytest.fixture
def otlp_receiver(otlp_receiver_factory: Callable[..., OtlpReceiver]) -> OtlpReceiver:
    return otlp_receiver_factory()


@pytest.fixture
def free_port() -> Callable[[], int]:
    return _free_port

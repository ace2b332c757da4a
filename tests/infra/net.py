"""Small networking helpers shared by the test servers."""

from __future__ import annotations

import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1 (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str, interval_s: float = 0.05) -> None:
    """Poll ``predicate`` until it holds; fail with ``what`` after ``timeout_s`` (a hang guard, not a
    speed assertion: the timeouts are generous)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(interval_s)


def http_get(url: str, timeout_s: float = 5.0) -> bytes | None:
    """GET ``url``; ``None`` on connection errors and non-2xx answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.read()
    except (urllib.error.URLError, OSError):
        return None

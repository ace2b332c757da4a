"""A real OTLP/HTTP traces receiver for tests: decodes ``ExportTraceServiceRequest`` protobufs.

It speaks the same wire protocol as an OpenTelemetry Collector's ``otlphttp`` receiver
(``POST /v1/traces``, ``application/x-protobuf``, optional gzip/deflate), so exporters under test go
through their real serialisation and HTTP code. ``hold()`` makes it a stalled collector (every
request waits until ``release()``), ``delay_s`` a slow one and ``status`` a failing one.
"""

from __future__ import annotations

import gzip
import threading
import time
import zlib
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from .net import wait_until


def any_value(v: AnyValue) -> Any:
    """An OTLP AnyValue as a plain Python value (arrays as lists, kvlists as dicts)."""
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [any_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return attributes(v.kvlist_value.values)
    return None if kind is None else getattr(v, kind)


def attributes(kvs: Any) -> dict[str, Any]:
    """Repeated OTLP KeyValues as a dict."""
    return {kv.key: any_value(kv.value) for kv in kvs}


@dataclass
class Event:
    name: str
    time_unix_ns: int
    attributes: dict[str, Any]


@dataclass
class Link:
    trace_id: str
    span_id: str
    attributes: dict[str, Any]


@dataclass
class Span:
    """One received span, flattened with its resource and instrumentation scope."""

    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    start_unix_ns: int
    end_unix_ns: int
    attributes: dict[str, Any]
    resource: dict[str, Any]
    scope: str
    events: list[Event] = field(default_factory=list)
    links: list[Link] = field(default_factory=list)


class OtlpReceiver:
    """OTLP/HTTP receiver on 127.0.0.1:``port`` (0: a free one). Use as a context manager."""

    def __init__(self, port: int = 0, *, delay_s: float = 0.0, status: int = 200) -> None:
        self.delay_s = delay_s
        self.status = status
        self.requests = 0
        self._released = threading.Event()
        self._released.set()
        self._spans: list[Span] = []
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", port), self._handler())
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True,
                                        name="otlp-receiver")

    @property
    def endpoint(self) -> str:
        """The traces URL, as ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` wants it."""
        return f"http://127.0.0.1:{self.port}/v1/traces"

    def start(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def hold(self) -> None:
        """Stall: requests from now on get no answer until :meth:`release`."""
        self._released.clear()

    def release(self) -> None:
        self._released.set()

    def stop(self) -> None:
        self.release()
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> OtlpReceiver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def spans(self, name: str | None = None) -> list[Span]:
        with self._lock:
            return [s for s in self._spans if name is None or s.name == name]

    def wait_for_spans(self, count: int, name: str | None = None, timeout_s: float = 30.0) -> list[Span]:
        wait_until(lambda: len(self.spans(name)) >= count, timeout_s,
                   f"{count} span(s) named {name or '*'} at the OTLP receiver")
        return self.spans(name)

    def _ingest(self, body: bytes) -> None:
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        received = []
        for rs in request.resource_spans:
            resource = attributes(rs.resource.attributes)
            for ss in rs.scope_spans:
                for s in ss.spans:
                    received.append(Span(
                        name=s.name, trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
                        parent_span_id=s.parent_span_id.hex(), start_unix_ns=s.start_time_unix_nano,
                        end_unix_ns=s.end_time_unix_nano, attributes=attributes(s.attributes),
                        resource=resource, scope=ss.scope.name,
                        events=[Event(e.name, e.time_unix_nano, attributes(e.attributes)) for e in s.events],
                        links=[Link(ln.trace_id.hex(), ln.span_id.hex(), attributes(ln.attributes))
                               for ln in s.links]))
        with self._lock:
            self._spans.extend(received)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                encoding = self.headers.get("Content-Encoding", "")
                if encoding == "gzip":
                    body = gzip.decompress(body)
                elif encoding == "deflate":
                    body = zlib.decompress(body)
                with receiver._lock:
                    receiver.requests += 1
                receiver._released.wait()
                if receiver.delay_s:
                    time.sleep(receiver.delay_s)
                if self.path != "/v1/traces":
                    self.send_error(404)
                    return
                if receiver.status != 200:
                    self.send_error(receiver.status)
                    return
                receiver._ingest(body)
                out = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, format: str, *args: Any) -> None:  # quiet test output
                pass

        return Handler

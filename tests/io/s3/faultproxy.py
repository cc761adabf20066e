"""A small HTTP proxy on loopback between s3fs and the S3 server: counts bytes, injects faults.

Every request is forwarded to the upstream server (moto) unless a fault rule matches it first:

- `slowdown`: answer 503 `SlowDown`, as S3 does when throttling;
- `internal`: answer 500 `InternalError`;
- `deny`: answer 403 `AccessDenied` (a permanent error);
- `reset`: forward, send the headers and half the body, then reset the connection;
- `stall`: hold the request for `stall_seconds` without answering, then drop it (a timeout);
- `latency`: wait `latency_seconds`, then forward normally (a slow link, to widen a window).

Rules fire a bounded number of times; the proxy refuses to run past `max_requests` or
`max_seconds`, so a test that loops cannot hang. It records, per request, the method, the
path, the status and the body bytes it sent back, which is what the byte-count test reads.
"""

from __future__ import annotations

import contextlib
import http.client
import re
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

_HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length", "expect"}

_ERROR_BODIES = {
    "slowdown": (503, "SlowDown", "Please reduce your request rate."),
    "internal": (500, "InternalError", "We encountered an internal error. Please try again."),
    "deny": (403, "AccessDenied", "Access Denied"),
}


@dataclass
class Fault:
    """Inject `kind` into the next `times` requests whose method and path match."""

    kind: str
    method: str = "GET"
    path: str = ".*"
    """Regex searched in the request's decoded path (`/bucket/key`)."""
    times: int = 1
    query: str | None = None
    """Regex searched in the query string (e.g. `uploadId` for multipart calls)."""
    ranged_only: bool = False
    """Only requests with a `Range` header."""
    fired: int = 0

    def matches(self, method: str, path: str, query: str, has_range: bool) -> bool:
        if self.fired >= self.times or method != self.method:
            return False
        if self.ranged_only and not has_range:
            return False
        if self.query is not None and not re.search(self.query, query):
            return False
        return re.search(self.path, path) is not None


@dataclass(frozen=True)
class Exchange:
    method: str
    path: str
    query: str
    range: str | None
    status: int
    body_bytes: int
    fault: str | None


@dataclass
class FaultProxy:
    """The proxy; start with `start()`, stop with `stop()`. `url` is its endpoint."""

    upstream_port: int
    stall_seconds: float = 3.0
    latency_seconds: float = 0.3
    max_requests: int = 20_000
    max_seconds: float = 600.0
    faults: list[Fault] = field(default_factory=list)
    log: list[Exchange] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._started = 0.0
        self._count = 0
        self._ranged_in_flight = 0
        self.peak_ranged_in_flight = 0
        self._connections: set[socket.socket] = set()

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> FaultProxy:
        proxy = self

        class Handler(_Handler):
            owner = proxy

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._started = time.monotonic()
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        with self._lock:  # keep-alive connections would go on serving: cut them
            connections, self._connections = list(self._connections), set()
        for conn in connections:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    def add(self, *faults: Fault) -> None:
        with self._lock:
            self.faults.extend(faults)

    def clear(self) -> None:
        with self._lock:
            self.faults.clear()
            self.log.clear()
            self.peak_ranged_in_flight = 0

    def _pick_fault(self, method: str, path: str, query: str, has_range: bool) -> str | None:
        with self._lock:
            self._count += 1
            if self._count > self.max_requests:
                raise RuntimeError(f"fault proxy: more than {self.max_requests} requests")
            if time.monotonic() - self._started > self.max_seconds:
                raise RuntimeError(f"fault proxy: running for more than {self.max_seconds} s")
            for fault in self.faults:
                if fault.matches(method, path, query, has_range):
                    fault.fired += 1
                    return fault.kind
        return None

    def _enter(self, ranged: bool) -> None:
        if ranged:
            with self._lock:
                self._ranged_in_flight += 1
                self.peak_ranged_in_flight = max(self.peak_ranged_in_flight, self._ranged_in_flight)

    def _leave(self, ranged: bool) -> None:
        if ranged:
            with self._lock:
                self._ranged_in_flight -= 1

    def _record(self, exchange: Exchange) -> None:
        with self._lock:
            self.log.append(exchange)

    def faults_fired(self) -> dict[str, int]:
        with self._lock:
            out: dict[str, int] = {}
            for f in self.faults:
                out[f.kind] = out.get(f.kind, 0) + f.fired
            return out

    def body_bytes(self, method: str = "GET", path_prefix: str = "/") -> int:
        """Body bytes sent back for requests of `method` under `path_prefix` (decoded)."""
        with self._lock:
            return sum(
                e.body_bytes
                for e in self.log
                if e.method == method and e.path.startswith(path_prefix)
            )

    def requests(self, method: str | None = None, path_prefix: str = "/") -> list[Exchange]:
        with self._lock:
            return [
                e
                for e in self.log
                if (method is None or e.method == method) and e.path.startswith(path_prefix)
            ]


class _Handler(BaseHTTPRequestHandler):
    owner: FaultProxy
    protocol_version = "HTTP/1.1"
    _upstream: http.client.HTTPConnection | None = None

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - base signature
        pass

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _forward(self, body: bytes) -> tuple[int, list[tuple[str, str]], bytes]:
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_HEADERS}
        if body or self.command in ("PUT", "POST"):
            headers["Content-Length"] = str(len(body))
        for attempt in range(2):
            if self._upstream is None:
                self._upstream = http.client.HTTPConnection(
                    "127.0.0.1", self.owner.upstream_port, timeout=60
                )
            try:
                self._upstream.request(self.command, self.path, body=body, headers=headers)
                resp = self._upstream.getresponse()
                data = resp.read()
                return resp.status, resp.getheaders(), data
            except (ConnectionError, http.client.HTTPException, OSError):
                self._upstream.close()
                self._upstream = None
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def _send_error_xml(self, kind: str, path: str, query: str) -> None:
        status, code, message = _ERROR_BODIES[kind]
        body = (
            '<?xml version="1.0" encoding="UTF-8"?>\n'
            f"<Error><Code>{code}</Code><Message>{message}</Message>"
            f"<Resource>{path}</Resource><RequestId>faultproxy</RequestId></Error>"
        ).encode()
        sent = 0 if self.command == "HEAD" else len(body)
        self._record(path, query, status, sent, kind)
        self.send_response(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _record(self, path: str, query: str, status: int, sent: int, fault: str | None) -> None:
        """Log an exchange before its response goes out: a client that has its answer must
        find the exchange logged."""
        self.owner._record(
            Exchange(self.command, path, query, self.headers.get("Range"), status, sent, fault)
        )

    def _reset(self) -> None:
        self.wfile.flush()
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.connection.close()
        self.close_connection = True

    def setup(self) -> None:
        super().setup()
        with self.owner._lock:
            self.owner._connections.add(self.connection)

    def finish(self) -> None:
        with self.owner._lock:
            self.owner._connections.discard(self.connection)
        super().finish()

    def _handle(self) -> None:
        ranged = self.command == "GET" and "Range" in self.headers
        self.owner._enter(ranged)
        try:
            self._handle_one()
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the client went away (a killed run)
        finally:
            self.owner._leave(ranged)

    def _handle_one(self) -> None:
        parts = urlsplit(self.path)
        path, query = unquote(parts.path), parts.query
        has_range = "Range" in self.headers
        body = self._read_body()
        fault = self.owner._pick_fault(self.command, path, query, has_range)
        if fault in _ERROR_BODIES:
            self._send_error_xml(fault, path, query)
            return
        if fault == "stall":
            time.sleep(self.owner.stall_seconds)
            self._record(path, query, 0, 0, fault)
            self._reset()
            return
        if fault == "latency":
            time.sleep(self.owner.latency_seconds)
        status, headers, data = self._forward(body)
        reset = fault == "reset" and self.command != "HEAD" and len(data) > 1
        sent = 0 if self.command == "HEAD" else len(data) // 2 if reset else len(data)
        self._record(path, query, status, sent, fault)
        self.send_response(status)
        for key, value in headers:
            if key.lower() in _HOP_HEADERS and not (
                self.command == "HEAD" and key.lower() == "content-length"
            ):
                continue
            self.send_header(key, value)
        if self.command != "HEAD":
            self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if reset:
            self.wfile.write(data[:sent])
            self._reset()
        elif self.command != "HEAD":
            self.wfile.write(data)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

"""The loopback HTTP server shared by the fake providers.

A ``FakeProviderServer`` binds 127.0.0.1 on an ephemeral port, serves from a
daemon thread, records every request (secrets removed) and answers each
endpoint from a queue of scripted replies. Subclasses supply the wire format:
routing, validation, rendering of scripted replies and error bodies.
"""

from __future__ import annotations

import contextlib
import json
import math
import secrets
import socket
import threading
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import MappingProxyType, TracebackType
from typing import Any, ClassVar, Literal, Self
from urllib.parse import parse_qsl, urlsplit

from touba.testing.fakes._ledger import IssueLedger

__all__ = [
    "SIGN",
    "CountTokens",
    "FakeProviderServer",
    "JSONObject",
    "RecordedRequest",
    "Rejection",
    "Reply",
    "Scripted",
    "canonical_json",
    "estimate_tokens",
    "json_type_name",
    "new_id",
]

JSONObject = dict[str, Any]
CountTokens = Callable[[JSONObject], int]

SIGN = "<touba-fake:sign>"
"""Placeholder for opaque provider data: the server replaces it with a token it issues."""

_SECRET_HEADERS = frozenset(
    {"authorization", "proxy-authorization", "x-api-key", "x-goog-api-key", "api-key", "cookie"}
)
_SECRET_QUERY = frozenset({"key", "api_key", "api-key"})


def canonical_json(value: object) -> str:
    """Compact JSON with sorted keys: the measure used for deterministic token counts."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def estimate_tokens(body: JSONObject) -> int:
    """Default token count of a request body: ``ceil(len(canonical_json(body)) / 4)``."""
    return math.ceil(len(canonical_json(body)) / 4)


def new_id(prefix: str) -> str:
    """A fresh provider-looking id such as ``rs_0f3a...``."""
    return f"{prefix}{secrets.token_hex(12)}"


def json_type_name(value: object) -> str:
    """JSON type name of a decoded value, as providers word it in errors."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


@dataclass(frozen=True)
class Rejection:
    """One reason a request is refused, with the HTTP status the provider answers."""

    status: int
    message: str
    param: str | None = None
    code: str | None = None

    def __str__(self) -> str:
        return self.message


@dataclass(frozen=True)
class RecordedRequest:
    """A request the fake received, as answered (auth headers and key params removed)."""

    method: str
    path: str
    endpoint: str | None
    headers: Mapping[str, str]
    query: Mapping[str, str]
    body: Any
    status: int


@dataclass(frozen=True)
class Reply:
    """An HTTP answer: status, JSON body, extra headers, and a delay before sending."""

    status: int
    body: object
    headers: Mapping[str, str] = field(default_factory=dict)
    delay: float = 0.0


@dataclass(frozen=True)
class Scripted:
    """A queued answer: a literal reply, a generation to render, or a token count."""

    kind: Literal["reply", "generation", "count"]
    payload: Any
    delay: float = 0.0


class _HTTPServer(ThreadingHTTPServer):
    """Keeps connections alive (HTTP/1.1), as a vendor's API does; ``close_clients``
    ends the idle ones so that closing the server never waits for a client."""

    daemon_threads = False
    block_on_close = True

    def __init__(self, fake: FakeProviderServer) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.fake = fake
        self._clients: set[socket.socket] = set()
        self._clients_lock = threading.Lock()

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        with self._clients_lock:
            self._clients.add(request)
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._clients_lock:
                self._clients.discard(request)

    def close_clients(self) -> None:
        """Shut every open connection down: a handler waiting for the next request
        on a kept-alive connection reads end of file and returns."""
        with self._clients_lock:
            clients = list(self._clients)
        for client in clients:
            with contextlib.suppress(OSError):  # already closed by the client
                client.shutdown(socket.SHUT_RDWR)

    def handle_error(self, request: object, client_address: object) -> None:
        """Client disconnects are expected (timeouts in tests): stay quiet."""


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = 30
    # Headers and body leave in two writes: without TCP_NODELAY the second waits for
    # the client's delayed ACK (40 ms) on a kept-alive connection.
    disable_nagle_algorithm = True
    server: _HTTPServer

    def do_GET(self) -> None:
        self._serve("GET")

    def do_POST(self) -> None:
        self._serve("POST")

    def _serve(self, method: str) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length > 0 else b""
        headers = {key.lower(): value for key, value in self.headers.items()}
        fake = self.server.fake
        reply = fake._handle(method, self.path, headers, raw)
        if reply.delay > 0 and fake._closing.wait(reply.delay):
            self.close_connection = True
            return
        data = json.dumps(reply.body).encode()
        self.send_response(reply.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if not fake.keep_alive or fake._closing.is_set():
            self.send_header("Connection", "close")
            self.close_connection = True
        for key, value in reply.headers.items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        """Silence the per-request stderr log."""


class FakeProviderServer:
    """Base of the fake provider servers: lifecycle, recording and reply queues.

    Use as a context manager (``with FakeOpenAIServer() as srv:``) or call
    ``start()``/``close()``. Unscripted generations answer 500; unscripted
    counts answer ``count_tokens(body)`` (default :func:`estimate_tokens`).
    ``validate=False`` turns the wire validators off. ``keep_alive=True`` keeps
    each client connection open between requests, as a vendor's API does (what a
    benchmark of the request path wants); by default every answer closes its
    connection, so a test that never closes its SDK client leaks no socket.
    """

    provider: ClassVar[str]
    endpoints: ClassVar[tuple[str, ...]]
    generation_endpoint: ClassVar[str]
    count_endpoint: ClassVar[str]

    def __init__(
        self,
        *,
        count_tokens: CountTokens | None = None,
        validate: bool = True,
        keep_alive: bool = False,
        secret: bytes | None = None,
    ) -> None:
        self.count_tokens: CountTokens = count_tokens or estimate_tokens
        self.validate = validate
        self.keep_alive = keep_alive
        self.ledger = IssueLedger(secret)
        self._lock = threading.Lock()
        self._queues: dict[str, deque[Scripted]] = {name: deque() for name in self.endpoints}
        self._requests: list[RecordedRequest] = []
        self._httpd: _HTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._closing = threading.Event()

    # lifecycle -----------------------------------------------------------

    def start(self) -> Self:
        """Bind 127.0.0.1 on a free port and serve from a daemon thread."""
        if self._httpd is not None or self._closing.is_set():
            raise RuntimeError(f"{type(self).__name__} can be started only once")
        self._httpd = _HTTPServer(self)
        self._thread = threading.Thread(
            target=self._httpd.serve_forever,
            kwargs={"poll_interval": 0.05},
            name=f"{type(self).__name__}:{self._httpd.server_address[1]}",
            daemon=True,
        )
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop serving, wake delayed replies, close the socket and join threads."""
        self._closing.set()
        httpd, self._httpd = self._httpd, None
        if httpd is None:
            return
        httpd.shutdown()
        httpd.close_clients()
        httpd.server_close()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:<port>`` (no trailing slash, no API version)."""
        if self._httpd is None:
            raise RuntimeError(f"{type(self).__name__} is not running: call start() first")
        host, port = self._httpd.server_address[:2]
        return f"http://{host!s}:{port}"

    # recording -----------------------------------------------------------

    @property
    def requests(self) -> list[RecordedRequest]:
        """A copy of every request received so far, oldest first."""
        with self._lock:
            return list(self._requests)

    def requests_to(self, endpoint: str) -> list[RecordedRequest]:
        """The recorded requests routed to ``endpoint``."""
        self._check_endpoint(endpoint)
        return [request for request in self.requests if request.endpoint == endpoint]

    def pending(self, endpoint: str | None = None) -> int:
        """How many scripted replies are still queued (for one endpoint, or all)."""
        with self._lock:
            if endpoint is None:
                return sum(len(queue) for queue in self._queues.values())
            self._check_endpoint(endpoint)
            return len(self._queues[endpoint])

    # scripting -----------------------------------------------------------

    def script_error(
        self,
        status: int,
        message: str | None = None,
        *,
        endpoint: str | None = None,
        delay: float = 0.0,
    ) -> None:
        """Answer the next request to ``endpoint`` with the provider's error body."""
        target = endpoint or self.generation_endpoint
        body = self.error_body(Rejection(status, message or self.default_error_message(status)))
        self._enqueue(target, Scripted("reply", Reply(status, body, self.error_headers())), delay)

    def script_count(self, value: int | None, *, delay: float = 0.0) -> None:
        """Answer the next count request with ``value`` tokens (None: omit the field)."""
        self._enqueue(self.count_endpoint, Scripted("count", value), delay)

    def script_raw(
        self,
        status: int,
        body: object,
        *,
        endpoint: str | None = None,
        headers: Mapping[str, str] | None = None,
        delay: float = 0.0,
    ) -> None:
        """Answer the next request to ``endpoint`` with exactly this status and JSON body."""
        target = endpoint or self.generation_endpoint
        self._enqueue(target, Scripted("reply", Reply(status, body, dict(headers or {}))), delay)

    def _enqueue(self, endpoint: str, item: Scripted, delay: float = 0.0) -> None:
        self._check_endpoint(endpoint)
        if delay:
            item = Scripted(item.kind, item.payload, delay)
        with self._lock:
            self._queues[endpoint].append(item)

    def _check_endpoint(self, endpoint: str) -> None:
        if endpoint not in self.endpoints:
            raise ValueError(
                f"unknown endpoint {endpoint!r} for {type(self).__name__}; "
                f"use one of {', '.join(self.endpoints)}"
            )

    # provider hooks ------------------------------------------------------

    def route(self, method: str, path: str) -> str | None:
        """The endpoint name serving ``method path``, or None (404)."""
        raise NotImplementedError

    def check(
        self, endpoint: str, path: str, headers: Mapping[str, str], body: JSONObject
    ) -> list[Rejection]:
        """Everything the real API would refuse in this request, first reported first."""
        raise NotImplementedError

    def render_generation(self, endpoint: str, path: str, payload: Any, body: JSONObject) -> Reply:
        """Turn a scripted generation into the provider's response, issuing tokens."""
        raise NotImplementedError

    def render_count(self, value: int | None, body: JSONObject) -> JSONObject:
        """The count endpoint's body for ``value`` tokens (None: field missing)."""
        raise NotImplementedError

    def error_body(self, rejection: Rejection) -> JSONObject:
        """The provider's error JSON for ``rejection``."""
        raise NotImplementedError

    def default_error_message(self, status: int) -> str:
        """The provider's usual message for ``status``."""
        raise NotImplementedError

    def error_headers(self) -> dict[str, str]:
        """Headers sent with every error (request ids and the like)."""
        return {}

    # request handling ----------------------------------------------------

    def _handle(self, method: str, raw_path: str, headers: dict[str, str], raw: bytes) -> Reply:
        split = urlsplit(raw_path)
        path = split.path
        query = {k: v for k, v in parse_qsl(split.query) if k.lower() not in _SECRET_QUERY}
        endpoint = self.route(method, path)
        body: Any = None
        if raw:
            try:
                body = json.loads(raw)
            except ValueError:
                body = None
        try:
            reply = self._answer(endpoint, path, headers, raw, body)
        except Exception as exc:  # a bug in a scripted callable must not hang the client
            reply = self._error(Rejection(500, f"{type(self).__name__} failed: {exc!r}"))
        recorded = RecordedRequest(
            method=method,
            path=path,
            endpoint=endpoint,
            headers=MappingProxyType(
                {k: v for k, v in headers.items() if k not in _SECRET_HEADERS}
            ),
            query=MappingProxyType(query),
            body=body,
            status=reply.status,
        )
        with self._lock:
            self._requests.append(recorded)
        return reply

    def _answer(
        self,
        endpoint: str | None,
        path: str,
        headers: Mapping[str, str],
        raw: bytes,
        body: Any,
    ) -> Reply:
        if endpoint is None:
            return self._error(Rejection(404, f"{type(self).__name__} has no route for {path}"))
        if not isinstance(body, dict):
            problem = "We could not parse the JSON body of your request."
            return self._error(Rejection(400, problem if raw else "Request body is required."))
        if body.get("stream") is True:
            message = (
                f"{type(self).__name__} supports only non-streaming requests; "
                "send stream=false (streaming is not implemented by the fake)."
            )
            return self._error(Rejection(400, message, param="stream"))
        if self.validate:
            problems = self.check(endpoint, path, headers, body)
            if problems:
                return self._error(problems[0])
        with self._lock:
            queue = self._queues[endpoint]
            scripted = queue.popleft() if queue else None
        if scripted is None:
            if endpoint == self.count_endpoint:
                return Reply(200, self.render_count(self.count_tokens(body), body))
            message = (
                f"{type(self).__name__}: no scripted reply left for {endpoint}; "
                "queue one with script_response() or script_error()."
            )
            return self._error(Rejection(500, message))
        if scripted.kind == "reply":
            reply: Reply = scripted.payload
        elif scripted.kind == "count":
            reply = Reply(200, self.render_count(scripted.payload, body))
        else:
            reply = self.render_generation(endpoint, path, scripted.payload, body)
        if scripted.delay:
            reply = Reply(reply.status, reply.body, reply.headers, scripted.delay)
        return reply

    def _error(self, rejection: Rejection) -> Reply:
        return Reply(rejection.status, self.error_body(rejection), self.error_headers())

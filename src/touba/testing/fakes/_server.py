"""The loopback HTTP server shared by the fake providers.

A ``FakeProviderServer`` binds 127.0.0.1 on an ephemeral port, serves from a
daemon thread, records every request (secrets removed) and answers each
endpoint from a queue of scripted replies. Subclasses supply the wire format:
routing, validation, rendering of scripted replies and error bodies, and how
a rendered answer is sent as server-sent events when the request streams.

Streaming. A scripted generation is rendered once, as the non-streaming
answer; a streaming request gets that very answer as the vendor's event
sequence (chunked transfer encoding, one event per chunk), so the client
assembles it back. :class:`StreamKnobs` (per scripted reply, or the server's
``stream_knobs``) delays events, cuts the connection after k events (no
terminating chunk: the client sees a broken body), ends the body cleanly
after k events, sends the vendor's in-stream error event, or inserts raw
events. Each stream is recorded (``srv.streams``): how many events were
sent, how it ended, and when the fake saw the client close the connection.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import secrets
import select
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
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
    "StreamKnobs",
    "StreamRecord",
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
class StreamKnobs:
    """How a fake sends a streamed answer (ignored when the request does not stream).

    ``event_delay``: seconds before each event after the first.
    ``cut_after``: drop the connection after this many events, without ending
    the body (the SDK sees a broken stream: a connection error).
    ``end_after``: end the body cleanly after this many events (a stream that
    stops before its final event).
    ``fail_after``: after this many events, send the vendor's in-stream error
    event (``failure`` picks which where the vendor has several: OpenAI
    Responses ``"error"`` or ``"response.failed"``; Anthropic an error type
    such as ``"overloaded_error"``), then end the body.
    ``insert``: raw events ``(position, event name or None, data)`` sent
    before the event at that position (an event type from a newer API...).
    """

    event_delay: float = 0.0
    cut_after: int | None = None
    end_after: int | None = None
    fail_after: int | None = None
    failure: str | None = None
    insert: tuple[tuple[int, str | None, object], ...] = ()


@dataclass(frozen=True)
class StreamRecord:
    """One streamed answer, as the fake sent it.

    ``outcome``: ``"streaming"`` while it runs, then ``"completed"``, ``"cut"``,
    ``"ended"`` (cleanly, early), ``"failed"`` (an error event) or
    ``"client_closed"`` (the fake saw the client close the connection: at
    ``closed_at``, a ``time.monotonic()`` reading). ``events``: how many
    events were written.
    """

    endpoint: str
    events: int
    outcome: str
    started_at: float
    closed_at: float | None = None


@dataclass(frozen=True)
class Reply:
    """An HTTP answer: status, JSON body, extra headers, and a delay before sending.

    ``events`` (a streamed answer): the ``(event name, data)`` pairs to send as
    server-sent events instead of ``body``, with ``knobs``.
    """

    status: int
    body: object
    headers: Mapping[str, str] = field(default_factory=dict)
    delay: float = 0.0
    events: tuple[tuple[str | None, object], ...] | None = None
    knobs: StreamKnobs | None = None
    endpoint: str | None = None


@dataclass(frozen=True)
class Scripted:
    """A queued answer: a literal reply, a generation to render, or a token count."""

    kind: Literal["reply", "generation", "count"]
    payload: Any
    delay: float = 0.0
    knobs: StreamKnobs | None = None


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
        if reply.events is not None:
            self._stream(reply)
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

    def _stream(self, reply: Reply) -> None:
        """Send ``reply.events`` as server-sent events, one chunk each, under its knobs."""
        fake = self.server.fake
        knobs = reply.knobs or StreamKnobs()
        events = list(reply.events or ())
        for position, name, data in sorted(knobs.insert, key=lambda e: e[0], reverse=True):
            events.insert(min(position, len(events)), (name, data))
        if knobs.fail_after is not None:
            events = [
                *events[: knobs.fail_after],
                fake.stream_failure(reply.endpoint or "", knobs.failure),
            ]
        record = fake._stream_started(reply.endpoint or "")
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        if not fake.keep_alive or fake._closing.is_set():
            self.send_header("Connection", "close")
            self.close_connection = True
        for key, value in reply.headers.items():
            self.send_header(key, value)
        self.end_headers()
        sent = 0
        outcome = "completed"
        try:
            for name, data in events:
                if knobs.cut_after is not None and sent >= knobs.cut_after:
                    outcome = "cut"
                    break
                if knobs.end_after is not None and sent >= knobs.end_after:
                    outcome = "ended"
                    break
                if sent and knobs.event_delay > 0 and self._client_closed(knobs.event_delay):
                    outcome = "client_closed"
                    break
                frame = fake.sse_frame(name, data)
                self.wfile.write(b"%x\r\n%s\r\n" % (len(frame), frame))
                self.wfile.flush()
                sent += 1
            else:
                if knobs.fail_after is not None:
                    outcome = "failed"
                frame = fake.sse_trailer(reply.endpoint or "")
                if frame:
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(frame), frame))
            if outcome == "cut":
                self.close_connection = True
                with contextlib.suppress(OSError):
                    self.connection.shutdown(socket.SHUT_RDWR)
            elif outcome != "client_closed":
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
        except OSError:  # the client went away while the fake wrote
            outcome = "client_closed"
        if outcome == "client_closed":
            self.close_connection = True
        fake._stream_finished(record, sent, outcome)

    def _client_closed(self, wait: float) -> bool:
        """Wait ``wait`` seconds (or until the fake closes), watching the socket: True
        as soon as the client has closed its end."""
        deadline = time.monotonic() + wait
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or self.server.fake._closing.is_set():
                return False
            readable, _, _ = select.select([self.connection], [], [], min(left, 0.05))
            if readable:
                try:
                    peeked = self.connection.recv(1, socket.MSG_PEEK)
                except OSError:
                    return True
                if not peeked:
                    return True


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
        seed: int | None = None,
        stream_knobs: StreamKnobs | None = None,
    ) -> None:
        self.count_tokens: CountTokens = count_tokens or estimate_tokens
        self.validate = validate
        self.keep_alive = keep_alive
        self.stream_knobs = stream_knobs or StreamKnobs()
        self._random = random.Random(seed) if seed is not None else None
        self.ledger = IssueLedger(secret, nonces=self._random)
        self._streams: list[StreamRecord] = []
        self._stream_changed = threading.Condition(threading.Lock())
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

    @property
    def streams(self) -> list[StreamRecord]:
        """Every streamed answer so far, oldest first (see :class:`StreamRecord`)."""
        with self._stream_changed:
            return list(self._streams)

    def wait_stream_end(self, index: int = -1, timeout: float = 5.0) -> StreamRecord:
        """The stream at ``index`` once it has ended (TimeoutError after ``timeout`` s)."""
        deadline = time.monotonic() + timeout
        with self._stream_changed:
            while True:
                if self._streams:
                    record = self._streams[index]
                    if record.outcome != "streaming":
                        return record
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("no streamed answer ended in time")
                self._stream_changed.wait(left)

    def _stream_started(self, endpoint: str) -> int:
        with self._stream_changed:
            self._streams.append(StreamRecord(endpoint, 0, "streaming", time.monotonic()))
            self._stream_changed.notify_all()
            return len(self._streams) - 1

    def _stream_finished(self, index: int, events: int, outcome: str) -> None:
        with self._stream_changed:
            started = self._streams[index].started_at
            closed = time.monotonic() if outcome == "client_closed" else None
            self._streams[index] = StreamRecord(
                self._streams[index].endpoint, events, outcome, started, closed
            )
            self._stream_changed.notify_all()

    def new_id(self, prefix: str) -> str:
        """A fresh provider-looking id (deterministic when the server has a ``seed``)."""
        if self._random is None:
            return new_id(prefix)
        with self._lock:
            return f"{prefix}{self._random.randbytes(12).hex()}"

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
        """Answer the next request to ``endpoint`` with the provider's error body (an HTTP
        error, before any event, also for a streaming request)."""
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
        """Answer the next request to ``endpoint`` with exactly this status and JSON body
        (a 200 body, to a streaming request: carried by the vendor's events)."""
        target = endpoint or self.generation_endpoint
        self._enqueue(target, Scripted("reply", Reply(status, body, dict(headers or {}))), delay)

    def _enqueue(self, endpoint: str, item: Scripted, delay: float = 0.0) -> None:
        self._check_endpoint(endpoint)
        if delay:
            item = Scripted(item.kind, item.payload, delay, item.knobs)
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

    def wants_stream(self, endpoint: str, path: str, body: JSONObject) -> bool:
        """Whether the request asks for a streamed answer (``"stream": true``)."""
        return body.get("stream") is True

    def stream_events(
        self, endpoint: str, answer: object, body: JSONObject
    ) -> list[tuple[str | None, object]]:
        """The vendor's event sequence carrying ``answer`` (the non-streaming body)."""
        raise NotImplementedError

    def stream_failure(self, endpoint: str, failure: str | None) -> tuple[str | None, object]:
        """The vendor's in-stream error event (``failure`` names a variant)."""
        raise NotImplementedError

    def sse_frame(self, name: str | None, data: object) -> bytes:
        """One server-sent event: ``event:`` (when named) and ``data:`` lines."""
        head = f"event: {name}\n" if name is not None else ""
        return f"{head}data: {json.dumps(data)}\n\n".encode()

    def sse_trailer(self, endpoint: str) -> bytes:
        """Bytes sent after the last event (Chat Completions: ``data: [DONE]``)."""
        return b""

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
            if reply.status == 200 and self.wants_stream(endpoint, path, body):
                reply = self._streamed(reply, endpoint, body, scripted.knobs)
        elif scripted.kind == "count":
            reply = Reply(200, self.render_count(scripted.payload, body))
        else:
            # rendered as the non-streaming answer (the stream flags do not count as input)
            plain = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
            reply = self.render_generation(endpoint, path, scripted.payload, plain)
            if reply.status == 200 and self.wants_stream(endpoint, path, body):
                reply = self._streamed(reply, endpoint, body, scripted.knobs)
        if scripted.delay:
            reply = replace(reply, delay=scripted.delay)
        return reply

    def _streamed(
        self, reply: Reply, endpoint: str, body: JSONObject, knobs: StreamKnobs | None
    ) -> Reply:
        """``reply`` (a 200 answer, rendered or raw) as the vendor's events; a raw body
        that is not an answer the events can carry goes out as it is."""
        try:
            events = tuple(self.stream_events(endpoint, reply.body, body))
        except (AssertionError, AttributeError, KeyError, IndexError, TypeError):
            return reply
        return replace(reply, events=events, knobs=knobs or self.stream_knobs, endpoint=endpoint)

    def _error(self, rejection: Rejection) -> Reply:
        return Reply(rejection.status, self.error_body(rejection), self.error_headers())

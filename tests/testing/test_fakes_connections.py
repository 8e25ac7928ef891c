"""The fake servers' connections: closed after each answer by default, kept alive on request."""

from __future__ import annotations

import http.client
import json
import time
from urllib.parse import urlsplit

from touba.testing.fakes import FakeOpenAIServer
from touba.testing.fakes._server import FakeProviderServer

BODY = json.dumps({"model": "m", "input": [{"role": "user", "content": "hi"}]})


def _connect(srv: FakeProviderServer) -> http.client.HTTPConnection:
    return http.client.HTTPConnection("127.0.0.1", urlsplit(srv.base_url).port, timeout=5)


def _post(conn: http.client.HTTPConnection) -> http.client.HTTPResponse:
    conn.request("POST", "/v1/responses/input_tokens", BODY, {"Content-Type": "application/json"})
    response = conn.getresponse()
    response.read()
    return response


def test_by_default_each_answer_closes_its_connection() -> None:
    with FakeOpenAIServer() as srv:
        conn = _connect(srv)
        response = _post(conn)
        assert response.status == 200
        assert response.getheader("Connection") == "close"
        conn.close()


def test_keep_alive_serves_requests_on_one_connection_and_closes_promptly() -> None:
    srv = FakeOpenAIServer(keep_alive=True).start()
    conn = _connect(srv)
    first = _post(conn)
    socket_used = conn.sock
    second = _post(conn)
    assert (first.status, second.status) == (200, 200)
    assert first.getheader("Connection") is None
    assert conn.sock is socket_used  # the same TCP connection served both
    # The client keeps its connection open: closing the server must not wait for it
    # (a handler waiting for the next request would otherwise block close() for its
    # 30 s timeout).
    started = time.monotonic()
    srv.close()
    assert time.monotonic() - started < 10
    conn.close()

"""Request bodies are bounded before anything parses them (issue 29, item 7d).

A POST /login with the panel's own Origin and no session used to be parsed whole before
the token was checked (+203 MB resident for a 200 MB body). Now a body is refused with
413 by its Content-Length before a byte is read, or, sent chunked, as soon as it passes
the limit: a few KiB before login, 1 MiB for a form after it.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.panel._serve import serve
from tests.panel.conftest import ORIGIN, TOKEN, csrf_of, post
from touba.history.sqlite import SqliteHistoryStore
from touba.memory import SqliteMemoryStore
from touba.panel._limits import FORM_BODY_BYTES, LOGIN_BODY_BYTES

CHUNK = 64 * 1024


class Counted:
    """A chunked body of ``total`` bytes that counts how much of it was taken."""

    def __init__(self, total: int, field: bytes = b"token=") -> None:
        self.total = total
        self.field = field
        self.sent = 0

    def __iter__(self) -> Iterator[bytes]:
        yield self.field
        self.sent = len(self.field)
        while self.sent < self.total:
            self.sent += CHUNK
            yield b"x" * CHUNK


def _form(client: TestClient, path: str, body: Any, **headers: str) -> Any:
    return client.post(
        path,
        content=body,
        headers={**ORIGIN, "content-type": "application/x-www-form-urlencoded", **headers},
    )


def test_a_login_body_above_the_limit_is_refused_by_its_length_before_it_is_read(
    anonymous: TestClient,
) -> None:
    body = Counted(200 * 1024 * 1024)
    response = _form(anonymous, "/login", body, **{"content-length": str(body.total)})
    assert response.status_code == 413
    assert "before login" in response.text
    assert body.sent == 0  # not a byte taken
    assert "touba_panel" not in response.headers.get("set-cookie", "")


async def _asgi_post(app: Any, path: str, body: Counted, cookie: str = "") -> int:
    """POST ``body`` chunked straight into the ASGI app, as a server would hand it over
    (no Content-Length); returns the response status. ``body.sent`` tells how much of it
    the app asked for."""
    chunks = iter(body)
    statuses: list[int] = []
    headers = [
        (b"host", b"127.0.0.1:8765"),
        (b"origin", ORIGIN["origin"].encode()),
        (b"content-type", b"application/x-www-form-urlencoded"),
        (b"transfer-encoding", b"chunked"),
    ]
    if cookie:
        headers.append((b"cookie", cookie.encode()))
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": headers,
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8765),
    }

    async def receive() -> dict[str, Any]:
        chunk = next(chunks, None)
        if chunk is None:
            return {"type": "http.request", "body": b"", "more_body": False}
        return {"type": "http.request", "body": chunk, "more_body": True}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            statuses.append(message["status"])

    await app(scope, receive, send)
    return statuses[0]


async def test_a_chunked_login_body_is_refused_once_it_passes_the_limit(app: Any) -> None:
    body = Counted(200 * 1024 * 1024)
    assert await _asgi_post(app, "/login", body) == 413
    assert body.sent <= LOGIN_BODY_BYTES + CHUNK  # the limit and the chunk that passed it


async def test_a_chunked_login_body_within_the_limit_logs_in(app: Any) -> None:
    body = Counted(0, field=f"token={TOKEN}".encode())
    assert await _asgi_post(app, "/login", body) == 303


def test_the_login_form_itself_still_works(anonymous: TestClient) -> None:
    response = _form(anonymous, "/login", f"token={TOKEN}".encode())
    assert response.status_code == 303
    assert "touba_panel" in response.headers["set-cookie"]


async def test_a_logged_in_form_has_its_own_larger_limit(
    app: Any, client: TestClient, memory: SqliteMemoryStore
) -> None:
    csrf = csrf_of(client)
    # Larger than the login limit, well within the form limit: accepted (a preview turn).
    text = "a" * (LOGIN_BODY_BYTES * 4)
    response = post(client, "/agents/support/preview", {"message": text})
    assert response.status_code in (200, 303), response.text
    # Above the form limit, chunked: refused, and only the limit was read.
    cookie = f"touba_panel={client.cookies['touba_panel']}"
    body = Counted(8 * FORM_BODY_BYTES, field=f"csrf={csrf}&message=".encode())
    assert await _asgi_post(app, "/agents/support/preview", body, cookie) == 413
    assert body.sent <= FORM_BODY_BYTES + CHUNK
    declared = 2 * FORM_BODY_BYTES
    refused = _form(client, "/event/edit", b"", **{"content-length": str(declared)})
    assert refused.status_code == 413


def test_a_malformed_content_length_is_refused(anonymous: TestClient) -> None:
    response = _form(anonymous, "/login", b"token=x", **{"content-length": "12abc"})
    assert response.status_code in (400, 413)


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


@pytest.fixture
async def files(private_dir: Path) -> Path:
    async with SqliteMemoryStore(private_dir / "memory.sqlite"):
        pass
    async with SqliteHistoryStore(private_dir / "history.sqlite"):
        pass
    return private_dir


def _send_unbounded(base: str, path: str, total: int, *, chunked: bool) -> bytes:
    """POST ``total`` bytes of form to a served panel over a raw socket, until the panel
    answers or closes; returns the status line."""
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        length = "transfer-encoding: chunked" if chunked else f"content-length: {total}"
        head = (
            f"POST {path} HTTP/1.1\r\nhost: {host}:{port}\r\norigin: {base}\r\n"
            f"content-type: application/x-www-form-urlencoded\r\n{length}\r\n\r\n"
        )
        sock.sendall(head.encode())
        sent, chunk = 0, b"token=" + b"x" * (1024 * 1024 - 6)
        sock.settimeout(0.05)
        reply = b""
        deadline = time.monotonic() + 30
        while sent < total and time.monotonic() < deadline:
            try:
                data = chunk if not chunked else b"%x\r\n%s\r\n" % (len(chunk), chunk)
                sock.sendall(data)
                sent += len(chunk)
            except (BrokenPipeError, ConnectionResetError, TimeoutError):
                break
            try:
                reply += sock.recv(4096)
                if reply:
                    break
            except TimeoutError:
                continue
        sock.settimeout(10)
        while b"\r\n" not in reply:
            try:
                more = sock.recv(4096)
            except (ConnectionResetError, TimeoutError):
                break
            if not more:
                break
            reply += more
        return reply.split(b"\r\n", 1)[0]


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_served_panel_does_not_grow_on_a_200_mb_login_body(files: Path, chunked: bool) -> None:
    args = ["--db", "memory.sqlite", "--history-db", "history.sqlite", "--program", "demo"]
    with serve(args, files) as served:
        pid = served.process.pid
        before = _rss_kib(pid)
        status = _send_unbounded(served.base, "/login", 200 * 1024 * 1024, chunked=chunked)
        after = _rss_kib(pid)
    assert b" 413 " in status + b" ", status
    assert after - before < 16 * 1024, f"the panel grew by {after - before} KiB"

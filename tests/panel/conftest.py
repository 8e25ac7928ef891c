"""Fixtures of the panel tests: real stores in a private tmp dir, the app, a logged-in client.

The app is driven through Starlette's TestClient (HTTP through the whole ASGI
stack) with ``Host: 127.0.0.1:8765`` and, on POSTs, the panel's own
``Origin``, as a browser on the panel's pages would send them.
"""

from __future__ import annotations

import os
import re
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from touba.cli._demo_program import build_program
from touba.history.sqlite import SqliteHistoryStore
from touba.memory import SqliteMemoryStore
from touba.panel import create_app
from touba.runtime import Program

TOKEN = "test-token-0123456789abcdef"
BASE = "http://127.0.0.1:8765"
ORIGIN = {"origin": BASE}
_CSRF = re.compile(r'name="csrf" value="([^"]+)"')


@pytest.fixture
def private_dir(private_dir: Path, tmp_path: Path) -> Path:
    os.chmod(tmp_path, 0o700)  # its parent closed too
    return private_dir


@pytest.fixture
async def memory(private_dir: Path) -> AsyncIterator[SqliteMemoryStore]:
    async with SqliteMemoryStore(private_dir / "memory.sqlite") as store:
        yield store


@pytest.fixture
async def history(private_dir: Path) -> AsyncIterator[SqliteHistoryStore]:
    async with SqliteHistoryStore(private_dir / "history.sqlite") as store:
        yield store


@pytest.fixture
def program() -> Program:
    return build_program()


@pytest.fixture
def app(program: Program, memory: SqliteMemoryStore, history: SqliteHistoryStore) -> Any:
    return create_app(program, memory, history, token=TOKEN)


@pytest.fixture
def anonymous(app: Any) -> Iterator[TestClient]:
    """A client that never logged in."""
    with TestClient(app, base_url=BASE, follow_redirects=False) as client:
        yield client


@pytest.fixture
def client(app: Any) -> Iterator[TestClient]:
    """A client logged in with the token (cookie set)."""
    with TestClient(app, base_url=BASE, follow_redirects=False) as client:
        response = client.get(f"/?token={TOKEN}")
        assert response.status_code == 303
        yield client


def csrf_of(client: TestClient, path: str = "/") -> str:
    """The session's CSRF token, as a page's forms carry it."""
    page = client.get(path)
    assert page.status_code == 200, page.text
    found = _CSRF.search(page.text)
    assert found is not None
    return found.group(1)


def post(client: TestClient, path: str, data: dict[str, str], **headers: str) -> Any:
    """A form POST from the panel's own page: its CSRF token and Origin."""
    form = {"csrf": csrf_of(client), **data}
    return client.post(path, data=form, headers={**ORIGIN, **headers})

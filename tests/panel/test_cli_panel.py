"""``touba panel`` from the command line: options, refusals, a real server on a free port."""

from __future__ import annotations

import http.client
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from typer.testing import CliRunner

from tests._services import postgres_dsn
from tests.memory.conftest import drop_postgres_tables
from tests.panel._data import seed_memory
from tests.panel._serve import serve
from touba.cli._app import app
from touba.memory import SqliteMemoryStore

runner = CliRunner()


def request(base: str, path: str, cookie: str | None = None) -> http.client.HTTPResponse:
    parts = urlsplit(base)
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=10)
    conn.request("GET", path, headers={"Cookie": cookie} if cookie else {})
    response = conn.getresponse()
    response.read()
    conn.close()
    return response


@pytest.fixture
async def files(private_dir: Path) -> Path:
    async with SqliteMemoryStore(private_dir / "memory.sqlite") as store:
        await seed_memory(store)
    return private_dir


@pytest.mark.parametrize("host", ["0.0.0.0", "192.168.1.10", "example.org"])  # noqa: S104
def test_a_non_loopback_host_is_refused_without_allow_remote(files: Path, host: str) -> None:
    result = runner.invoke(
        app, ["panel", "--db", str(files / "memory.sqlite"), "--program", "demo", "--host", host]
    )
    assert result.exit_code == 2
    assert "not a loopback address" in result.output
    assert "--allow-remote" in result.output


def test_usage_errors(files: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    db = str(files / "memory.sqlite")
    both = runner.invoke(
        app,
        ["panel", "--db", db, "--program", "demo", "--history-db", db, "--redis-url", "redis://x"],
    )
    assert both.exit_code == 2
    assert "at most one history store" in both.output
    table = runner.invoke(app, ["panel", "--db", db, "--program", "demo", "--history-table", "t"])
    assert table.exit_code == 2
    missing = runner.invoke(
        app, ["panel", "--db", str(files / "absent.sqlite"), "--program", "demo"]
    )
    assert missing.exit_code == 1
    assert "no memory database" in missing.output
    assert not (files / "absent.sqlite").exists()  # nothing created
    monkeypatch.setenv("TOUBA_PANEL_TOKEN", "short")
    short = runner.invoke(app, ["panel", "--db", db, "--program", "demo"])
    assert short.exit_code == 2
    assert "at least 16 characters" in short.output


def test_the_panel_serves_on_loopback_and_prints_the_token_url_once(files: Path) -> None:
    args = ["--db", "memory.sqlite", "--program", "demo"]
    with serve(args, files) as served:
        assert served.base.startswith("http://127.0.0.1:")
        token = served.login.split("token=", 1)[1]
        assert len(token) >= 32
        refused = request(served.base, "/users")
        assert refused.status == 401
        login = request(served.base, f"/users?token={token}")
        assert login.status == 303
        assert login.getheader("location") == "/users"
        cookie = (login.getheader("set-cookie") or "").split(";", 1)[0]
        assert request(served.base, "/users", cookie).status == 200
        assert request(served.base, "/users", "touba_panel=forged").status == 401
    logged = "".join(served.errors)
    assert "GET /users 303" in logged  # request lines are logged ...
    assert token not in logged  # ... never with the token


def test_a_token_from_the_environment_is_not_printed(files: Path) -> None:
    secret = "from-the-environment-0123456789"
    with serve(
        ["--db", "memory.sqlite", "--program", "demo"], files, TOUBA_PANEL_TOKEN=secret
    ) as served:
        assert "token" not in served.login
        assert request(served.base, f"/?token={secret}").status == 303
    assert secret not in "".join(served.errors)


@pytest.fixture
def pg_memory() -> Iterator[tuple[str, str]]:
    dsn = postgres_dsn()
    prefix = f"tp_{uuid.uuid4().hex[:10]}"
    yield dsn, prefix
    drop_postgres_tables(dsn, prefix)


@pytest.mark.postgres
async def test_the_panel_runs_on_a_postgresql_memory_store(
    pg_memory: tuple[str, str], private_dir: Path
) -> None:
    from touba.memory.postgres import PostgresMemoryStore

    dsn, prefix = pg_memory
    async with PostgresMemoryStore(dsn, prefix=prefix) as store:
        await seed_memory(store)
    args = ["--dsn", dsn, "--prefix", prefix, "--program", "demo"]
    with serve(args, private_dir) as served:
        token = served.login.split("token=", 1)[1]
        login = request(served.base, f"/?token={token}")
        cookie = (login.getheader("set-cookie") or "").split(";", 1)[0]
        for path in (
            "/",
            "/users",
            "/user?owner=user:alice",
            "/events?owner=user:alice",
            "/events?text=details",  # the search across owners
            "/users?mode=preview",
            "/session?id=s-1",
            "/jobs",
            "/agents/support",
        ):
            assert request(served.base, path, cookie).status == 200, path

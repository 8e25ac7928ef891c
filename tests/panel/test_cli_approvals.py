"""``touba panel`` and the application's checkpoints: ``--checkpoints-db`` or a Runtime.

The checkpoint file is checked as the stores are, reading only: a missing
file, another kind of store, a file that is not SQLite, a file that opening
would chmod, are refused (exit 1, one line) and left as they were.
"""

from __future__ import annotations

import hashlib
import http.client
import os
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from typer.testing import CliRunner, Result

from tests.panel._approvals import DIR_ENV, build_program
from tests.panel._data import seed_memory
from tests.panel._serve import serve
from touba import ChatSession, Runtime
from touba.cli._app import app
from touba.memory import SqliteMemoryStore
from touba.runtime import SqliteCheckpointStore

runner = CliRunner()
PROGRAM = "tests.panel._approvals:program"


@pytest.fixture
async def files(private_dir: Path) -> Path:
    async with SqliteMemoryStore(private_dir / "memory.sqlite") as store:
        await seed_memory(store)
    async with SqliteCheckpointStore(private_dir / "checkpoints.sqlite"):
        pass
    (private_dir / "notes.txt").write_text("not a database\n")
    return private_dir


def _state(path: Path) -> tuple[str, int] | None:
    if not path.exists():
        return None
    return hashlib.sha256(path.read_bytes()).hexdigest(), os.stat(path).st_mode


def _panel(files: Path, *args: str) -> Result:
    return runner.invoke(
        app, ["panel", "--db", str(files / "memory.sqlite"), "--program", PROGRAM, *args]
    )


@pytest.mark.parametrize(
    ("name", "said"),
    [
        ("absent.sqlite", "no such file; nothing was created"),
        ("memory.sqlite", "this SQLite file holds no touba checkpoint store"),
        ("notes.txt", "this file cannot be read as SQLite"),
    ],
)
def test_a_checkpoints_db_that_is_not_a_checkpoint_store_is_refused_unchanged(
    files: Path, name: str, said: str
) -> None:
    path = files / name
    before = _state(path)
    result = _panel(files, "--checkpoints-db", str(path))
    assert result.exit_code == 1
    assert said in " ".join(result.output.split())
    assert _state(path) == before


def test_a_checkpoints_db_open_to_others_is_refused_and_its_mode_kept(files: Path) -> None:
    path = files / "checkpoints.sqlite"
    os.chmod(path, 0o644)
    before = _state(path)
    result = _panel(files, "--checkpoints-db", str(path))
    assert result.exit_code == 1
    assert "chmod 600" in result.output
    assert _state(path) == before


def test_checkpoints_db_with_a_program_naming_a_runtime_is_a_usage_error(
    files: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(DIR_ENV, str(files))
    result = runner.invoke(
        app,
        [
            "panel",
            "--db",
            str(files / "memory.sqlite"),
            "--program",
            "tests.panel._approvals:runtime",
            "--checkpoints-db",
            str(files / "checkpoints.sqlite"),
        ],
    )
    assert result.exit_code == 2
    assert "names a touba.Runtime" in " ".join(result.output.split())


def _get(base: str, path: str, cookie: str | None = None) -> tuple[int, str, str]:
    parts = urlsplit(base)
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=10)
    conn.request("GET", path, headers={"Cookie": cookie} if cookie else {})
    response = conn.getresponse()
    body = response.read().decode()
    cookie_set = (response.getheader("set-cookie") or "").split(";", 1)[0]
    conn.close()
    return response.status, body, cookie_set


@pytest.mark.parametrize("given", ["runtime", "checkpoints-db"])
async def test_the_approvals_page_reads_the_applications_checkpoints(
    files: Path, monkeypatch: pytest.MonkeyPatch, given: str
) -> None:
    monkeypatch.setenv(DIR_ENV, str(files))
    async with (
        SqliteCheckpointStore(files / "checkpoints.sqlite") as checkpoints,
        SqliteMemoryStore(files / "memory.sqlite") as memory,
    ):
        runtime = Runtime(build_program(), checkpoints=checkpoints)
        async with ChatSession(runtime, "support", "carol", "s-c", store=memory) as chat:
            turn = await chat.send("please refund C3")
    assert turn.result.checkpoint_id is not None
    if given == "runtime":
        args = ["--db", "memory.sqlite", "--program", "tests.panel._approvals:runtime"]
    else:
        args = ["--db", "memory.sqlite", "--program", PROGRAM]
        args += ["--checkpoints-db", "checkpoints.sqlite"]
    with serve(args, files, **{DIR_ENV: str(files)}) as served:
        token = served.login.split("token=", 1)[1]
        status, _, cookie = _get(served.base, f"/approvals?token={token}")
        assert status == 303
        status, page, _ = _get(served.base, "/approvals", cookie)
        assert status == 200
        assert turn.result.checkpoint_id in page
        assert "<td>carol</td>" in page


def test_without_either_the_page_says_how(files: Path) -> None:
    with serve(["--db", "memory.sqlite", "--program", PROGRAM], files) as served:
        token = served.login.split("token=", 1)[1]
        _, _, cookie = _get(served.base, f"/approvals?token={token}")
        status, page, _ = _get(served.base, "/approvals", cookie)
        assert status == 200
        assert "No checkpoint store was given" in page

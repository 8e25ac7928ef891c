"""``touba panel --keys-file``: the panel serves the pages of an encrypted memory and
history store opened with the keys of the file, and shows the opened text; the keys
never reach its output."""

from __future__ import annotations

import base64
import http.client
import json
from pathlib import Path
from urllib.parse import urlsplit

from tests.history.test_encryption_stores import MARKER, converse, identity
from tests.panel._data import seed_memory
from tests.panel._serve import serve
from touba import Encryption
from touba.history.sqlite import SqliteHistoryStore
from touba.memory import SqliteMemoryStore

KEY = bytes(range(100, 132))
SEALED = Encryption({"k1": KEY}, "k1")


def get(base: str, path: str, cookie: str | None = None) -> tuple[int, str, str]:
    parts = urlsplit(base)
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=10)
    conn.request("GET", path, headers={"Cookie": cookie} if cookie else {})
    response = conn.getresponse()
    body = response.read().decode("utf-8", "replace")
    conn.close()
    return response.status, body, response.getheader("set-cookie") or ""


async def test_the_panel_reads_encrypted_stores_with_the_keys_file(private_dir: Path) -> None:
    async with SqliteMemoryStore(private_dir / "memory.sqlite", encryption=SEALED) as store:
        await seed_memory(store)
        await store.create_event(
            owner="user:alice",
            type="refund",
            title="Sealed refund Zk7",
            details="d",
            session_id="s-1",
        )
    async with SqliteHistoryStore(private_dir / "history.sqlite", encryption=SEALED) as history:
        await converse(history, identity(1), 2)
    for name in ("memory.sqlite", "history.sqlite"):
        raw = (private_dir / name).read_bytes()
        assert b"Zk7" not in raw
        assert MARKER.encode() not in raw
    keys = private_dir / "keys.json"
    keys.write_text(json.dumps({"k1": base64.b64encode(KEY).decode()}))
    keys.chmod(0o600)
    args = ["--db", "memory.sqlite", "--history-db", "history.sqlite", "--keys-file", "keys.json"]
    with serve([*args, "--program", "demo"], private_dir) as served:
        token = served.login.split("token=", 1)[1]
        _, _, cookie = get(served.base, f"/?token={token}")
        cookie = cookie.split(";", 1)[0]
        status, body, _ = get(served.base, "/events?owner=user:alice", cookie)
        assert status == 200
        assert "Sealed refund Zk7" in body
        for path in ("/", "/users", "/user?owner=user:alice", "/session?id=s-1", "/jobs"):
            assert get(served.base, path, cookie)[0] == 200, path
    assert base64.b64encode(KEY).decode() not in "".join(served.errors)

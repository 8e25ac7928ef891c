"""The panel shows damaged conversations and repairs one behind a confirmation.

Through HTTP on a real SQLite store: the list marks the damaged conversation,
its page lists the problems (never content), the repair page shows the fix and
offers the originals in the export format; the POST needs the token, the CSRF
token, the confirmation and the conversation unchanged since the page; a
reserved conversation is refused; once repaired, the conversation checks clean.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.history._stores import holding
from tests.panel.conftest import ORIGIN, post
from touba.history import ConversationIdentity, check_record
from touba.history._record import join_record, new_head
from touba.history.sqlite import SqliteHistoryStore

SECRET = "secret-argument-value"


async def _put(store: SqliteHistoryStore, namespace: str, *, damaged: bool) -> str:
    identity = ConversationIdentity(namespace, "openai", "m", "native", "run", "inv", "agent")
    head = new_head(identity)
    call = {"call_id": "c1", "name": "lookup", "arguments": {"q": SECRET}}
    exchange: list[dict[str, Any]] = [{"kind": "decision", "calls": [call]}]
    if not damaged:
        exchange.append({**call, "kind": "result", "status": "ok", "result": 1})
    record = join_record(head, [exchange])
    raw_size = sum(len(json.dumps(m, separators=(",", ":"))) for m in exchange)
    record["stats"] = {"exchanges": 1, "messages": len(exchange), "bytes": raw_size}

    async def put(_: Any) -> tuple[dict[str, Any], None]:
        return record, None

    await store.transact(identity.key, put)
    return identity.key


def _digest(page: str) -> str:
    found = re.search(r'name="digest" value="([0-9a-f]+)"', page)
    assert found is not None
    return found.group(1)


async def test_a_damaged_conversation_is_shown_and_repaired_after_confirmation(
    client: TestClient, history: SqliteHistoryStore
) -> None:
    good = await _put(history, "ok", damaged=False)
    broken = await _put(history, "broken", damaged=True)
    listing = client.get("/conversations").text
    assert listing.count("damaged: 1 problem") == 1
    assert f"/conversation/repair?key={broken.replace(':', '%3A')}" in listing
    page = client.get(f"/conversation?key={broken}").text
    assert "orphan_call" in page
    assert "has no result" in page
    assert "Repair…" in page
    assert "orphan_call" not in client.get(f"/conversation?key={good}").text

    repair = client.get(f"/conversation/repair?key={broken}").text
    assert "1 result added" in repair
    assert "/conversation/originals?key=" in repair
    assert SECRET not in repair.split("<h2>Problems</h2>")[1]  # problems carry no content
    originals = client.get(f"/conversation/originals?key={broken}")
    assert originals.status_code == 200
    header, line, end = (json.loads(x) for x in originals.text.splitlines())
    assert header["format"] == "touba-export"
    assert header["selection"] == {"conversation": broken}
    assert line["record"]["exchanges"] == [
        [
            {
                "kind": "decision",
                "calls": [{"call_id": "c1", "name": "lookup", "arguments": {"q": SECRET}}],
            }
        ]
    ]
    assert end == {"kind": "end", "records": 1}

    digest = _digest(repair)
    refused = post(client, "/conversation/repair", {"key": broken, "digest": digest})
    assert refused.status_code == 303  # not confirmed: nothing done
    assert check_record(await history.read_raw(broken))  # type: ignore[arg-type]
    done = post(client, "/conversation/repair", {"key": broken, "digest": digest, "confirm": "yes"})
    assert done.status_code == 303
    assert done.headers["location"] == f"/conversation?key={broken.replace(':', '%3A')}"
    after = client.get(f"/conversation?key={broken}").text
    assert "Repaired: 1 problem(s) fixed (orphan_call)" in after
    assert check_record(await history.read_raw(broken)) == []  # type: ignore[arg-type]
    assert "damaged:" not in client.get("/conversations").text


async def test_a_repair_of_a_conversation_changed_since_its_page_is_refused(
    client: TestClient, history: SqliteHistoryStore, private_dir: Path
) -> None:
    broken = await _put(history, "broken", damaged=True)
    digest = _digest(client.get(f"/conversation/repair?key={broken}").text)
    await _put(history, "broken", damaged=True)  # written again: another updated_at
    response = post(
        client, "/conversation/repair", {"key": broken, "digest": digest, "confirm": "yes"}
    )
    assert response.status_code == 303
    assert "changed since the page was shown" in client.get(response.headers["location"]).text
    assert check_record(await history.read_raw(broken))  # type: ignore[arg-type]
    del private_dir


async def test_a_reserved_conversation_is_not_repaired(
    client: TestClient, history: SqliteHistoryStore
) -> None:
    broken = await _put(history, "broken", damaged=True)
    page = client.get(f"/conversation/repair?key={broken}").text
    task, leave = await holding(history, broken, lambda record: (record, None))
    try:
        response = post(
            client,
            "/conversation/repair",
            {"key": broken, "digest": _digest(page), "confirm": "yes"},
        )
        assert response.status_code == 303
        shown = client.get(response.headers["location"]).text
        assert "active (reserved) or changed; it was not repaired" in shown
    finally:
        leave.set()
        await task
    assert check_record(await history.read_raw(broken))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "path", ["/conversation/repair?key=th1:x:y", "/conversation/originals?key=th1:x:y"]
)
def test_the_repair_pages_need_the_token(anonymous: TestClient, path: str) -> None:
    assert anonymous.get(path).status_code == 401


async def test_the_repair_needs_the_token_and_the_csrf_token(
    anonymous: TestClient, client: TestClient, history: SqliteHistoryStore
) -> None:
    broken = await _put(history, "broken", damaged=True)
    data = {"key": broken, "confirm": "yes", "digest": "x"}
    assert anonymous.post("/conversation/repair", data=data, headers=ORIGIN).status_code == 401
    forged = client.post("/conversation/repair", data={**data, "csrf": "guess"}, headers=ORIGIN)
    assert forged.status_code == 403
    assert check_record(await history.read_raw(broken))  # type: ignore[arg-type]

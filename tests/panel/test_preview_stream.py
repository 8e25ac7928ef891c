"""The preview chat streamed as server-sent events: its frames, its checks, a client leaving.

In-process (TestClient) for the frames and the refusals; against ``touba panel``
as a real process for a client that disconnects mid-reply (the turn is
cancelled at once: not stored, the preview session free for the next turn).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
from fastapi.testclient import TestClient

from tests.panel._serve import serve
from tests.panel._streaming import ARGS, prepare
from tests.panel.conftest import ORIGIN, csrf_of, post
from touba.memory import SqliteMemoryStore

_CSRF = re.compile(r'name="csrf" value="([^"]+)"')


def _frames(body: str) -> list[tuple[str, dict[str, object]]]:
    frames = []
    for block in body.split("\n\n"):
        if not block.strip():
            continue
        fields = dict(line.split(": ", 1) for line in block.split("\n"))
        frames.append((fields["event"], json.loads(fields["data"])))
    return frames


async def test_a_streamed_preview_turn_sends_its_text_then_the_rendered_transcript(
    client: TestClient, memory: SqliteMemoryStore
) -> None:
    response = post(client, "/agents/support/preview/stream", {"message": "Where is A1?"})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert "default-src 'none'" in response.headers["content-security-policy"]
    frames = _frames(response.text)
    names = [name for name, _ in frames]
    assert names[-1] == "done"
    assert ("call", {"name": "lookup_order", "status": "ok"}) in frames
    assert names.index("call") < names.index("delta")  # the call, then the reply
    text = "".join(str(data["text"]) for name, data in frames if name == "delta")
    assert "order A1 is shipped" in text
    html = str(frames[-1][1]["html"])
    assert "order A1 is shipped" in html
    assert "<html" not in html
    [meta] = [s for s in await memory.list_sessions() if s.mode == "preview"]
    assert meta.turns == 1  # stored as the non-streamed preview stores it
    empty = post(client, "/agents/support/preview/stream", {"message": "  "})
    assert _frames(empty.text)[-1][0] == "done"
    assert "Type a message first." in str(_frames(empty.text)[-1][1]["html"])


def test_the_stream_route_is_checked_as_every_action(client: TestClient) -> None:
    missing = client.post("/agents/support/preview/stream", data={"message": "hi"}, headers=ORIGIN)
    assert missing.status_code == 403
    assert "CSRF" in missing.text
    csrf = csrf_of(client)
    crossed = client.post(
        "/agents/support/preview/stream",
        data={"message": "hi", "csrf": csrf},
        headers={"origin": "http://evil.example"},
    )
    assert crossed.status_code == 403
    assert "Origin" in crossed.text
    assert (
        client.post(
            "/agents/nobody/preview/stream", data={"message": "hi", "csrf": csrf}, headers=ORIGIN
        ).status_code
        == 404
    )


def _logged_in(base: str, login: str) -> tuple[httpx.Client, str]:
    http = httpx.Client(base_url=base, follow_redirects=True, timeout=20)
    assert http.get(login).status_code == 200
    page = http.get("/agents/talker")
    found = _CSRF.search(page.text)
    assert found is not None
    return http, found.group(1)


async def test_a_client_that_disconnects_cancels_the_turn_at_once(private_dir: Path) -> None:
    await prepare(private_dir)
    delay = 0.6  # between two events of the slow answer
    with serve(ARGS, private_dir, TALK_DELAY=str(delay)) as served:
        http, csrf = _logged_in(served.base, served.login)
        try:
            form = {"message": "tell me slowly", "csrf": csrf}
            headers = {"origin": served.base}
            with http.stream(
                "POST", "/agents/talker/preview/stream", data=form, headers=headers
            ) as response:
                assert response.status_code == 200
                for line in response.iter_lines():
                    if line.startswith("data: ") and "text" in line:
                        break  # the first delta: leave mid-reply
            left = time.monotonic()
            # the preview session is free at once: the next turn runs now
            form = {"message": "and now?", "csrf": csrf}
            after = http.post("/agents/talker/preview/stream", data=form, headers=headers)
            assert "A quick answer." in after.text
        finally:
            http.close()
        report = private_dir / "stream-end.json"
        for _ in range(200):
            if report.exists():
                break
            await asyncio.sleep(0.05)
        ended = json.loads(report.read_text())
    # the vendor's response was closed when the client left, not at the panel's next
    # write (which would have come with the next event, ``delay`` later)
    assert ended["outcome"] == "client_closed"
    assert ended["closed_at"] - left < delay / 2
    async with SqliteMemoryStore(private_dir / "memory.sqlite") as store:
        [meta] = [s for s in await store.list_sessions() if s.mode == "preview"]
        turns = await store.list_turns(meta.session_id)
    assert [t.user for t in turns] == ["and now?"]  # no half turn: the cancelled one is gone
    assert [t.replies for t in turns] == [("A quick answer.",)]


async def test_the_event_stream_cancels_its_producer_when_the_client_leaves() -> None:
    """On any ASGI server (spec 2.4 here: Starlette's own streaming response would only
    notice at its next write, 30 s later)."""
    from starlette.types import Message

    from touba.panel._preview_stream import EventStream, frame

    written = asyncio.Event()
    cancelled = asyncio.Event()

    async def produce() -> AsyncIterator[bytes]:
        try:
            yield frame("delta", {"text": "Hel"})
            await asyncio.sleep(30)  # the model thinks, a tool runs...
            yield frame("delta", {"text": "lo"})
        except asyncio.CancelledError:
            cancelled.set()
            raise

    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)
        if message.get("body"):
            written.set()

    async def receive() -> Message:
        await written.wait()
        return {"type": "http.disconnect"}  # the client left after the first event

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}}
    await asyncio.wait_for(EventStream(produce)(scope, receive, send), 5)
    assert cancelled.is_set()
    assert [m.get("body") for m in sent[1:]] == [frame("delta", {"text": "Hel"})]
    assert dict(sent[0]["headers"])[b"content-type"].startswith(b"text/event-stream")
    assert b"content-length" not in dict(sent[0]["headers"])

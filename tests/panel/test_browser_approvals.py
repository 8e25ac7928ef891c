"""Approvals in a real headless browser: Playwright driving Debian's Chromium.

Two chat turns asking for refunds are paused by the application (this test
process, a SQLite checkpoint store); ``touba panel`` runs as a real process
over the same files, with ``--checkpoints-db`` and the same program, whose
refund capability logs each execution and whose scripted model logs what it
was sent (:mod:`tests.panel._approvals`). The operator approves one from the
session page's link and denies the other from the approvals page.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.panel._approvals import DIR_ENV, build_program, refunds_run, sent
from tests.panel._serve import serve
from tests.panel.test_browser import Shots, browser, logged_in, shots  # noqa: F401 - fixtures
from touba import ChatSession, Runtime
from touba.memory import SqliteMemoryStore
from touba.runtime import SqliteCheckpointStore

ARGS = [
    "--db",
    "memory.sqlite",
    "--checkpoints-db",
    "checkpoints.sqlite",
    "--program",
    "tests.panel._approvals:program",
]


async def _pause(directory: Path) -> dict[str, str]:
    """Alice's and Bob's turns, each stopped on a refund; session id -> checkpoint id."""
    paused: dict[str, str] = {}
    async with (
        SqliteCheckpointStore(directory / "checkpoints.sqlite") as checkpoints,
        SqliteMemoryStore(directory / "memory.sqlite") as memory,
    ):
        runtime = Runtime(build_program(), checkpoints=checkpoints)
        for user, session_id, order in (("alice", "s-alice", "A1"), ("bob", "s-bob", "B2")):
            async with ChatSession(
                runtime, "support", user, session_id, store=memory, extract_in_background=False
            ) as chat:
                turn = await chat.send(f"please refund {order}")
            assert turn.status == "awaiting_approval"
            assert turn.result.checkpoint_id is not None
            paused[session_id] = turn.result.checkpoint_id
    return paused


async def test_approve_a_paused_refund_and_deny_another(
    browser: Any,  # noqa: F811 - the imported fixture
    private_dir: Path,
    shots: Shots,  # noqa: F811 - the imported fixture
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(DIR_ENV, str(private_dir))
    paused = await _pause(private_dir)
    assert refunds_run(private_dir) == []
    with serve(ARGS, private_dir, **{DIR_ENV: str(private_dir)}) as served:
        page = await logged_in(browser, served)
        await page.click("text=Approvals")
        await page.wait_for_url("**/approvals")
        for checkpoint_id in paused.values():
            assert checkpoint_id in await page.inner_text("table.approvals")
        await shots.take(page, "approvals")

        # Alice's turn, from her session page's link.
        await page.goto(served.base + "/session?id=s-alice")
        await page.click("p.paused-turn >> text=approve or deny")
        await page.wait_for_url(f"**/approval?id={paused['s-alice']}")
        assert '"order_id": "A1"' in await page.inner_text("fieldset.call pre")
        await page.check("fieldset.call input[value=approve]")
        await page.check("input[name=confirm]")
        await shots.take(page, "approval")
        await page.click("text=Decide as operator")
        await page.wait_for_selector("text=Approved 1, denied 0. The chat turn completed.")
        assert refunds_run(private_dir) == ["A1"]  # exactly once

        # Bob's, from the approvals page.
        await page.click(f"tr:has-text('{paused['s-bob']}') >> text=approve or deny")
        await page.wait_for_url(f"**/approval?id={paused['s-bob']}")
        await page.check("fieldset.call input[value=deny]")
        await page.check("input[name=confirm]")
        await page.click("text=Decide as operator")
        await page.wait_for_selector("text=Approved 0, denied 1.")
        assert "Nothing awaits approval." in await page.inner_text("table.approvals")

        await page.goto(served.base + "/session?id=s-alice")
        assert "refund done" in await page.inner_text("ol.turns")
        assert await page.locator("p.paused-turn").count() == 0
        assert page.dialogs == []

    assert refunds_run(private_dir) == ["A1"]  # the denied one never ran
    told = [s for s in sent(private_dir) if s["input"] == "please refund B2" and s["observations"]]
    [answer] = told[-1]["observations"]
    assert answer["status"] == "denied"
    assert answer["error"] == "'refund' needs approval and was not approved (refused by operator)"
    async with SqliteMemoryStore(private_dir / "memory.sqlite") as memory:
        [alice] = await memory.list_turns("s-alice")
        assert alice.replies == ("refund done: {'order_id': 'A1', 'refunded': 'yes'}",)
        [bob] = await memory.list_turns("s-bob")
        assert bob.trace[0][0].status == "denied"
        assert bob.replies[0].startswith("no refund: 'refund' needs approval")

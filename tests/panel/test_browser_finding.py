"""Finding things in a real headless browser (issue 25, item 5): Playwright driving
Debian's Chromium, as in test_browser.py (whose fixtures these tests share; skipped
with the reason without a browser, failed under ``CI=true``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.panel._serve import serve
from tests.panel.test_browser import ARGS, Shots, browser, logged_in, shots
from touba.history.sqlite import SqliteHistoryStore
from touba.memory import KeyEventsConfig, KeyEventService, SqliteMemoryStore

__all__ = ["browser", "shots"]  # fixtures, used by name below


@pytest.fixture
async def two_owners(private_dir: Path) -> Path:
    """Refund key events of two users (and an unrelated one), with their sessions."""
    async with SqliteMemoryStore(private_dir / "memory.sqlite") as store:
        service = KeyEventService(store, KeyEventsConfig(enabled=True, types=("refund", "bug")))
        for owner, session_id in (("user:alice", "s-a"), ("user:bob", "s-b")):
            await store.open_session(session_id, owner=owner, agent_ref="support", mode="live")
            await store.append_turn(session_id, user="my refund?", replies=["on its way"])
        await service.create("user:alice", "refund", "Refund order A1", "by card", "s-a")
        await service.create("user:bob", "refund", "Refund for B7", "asked twice", "s-b")
        await service.create("user:bob", "bug", "Login loop", "", "s-b")
    async with SqliteHistoryStore(private_dir / "history.sqlite"):
        pass
    return private_dir


async def test_search_key_events_across_two_owners(
    browser: Any, two_owners: Path, shots: Shots
) -> None:
    with serve(ARGS, two_owners) as served:
        page = await logged_in(browser, served)
        await page.click("nav >> text=Key events")
        await page.fill("input[name=text]", "refund")
        await page.click("form.filters button[type=submit]")
        await page.wait_for_url("**/events?*text=refund*")
        rows = page.locator("table.list tbody tr")
        assert await rows.count() == 2
        assert await page.locator("table.list tbody tr td:first-child a").all_inner_texts() == [
            "Refund for B7",
            "Refund order A1",
        ]
        owners = page.locator("table.list td.owner a")
        assert await owners.all_inner_texts() == ["user:bob", "user:alice"]
        assert "2 found across every user" in await page.inner_text("main")
        await shots.take(page, "key-events-search")
        # Each links to its owner's page.
        await owners.nth(0).click()
        await page.wait_for_url("**/user?owner=user%3Abob")
        assert await page.inner_text("h1") == "Owner user:bob"
        assert await page.locator('a[href="/session?id=s-b"]').count() == 1
        await page.go_back()
        await page.locator("table.list td.owner a", has_text="user:alice").click()
        await page.wait_for_url("**/user?owner=user%3Aalice")
        assert await page.inner_text("h1") == "Owner user:alice"
        # A user by the id alone, from the users page.
        await page.goto(served.base + "/users")
        await page.fill("#owner", "bob")
        await page.click("form.inline button[type=submit]")
        await page.wait_for_url("**/user?owner=user%3Abob")
        assert await page.inner_text("h1") == "Owner user:bob"
        missing = await page.goto(served.base + "/user?owner=nobody")
        assert missing is not None
        assert missing.status == 404
        assert await page.inner_text("h1") == "No such user"

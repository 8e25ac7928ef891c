"""Settings with a history, in a real headless Chromium (see ``test_browser.py``).

An operator saves short-term memory as 1 turn: the agent page says the settings were
saved in the panel (with the time and its zone) and lists the change as the
operator's, and the next chat turns are given one earlier turn. Resetting needs the
confirmation box (the browser refuses the form without it) and the confirm dialog;
then the page says the program's settings apply, and the next turn follows them.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests.memory._chat import Scripted, build_runtime, memory
from tests.panel._data import seed_memory
from tests.panel._serve import serve
from tests.panel.test_browser import CHROMIUM, _playwright, logged_in
from touba import ChatSession
from touba.memory import SqliteMemoryStore

ARGS = ["--db", "memory.sqlite", "--program", "demo"]
ZONED = re.compile(r"saved in the panel at \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC")


@pytest.fixture
async def chromium() -> AsyncIterator[Any]:
    async_playwright = _playwright()
    async with async_playwright() as pw:
        launched = await pw.chromium.launch(
            executable_path=str(CHROMIUM), headless=True, args=["--no-sandbox"]
        )
        try:
            yield launched
        finally:
            await launched.close()


async def _given(store: SqliteMemoryStore, session_id: str) -> int:
    """How many earlier turns the third turn of a new session is given."""
    model = Scripted()
    runtime = build_runtime(model, config=memory(short_term_turns=30))  # the program's: 30
    async with ChatSession(runtime, "support", "u-9", session_id, store=store) as session:
        for text in ("one", "two", "three"):
            model.say(f"re: {text}")
            await session.send(text)
    return len(model.requests[-1].prior_turns)


async def test_save_see_the_history_and_reset_to_the_programs_settings(
    chromium: Any, private_dir: Path
) -> None:
    async with SqliteMemoryStore(private_dir / "memory.sqlite") as store:
        await seed_memory(store)
    with serve(ARGS, private_dir) as served:
        page = await logged_in(chromium, served)
        await page.goto(served.base + "/agents/support")
        assert "the program's MemoryConfig" in await page.inner_text("#settings-source")
        assert await page.locator("#reset").count() == 0  # nothing saved: nothing to reset
        await page.fill("#short_term_turns", "1")
        await page.click("form.settings button[type=submit]")
        await page.wait_for_selector("text=Saved. Sessions of support use these settings")
        assert ZONED.search(await page.inner_text("#settings-source"))
        rows = page.locator("#settings-history tbody tr")
        assert await rows.count() == 1
        row = await rows.first.inner_text()
        assert "operator" in row
        assert "short-term 1 turn" in row
        assert "UTC" in row

        async with SqliteMemoryStore(private_dir / "memory.sqlite") as store:
            assert await _given(store, "s-saved") == 1  # the panel's 1 turn

        # Without the box ticked the browser does not send the form (required).
        await page.click("#reset button[type=submit]")
        assert page.dialogs == []
        assert ZONED.search(await page.inner_text("#settings-source"))
        page.once("dialog", lambda dialog: dialog.accept())
        await page.check("#reset input[name=confirm]")
        await page.click("#reset button[type=submit]")
        await page.wait_for_selector("text=Reset. Sessions of support use the program")
        assert page.dialogs == [
            "Delete the settings saved for support? Its sessions use the program's settings "
            "from their next turn."
        ]
        assert "the program's MemoryConfig" in await page.inner_text("#settings-source")
        assert await page.input_value("#short_term_turns") == "30"
        newest = await page.locator("#settings-history tbody tr").first.inner_text()
        assert "reset to the program's settings" in newest
        assert "operator" in newest

    async with SqliteMemoryStore(private_dir / "memory.sqlite") as store:
        assert await _given(store, "s-reset") == 2  # the program's 30: both earlier turns
        reset, saved = await store.memory_config_history("support")
        assert (reset.actor, reset.after, saved.actor) == ("operator", None, "operator")

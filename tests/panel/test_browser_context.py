"""In Chromium: a setting changed in the panel, the turns it shapes, and the way back.

The issue's first browser test (issue 25): an operator saves short-term memory
as 1 turn in the panel, a chat turn runs, and the session page says which
earlier turns it was given and that the setting came from the panel, with its
time; after a reset to the program's settings the next turn follows the
program. Same harness as ``test_browser.py`` (``touba panel`` as a process,
Debian's Chromium through Playwright, real SQLite files).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from tests.panel._serve import serve
from tests.panel.test_browser import ARGS, Shots, browser, files, logged_in, shots  # noqa: F401
from touba import ChatSession, Runtime
from touba.cli._demo_program import build_program
from touba.memory import SqliteMemoryStore


async def _chat(directory: Path, *texts: str) -> list[str]:
    """Turns of carol's session ``s-ctx`` with the demo program (the panel's), in order."""
    replies: list[str] = []
    async with (
        SqliteMemoryStore(directory / "memory.sqlite") as store,
        ChatSession(Runtime(build_program()), "support", "carol", "s-ctx", store=store) as chat,
    ):
        for text in texts:
            turn = await chat.send(text)
            assert turn.status == "completed"
            replies.append(turn.reply or "")
    return replies


async def _given(page: Any, number: int) -> str:
    text: str = await page.inner_text(f'.given[data-turn="{number}"] .given-line')
    return text


async def test_a_setting_changed_in_the_panel_shows_beside_the_turns_it_shaped(
    browser: Any,  # noqa: F811
    files: Path,  # noqa: F811
    shots: Shots,  # noqa: F811
) -> None:
    with serve(ARGS, files) as served:
        page = await logged_in(browser, served)
        page.on("dialog", lambda dialog: asyncio.ensure_future(dialog.accept()))
        await page.goto(served.base + "/agents/support")
        await page.fill("#short_term_turns", "1")
        await page.click("form.settings button[type=submit]")
        await page.wait_for_selector("text=Saved. Sessions of support use these settings")
        async with SqliteMemoryStore(files / "memory.sqlite") as store:
            saved = await store.load_saved_memory_config("support")
        assert saved is not None
        assert saved.saved_by == "operator"
        when = saved.saved_at.strftime("%Y-%m-%d %H:%M UTC")

        replies = await _chat(files, "hello", "where is A1?", "what do you remember?")
        assert "I was given 1 earlier turn(s)" in replies[2]  # what the model saw...
        await page.goto(served.base + "/session?id=s-ctx")
        assert await _given(page, 1) == (  # ...and what the page says it was given
            f"given no earlier turn; short-term memory 1 turn (1 with full trace), saved "
            f"in the panel {when}; key events: none open"
        )
        assert await _given(page, 3) == (
            f"given turn 2 (full trace); short-term memory 1 turn (1 with full trace), "
            f"saved in the panel {when}; key events: none open"
        )
        third = page.locator('.given[data-turn="3"]')
        await third.locator("details.windows summary").click()
        windows = await third.locator("details.windows").inner_text()
        assert "decision 1: " in windows
        assert "decision history not kept" in await third.inner_text()
        await shots.take(page, "panel-turn-context", 'li.turn:has(.given[data-turn="3"])')

        # Back to the program's settings: the next turn follows the program.
        await page.goto(served.base + "/agents/support")
        await page.check("form.reset input[name=confirm]")
        await page.click("form.reset button[type=submit]")  # confirmed in the dialog too
        await page.wait_for_selector("text=Reset. Sessions of support use the program's settings")
        [reply] = await _chat(files, "and now?")
        assert "I was given 3 earlier turn(s)" in reply
        await page.goto(served.base + "/session?id=s-ctx")
        assert await _given(page, 4) == (
            "given turns 1 (text only), 2 (text only), 3 (full trace, no tool call); "
            "short-term memory 30 turns (1 with full trace), from the program; "
            "key events: none open"
        )
        assert "saved in the panel" in await _given(page, 3)  # earlier turns keep theirs
    assert not [line for line in served.errors if "Traceback" in line]

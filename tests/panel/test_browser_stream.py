"""The preview chat streams in a real browser (Chromium): partial text shows before the final.

The panel runs as ``touba panel`` over a program whose model streams its first
answer slowly (tests/panel/_streaming.py); the page's own script (panel.js,
under the panel's CSP) reads the server-sent events.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.panel._serve import serve
from tests.panel._streaming import ARGS, SLOW, prepare
from tests.panel.test_browser import browser, logged_in
from touba.memory import SqliteMemoryStore

__all__ = ["browser"]  # the fixture, shared with the other browser tests


async def test_the_preview_reply_appears_as_it_streams(browser: Any, private_dir: Path) -> None:
    await prepare(private_dir)
    with serve(ARGS, private_dir) as served:
        page = await logged_in(browser, served)
        problems: list[str] = []  # script errors and CSP refusals (the console's errors)
        page.on(
            "console",
            lambda m: (
                problems.append(m.text)
                if m.type == "error" and not m.text.startswith("Failed to load resource")
                else None
            ),
        )
        refused: list[str] = []  # resources that failed (Chromium's own /favicon.ico aside)
        page.on(
            "response",
            lambda r: (
                refused.append(r.url)
                if r.status >= 400 and not r.url.endswith("/favicon.ico")
                else None
            ),
        )
        await page.goto(served.base + "/agents/talker")
        await page.fill("#message", "Tell me slowly")
        await page.click("form.chat button")
        streaming = page.locator("#preview-log li.agent.streaming")
        await streaming.wait_for()
        await page.wait_for_function(
            "() => (document.querySelector('#preview-log li.agent.streaming') || {})"
            ".textContent?.includes('The first')"
        )
        partial = await streaming.inner_text()
        assert "The first" in partial
        assert "later on." not in partial  # a part, before the final
        assert await page.locator("#preview-log li.you .text").inner_text() == "Tell me slowly"
        final = page.locator("#preview-log li.agent:not(.streaming)")
        await final.wait_for()  # the transcript the server rendered, once done
        assert SLOW in await final.inner_text()
        assert await streaming.count() == 0
        assert await page.input_value("#message") == ""
        await page.fill("#message", "And now?")
        await page.click("form.chat button")
        await page.locator("#preview-log li.agent:not(.streaming)").nth(1).wait_for()
        assert "A quick answer." in await page.inner_text("#preview-log")
        assert problems == []  # no CSP refusal, no script error
        assert refused == []
    async with SqliteMemoryStore(private_dir / "memory.sqlite") as store:
        [meta] = [s for s in await store.list_sessions() if s.mode == "preview"]
        assert [t.user for t in await store.list_turns(meta.session_id)] == [
            "Tell me slowly",
            "And now?",
        ]

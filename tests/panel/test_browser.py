"""The panel in a real headless browser: Playwright driving Debian's Chromium.

The panel runs as ``touba panel`` (a real process on a free port) over real
SQLite files. Without ``/usr/bin/chromium`` (``apt-get install chromium``) or
the ``playwright`` package these tests are skipped with the reason, except
under ``CI=true``, where that is a failure. Playwright never downloads a
browser here: it is launched with ``executable_path``.

Screenshots of the main pages go to the test's tmp dir, and also to
``$TOUBA_PANEL_SCREENSHOTS`` when set (how docs/images/ was made).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests._services import unavailable
from tests.memory._chat import Scripted, build_runtime, memory
from tests.panel._data import HOSTILE, crashed_reservation, seed_conversation, seed_memory
from tests.panel._serve import Served, serve
from touba import ChatSession
from touba.history.sqlite import SqliteHistoryStore
from touba.memory import KeyEventsConfig, MemoryConfig, SqliteMemoryStore
from touba.memory._key_events import TOOL_NAMES

CHROMIUM = Path("/usr/bin/chromium")
ARGS = ["--db", "memory.sqlite", "--history-db", "history.sqlite", "--program", "demo"]


def _playwright() -> Any:
    if not CHROMIUM.exists():
        unavailable(f"no browser at {CHROMIUM}: apt-get install chromium (Debian's)")
    try:
        from playwright.async_api import async_playwright
    except ImportError:
        unavailable('the playwright package is missing: pip install -e ".[dev]"')
    return async_playwright


@pytest.fixture
async def browser() -> AsyncIterator[Any]:
    async_playwright = _playwright()
    async with async_playwright() as pw:
        launched = await pw.chromium.launch(
            executable_path=str(CHROMIUM), headless=True, args=["--no-sandbox"]
        )
        try:
            yield launched
        finally:
            await launched.close()


@pytest.fixture
async def files(private_dir: Path) -> Path:
    async with SqliteMemoryStore(private_dir / "memory.sqlite") as store:
        await seed_memory(store)
    async with SqliteHistoryStore(private_dir / "history.sqlite") as history:
        await seed_conversation(history)
    return private_dir


class Shots:
    """Screenshots of pages, in the tmp dir (and ``$TOUBA_PANEL_SCREENSHOTS``)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.extra = os.environ.get("TOUBA_PANEL_SCREENSHOTS")

    async def take(self, page: Any, name: str, element: str | None = None) -> Path:
        """The whole page, or only the first ``element`` (a CSS selector)."""
        path = self.directory / f"{name}.png"
        if element is None:
            await page.screenshot(path=str(path), full_page=True)
        else:
            await page.locator(element).first.screenshot(path=str(path))
        if self.extra:
            shutil.copy(path, Path(self.extra) / path.name)
        return path


@pytest.fixture
def shots(tmp_path: Path) -> Shots:
    directory = tmp_path / "screenshots"
    directory.mkdir()
    return Shots(directory)


async def logged_in(browser: Any, served: Served) -> Any:
    """A new browser context that opened the printed URL (token -> cookie)."""
    context = await browser.new_context(viewport={"width": 1280, "height": 900})
    page = await context.new_page()
    dialogs: list[str] = []
    page.on("dialog", lambda dialog: dialogs.append(dialog.message))
    page.dialogs = dialogs
    response = await page.goto(served.login)
    assert response is not None
    assert response.status == 200
    assert "token=" not in page.url  # the token left the address bar
    cookies = await context.cookies()
    [cookie] = [c for c in cookies if c["name"] == "touba_panel"]
    assert cookie["httpOnly"] is True
    assert cookie["sameSite"] == "Strict"
    return page


async def test_log_in_with_the_token_and_change_each_setting(
    browser: Any, files: Path, shots: Shots
) -> None:
    with serve(ARGS, files) as served:
        page = await logged_in(browser, served)
        await shots.take(page, "agents")
        await page.click("text=support")
        await page.uncheck("#short_term_on")
        assert await page.get_attribute("#short_term_turns", "readonly") is not None  # panel.js
        await page.check("#short_term_on")
        await page.fill("#short_term_turns", "8")
        await page.fill("#full_context_turns", "0")
        assert await page.inner_text("#full_context_shown") == "off"  # "last N turns", live
        await page.fill("#full_context_turns", "2")
        assert await page.inner_text("#full_context_shown") == "last 2 turns"
        await page.fill("#types", "refund\naccount issue\ndelivery")
        await page.click("form.settings button[type=submit]")
        await page.wait_for_selector("text=Saved. Sessions of support use these settings")
        await shots.take(page, "agent-settings")
        # An invalid value: MemoryConfig's own message next to the field.
        await page.fill("#full_context_turns", "7")
        await page.click("form.settings button[type=submit]")
        error = await page.inner_text("#full_context_turns-error")
        assert error == "MemoryConfig.full_context_turns must be an int from 0 to 5, got 7"

    with serve(ARGS, files) as restarted:  # a new panel process: the settings persisted
        page = await logged_in(browser, restarted)
        await page.goto(restarted.base + "/agents/support")
        assert await page.input_value("#short_term_turns") == "8"
        assert await page.input_value("#full_context_turns") == "2"
        assert await page.input_value("#types") == "refund\naccount issue\ndelivery"
        assert await page.is_checked("input[name=key_events_on]")
        await page.uncheck("input[name=key_events_on]")
        await page.uncheck("#short_term_on")
        await page.click("form.settings button[type=submit]")
        await page.wait_for_selector("text=Saved.")

    async with SqliteMemoryStore(files / "memory.sqlite") as store:
        saved = await store.load_memory_config("support")
        assert saved == MemoryConfig(
            short_term_turns=0,
            full_context_turns=2,
            key_events=KeyEventsConfig(
                enabled=False, types=("refund", "account issue", "delivery")
            ),
        )
        # ... and they reach the next chat turn of the agent.
        model = Scripted()
        runtime = build_runtime(model, config=memory())
        async with ChatSession(runtime, "support", "u-1", "s-next", store=store) as session:
            model.say("first")
            await session.send("hello")
            model.say("second")
            await session.send("again")
        request = model.requests[-1]
        assert request.prior_turns == ()  # short-term memory off
        assert not {c.name for c in request.capabilities} & set(TOOL_NAMES)  # key events off


async def test_edit_a_key_event_and_see_hostile_content_as_text(
    browser: Any, files: Path, shots: Shots
) -> None:
    with serve(ARGS, files) as served:
        page = await logged_in(browser, served)
        await page.goto(served.base + "/events?owner=user:alice")
        link = page.locator("table.list a", has_text=HOSTILE)
        assert await link.inner_text() == HOSTILE  # shown as text
        await link.click()
        assert await page.inner_text("p.event-title") == HOSTILE
        await page.select_option("#status", "in_progress")
        await page.fill("#title", "Refund approved by phone")
        await page.click("text=Save as operator")
        await page.wait_for_selector("text=recorded as made by the operator")
        assert await page.inner_text("p.event-title") == "Refund approved by phone"
        assert await page.locator("td .badge.op").count() == 1
        await shots.take(page, "key-event")
        await page.goto(served.base + "/session?id=s-1")
        await page.click("details.trace summary")
        await shots.take(page, "session")
        assert page.dialogs == []  # no script from the stores ever ran
    async with SqliteMemoryStore(files / "memory.sqlite") as store:
        [event] = await store.query_events("user:alice")
        found = await store.get_event("user:alice", event.id)
        assert found is not None
        assert found.history is not None
        assert [u.actor for u in found.history] == ["operator"]


async def test_recover_a_reservation_left_by_a_sigkilled_worker(
    browser: Any, files: Path, shots: Shots
) -> None:
    key = await crashed_reservation(files / "history.sqlite")
    with serve(ARGS, files) as served:
        page = await logged_in(browser, served)
        await page.goto(served.base + "/conversations")
        await shots.take(page, "conversations")
        await page.goto(served.base + f"/conversation?key={key}")
        assert await page.locator(".badge.busy").count() == 1
        await page.click("text=Recover the reservation")
        await page.wait_for_url("**/conversation/recover?key=*")
        assert "Stop the worker that holds it" in await page.inner_text("main")
        await shots.take(page, "recover")
        await page.check("input[name=worker_stopped]")
        await page.click("text=Free the reservation")
        await page.wait_for_selector("text=Reservation freed")
        assert await page.locator(".badge.busy").count() == 0
    async with SqliteHistoryStore(files / "history.sqlite") as history:
        [row] = [r for r in await history.list() if r.key == key]
        assert not row.active


async def test_a_conversation_page_shows_its_plot(browser: Any, files: Path, shots: Shots) -> None:
    with serve(ARGS, files) as served:
        page = await logged_in(browser, served)
        await page.goto(served.base + "/conversations")
        await page.locator("table.list a").first.click()
        await page.wait_for_url("**/conversation?key=*")  # the click navigates
        svg = page.locator("svg.plot")
        await svg.first.wait_for()
        assert await svg.count() == 1
        box = await svg.bounding_box()
        assert box is not None
        assert box["width"] > 300
        await shots.take(page, "conversation")
        await shots.take(page, "conversation-plot", "section.card:has(svg.plot)")


async def test_run_a_preview_chat(browser: Any, files: Path, shots: Shots) -> None:
    with serve(ARGS, files) as served:
        page = await logged_in(browser, served)
        await page.goto(served.base + "/agents/support")
        await page.fill("#message", "Where is A1?")
        await page.click("form.chat button")
        await page.wait_for_selector("#preview-log li.agent")
        assert "order A1 is shipped" in await page.inner_text("#preview-log")
        await page.fill("#message", "What did I say?")
        await page.click("form.chat button")
        await page.locator("#preview-log li.agent").nth(1).wait_for()
        assert "I was given 0 earlier turn(s)" in await page.inner_text("#preview-log")
        await shots.take(page, "preview")
    async with SqliteMemoryStore(files / "memory.sqlite") as store:
        previews = [s for s in await store.list_sessions() if s.mode == "preview"]
        assert any(s.turns == 2 for s in previews)


async def test_refused_without_the_token_or_the_csrf_token(browser: Any, files: Path) -> None:
    with serve(ARGS, files) as served:
        context = await browser.new_context()
        stranger = await context.new_page()
        response = await stranger.goto(served.base + "/agents/support")
        assert response is not None
        assert response.status == 401
        assert await stranger.locator("input[name=token]").count() == 1
        wrong = await stranger.goto(served.base + "/?token=not-the-token-at-all")
        assert wrong is not None
        assert wrong.status == 401
        await context.close()

        page = await logged_in(browser, served)
        await page.goto(served.base + "/agents/support")
        status = await page.evaluate(
            """async () => {
                const form = new FormData();
                form.append("short_term_on", "on");
                form.append("short_term_turns", "1");
                form.append("full_context_turns", "1");
                const r = await fetch("/agents/support/memory", {method: "POST", body: form});
                return r.status;
            }"""
        )
        assert status == 403  # the session cookie alone is not enough
        await page.evaluate("document.querySelector('form.settings [name=csrf]').value = 'x'")
        await page.click("form.settings button[type=submit]")
        await page.wait_for_selector("text=CSRF token is missing or wrong")
    async with SqliteMemoryStore(files / "memory.sqlite") as store:
        assert await store.load_memory_config("support") is None  # nothing was changed


async def test_a_cross_site_form_post_is_refused(browser: Any, files: Path) -> None:
    with serve(ARGS, files) as served:
        page = await logged_in(browser, served)
        port = served.base.rsplit(":", 1)[1]
        evil = await page.context.new_page()
        # Another site (localhost is not 127.0.0.1's site) posting to the panel.
        await evil.set_content(
            f'<form method="post" action="http://127.0.0.1:{port}/agents/support/memory">'
            '<input name="short_term_turns" value="1"><button>go</button></form>'
        )
        async with evil.expect_navigation():
            await evil.click("button")
        assert "Log in" in await evil.inner_text("body") or "Refused" in await evil.inner_text(
            "body"
        )
    async with SqliteMemoryStore(files / "memory.sqlite") as store:
        assert await store.load_memory_config("support") is None


def test_no_browser_is_a_skip_with_its_reason_outside_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    """The guard itself: a missing browser names the fix (and fails under CI=true)."""
    if os.environ.get("CI", "").lower() in ("true", "1"):
        pytest.skip("this check of the skip path runs outside CI only")
    monkeypatch.setattr(f"{__name__}.CHROMIUM", Path("/nonexistent/chromium"))
    with pytest.raises(pytest.skip.Exception, match="apt-get install chromium"):
        _playwright()

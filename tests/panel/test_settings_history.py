"""Settings with a history in the panel: saves are recorded as the operator's, the agent
page lists every change and says where the settings in effect come from, and "reset to
the program's settings" (confirmed, CSRF and Origin checked) deletes the saved ones."""

from __future__ import annotations

import re

import pytest
from fastapi.testclient import TestClient

from tests.panel.conftest import ORIGIN, csrf_of, post
from touba.memory import KeyEventsConfig, MemoryConfig, SqliteMemoryStore

FORM = {
    "short_term_on": "on",
    "short_term_turns": "1",
    "full_context_turns": "0",
    "key_events_on": "on",
    "types": "refund\n",
}
ONE = MemoryConfig(
    short_term_turns=1,
    full_context_turns=0,
    key_events=KeyEventsConfig(enabled=True, types=("refund",)),
)
RESET = "/agents/support/memory/reset"
_ZONED = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC")


def _history_section(page: str) -> str:
    return page.split('id="settings-history"', 1)[1].split("</section>", 1)[0]


def _source(page: str) -> str:
    return page.split('id="settings-source">', 1)[1].split("</p>", 1)[0]


async def test_a_save_in_the_panel_is_recorded_as_the_operators_and_listed(
    client: TestClient, memory: SqliteMemoryStore
) -> None:
    assert "the program's MemoryConfig (nothing saved)" in _source(
        client.get("/agents/support").text
    )
    assert "No change recorded" in _history_section(client.get("/agents/support").text)
    assert post(client, "/agents/support/memory", FORM).status_code == 303
    [change] = await memory.memory_config_history("support")
    assert (change.actor, change.before, change.after) == ("operator", None, ONE)
    page = client.get("/agents/support").text
    source = _source(page)
    assert "saved in the panel at" in source
    assert _ZONED.search(source)
    assert change.at.isoformat() in source
    row = _history_section(page).split("<tbody>", 1)[1]
    assert "<code>operator</code>" in row
    assert _ZONED.search(row)
    assert "nothing saved (the program's)" in row
    assert "short-term 1 turn · full context off · key events on: refund" in row


async def test_saving_the_same_settings_again_records_nothing(
    client: TestClient, memory: SqliteMemoryStore
) -> None:
    post(client, "/agents/support/memory", FORM)
    response = post(client, "/agents/support/memory", FORM)
    assert response.status_code == 303
    assert "nothing changed" in client.get("/agents/support").text
    assert len(await memory.memory_config_history("support")) == 1


async def test_settings_saved_through_the_api_name_their_actor_escaped(
    client: TestClient, memory: SqliteMemoryStore
) -> None:
    await memory.save_memory_config("support", ONE, actor="<b>deploy</b>")
    page = client.get("/agents/support").text
    assert "saved by <code>&lt;b&gt;deploy&lt;/b&gt;</code> at" in _source(page)
    assert "<b>deploy</b>" not in page


async def test_reset_deletes_the_saved_settings_and_records_it(
    client: TestClient, memory: SqliteMemoryStore
) -> None:
    assert 'action="/agents/support/memory/reset"' not in client.get("/agents/support").text
    post(client, "/agents/support/memory", FORM)
    page = client.get("/agents/support").text
    assert 'action="/agents/support/memory/reset"' in page
    assert 'name="confirm" value="yes" required' in page
    response = post(client, RESET, {"confirm": "yes"})
    assert response.status_code == 303
    assert response.headers["location"] == "/agents/support"
    assert await memory.load_memory_config("support") is None
    reset, _ = await memory.memory_config_history("support")
    assert (reset.actor, reset.before, reset.after) == ("operator", ONE, None)
    page = client.get("/agents/support").text
    assert "Reset. Sessions of support use the program&#39;s settings" in page
    assert "the program's MemoryConfig (nothing saved)" in _source(page)
    assert "reset to the program's settings" in _history_section(page)
    assert 'value="30"' in page  # the form shows the program's settings again


async def test_reset_without_the_confirmation_changes_nothing(
    client: TestClient, memory: SqliteMemoryStore
) -> None:
    post(client, "/agents/support/memory", FORM)
    for form in ({}, {"confirm": "no"}, {"confirm": ""}):
        response = post(client, RESET, form)
        assert response.status_code == 303
        assert response.headers["location"] == "/agents/support#reset"
        assert "Nothing done" in client.get("/agents/support").text
    assert await memory.load_memory_config("support") == ONE
    assert len(await memory.memory_config_history("support")) == 1


async def test_reset_with_nothing_saved_says_so_and_records_nothing(
    client: TestClient, memory: SqliteMemoryStore
) -> None:
    assert post(client, RESET, {"confirm": "yes"}).status_code == 303
    assert "nothing to reset" in client.get("/agents/support").text
    assert await memory.memory_config_history("support") == []


@pytest.mark.parametrize(
    "headers",
    [{}, {"origin": "http://evil.example"}, {"referer": "http://evil.example/x"}],
)
async def test_a_reset_from_another_site_is_refused(
    client: TestClient, memory: SqliteMemoryStore, headers: dict[str, str]
) -> None:
    post(client, "/agents/support/memory", FORM)
    data = {"csrf": csrf_of(client), "confirm": "yes"}
    response = client.post(RESET, data=data, headers=headers)
    assert response.status_code == 403
    assert await memory.load_memory_config("support") == ONE


async def test_a_reset_without_the_csrf_token_or_logged_out_is_refused(
    client: TestClient, anonymous: TestClient, memory: SqliteMemoryStore
) -> None:
    post(client, "/agents/support/memory", FORM)
    for data in ({"confirm": "yes"}, {"confirm": "yes", "csrf": "guess"}):
        assert client.post(RESET, data=data, headers=ORIGIN).status_code == 403
    assert anonymous.post(RESET, data={"confirm": "yes"}, headers=ORIGIN).status_code == 401
    assert (
        client.post(
            "/agents/nobody/memory/reset",
            data={"csrf": csrf_of(client), "confirm": "yes"},
            headers=ORIGIN,
        ).status_code
        == 404
    )
    assert await memory.load_memory_config("support") == ONE
    assert len(await memory.memory_config_history("support")) == 1


async def test_the_overview_says_who_saved_the_settings(
    client: TestClient, memory: SqliteMemoryStore
) -> None:
    """Settings saved by the API (a deploy script, say) are not called the panel's."""
    await memory.save_memory_config("support", ONE, actor="deploy-script")
    row = client.get("/").text.split('href="/agents/support"', 1)[1].split("</tr>", 1)[0]
    assert "saved by <code>deploy-script</code>" in row
    assert "saved in the panel" not in row
    assert (
        post(client, "/agents/support/memory", FORM | {"short_term_turns": "2"}).status_code == 303
    )
    row = client.get("/").text.split('href="/agents/support"', 1)[1].split("</tr>", 1)[0]
    assert "saved in the panel" in row

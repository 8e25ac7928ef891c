"""Settings saved in the panel reach a running ChatSession at its next turn (no restart)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.memory._chat import Scripted, build_runtime, memory
from tests.panel.conftest import BASE, TOKEN, post
from touba import ChatSession
from touba.memory import SqliteMemoryStore
from touba.memory._key_events import TOOL_NAMES
from touba.panel import create_app
from touba.runtime import Runtime


@pytest.fixture
def model() -> Scripted:
    return Scripted()


@pytest.fixture
def runtime(model: Scripted) -> Runtime:
    return build_runtime(model, config=memory(short_term_turns=30, full_context_turns=1))


@pytest.fixture
def panel(runtime: Runtime, memory: SqliteMemoryStore) -> Iterator[TestClient]:
    app = create_app(runtime.program, memory, token=TOKEN)
    with TestClient(app, base_url=BASE, follow_redirects=False) as client:
        assert client.get(f"/?token={TOKEN}").status_code == 303
        yield client


def settings(**fields: str) -> dict[str, str]:
    form = {
        "short_term_on": "on",
        "short_term_turns": "30",
        "full_context_turns": "1",
        "key_events_on": "on",
        "types": "refund\naccount issue",
    }
    return {**form, **fields}


async def turn(session: ChatSession, model: Scripted, text: str, order: str) -> Any:
    model.call("lookup_order", order_id=order)
    model.say(f"{order} shipped.")
    return await session.send(text)


async def test_full_context_from_1_to_0_in_the_panel_drops_the_trace_from_the_next_turn(
    model: Scripted, runtime: Runtime, memory: SqliteMemoryStore, panel: TestClient
) -> None:
    async with ChatSession(runtime, "support", "u-42", "s-1", store=memory) as session:
        await turn(session, model, "Where is A1?", "A1")
        await turn(session, model, "And B2?", "B2")
        [traced] = model.requests[-2].prior_turns  # the second turn's first decision
        assert [c.name for group in traced.trace for c in group] == ["lookup_order"]

        response = post(panel, "/agents/support/memory", settings(full_context_turns="0"))
        assert response.status_code == 303

        await turn(session, model, "And C3?", "C3")  # the same running session object
        prior = model.requests[-2].prior_turns
        assert [t.user for t in prior] == ["Where is A1?", "And B2?"]
        assert all(t.trace == () for t in prior)  # no tool trace any more
        assert prior[-1].replies == ("B2 shipped.",)  # the text stays

        response = post(panel, "/agents/support/memory", settings(full_context_turns="1"))
        assert response.status_code == 303
        await turn(session, model, "And D4?", "D4")
        assert model.requests[-2].prior_turns[-1].trace != ()


async def test_short_term_off_and_key_events_off_apply_at_the_next_turn(
    model: Scripted, runtime: Runtime, memory: SqliteMemoryStore, panel: TestClient
) -> None:
    async with ChatSession(runtime, "support", "u-42", "s-2", store=memory) as session:
        await turn(session, model, "Where is A1?", "A1")
        assert {c.name for c in model.requests[-1].capabilities} >= set(TOOL_NAMES)
        form = settings(key_events_on="")
        del form["short_term_on"]
        assert post(panel, "/agents/support/memory", form).status_code == 303
        await turn(session, model, "And B2?", "B2")
        request = model.requests[-2]
        assert request.prior_turns == ()  # the agent forgets the previous turn
        assert not {c.name for c in request.capabilities} & set(TOOL_NAMES)


async def test_a_new_panel_over_the_same_file_shows_the_saved_settings(
    runtime: Runtime, memory: SqliteMemoryStore, panel: TestClient
) -> None:
    post(panel, "/agents/support/memory", settings(short_term_turns="7"))
    app = create_app(runtime.program, memory, token=TOKEN)
    with TestClient(app, base_url=BASE, follow_redirects=False) as again:
        assert again.get("/agents/support").status_code == 401  # sessions do not survive
        again.get(f"/?token={TOKEN}")
        assert 'value="7"' in again.get("/agents/support").text

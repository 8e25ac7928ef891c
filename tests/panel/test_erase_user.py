"""The panel's "Erase this user" action on an owner's page (``POST /user/erase``).

It needs the operator's session and the form's CSRF token, the user id typed again; it
erases the user from the panel's memory and history stores and from the checkpoint store
and resource binding of its runtime, refuses a user a worker holds unless the workers are
declared stopped, and logs the user's hash and the counts, never the id or content.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.data._world import Deployment, marker, sessions_of
from tests.panel.conftest import BASE, ORIGIN, TOKEN, post
from touba.data import Stores, verify_erased
from touba.errors import DecisionHistoryBusy
from touba.history.sqlite import SqliteHistoryStore
from touba.memory import SqliteMemoryStore
from touba.panel import create_app
from touba.panel._erase import user_of_owner
from touba.runtime import MemoryCheckpointStore, MemoryResourceBinding, Program, Runtime

ALICE, BOB = "alice-7f3", "bob-2c1"


@pytest.fixture
def runtime(program: Program) -> Runtime:
    return Runtime(program, checkpoints=MemoryCheckpointStore(), resources=MemoryResourceBinding())


@pytest.fixture
def stores(memory: SqliteMemoryStore, history: SqliteHistoryStore, runtime: Runtime) -> Stores:
    return Stores(
        memory=memory,
        histories=(history,),
        checkpoints=runtime.checkpoints,
        resources=runtime.resources,
    )


@pytest.fixture
async def seeded(stores: Stores, tmp_path: Path) -> Stores:
    world = Deployment("sqlite", tmp_path)
    world.stores = stores
    await world.populate(ALICE)
    await world.populate(BOB)
    return stores


@pytest.fixture
def client(
    program: Program, memory: SqliteMemoryStore, history: SqliteHistoryStore, runtime: Runtime
) -> Iterator[TestClient]:
    app = create_app(program, memory, history, token=TOKEN, runtime=runtime)
    with TestClient(app, base_url=BASE, follow_redirects=False) as client:
        assert client.get(f"/?token={TOKEN}").status_code == 303
        yield client


def test_the_owner_page_offers_the_erase_of_users_only() -> None:
    assert user_of_owner(f"user:{ALICE}") == ALICE
    assert user_of_owner(ALICE) == ALICE
    assert user_of_owner("session:s-1") is None


async def test_the_form_is_on_a_users_page(seeded: Stores, client: TestClient) -> None:
    page = client.get("/user", params={"owner": f"user:{ALICE}"}).text
    assert "Erase this user" in page
    assert 'action="/user/erase"' in page


async def test_a_wrong_confirmation_erases_nothing(seeded: Stores, client: TestClient) -> None:
    before = await verify_erased(ALICE, seeded)
    for typed in ("", BOB, ALICE.upper()):
        response = post(client, "/user/erase", {"owner": f"user:{ALICE}", "confirm": typed})
        assert response.status_code == 303
        assert response.headers["location"].startswith("/user?")
        page = client.get(response.headers["location"]).text
        assert "Nothing erased" in page
    assert await verify_erased(ALICE, seeded) == before


async def test_erase_removes_the_user_keeps_the_other_and_logs_no_content(
    seeded: Stores, client: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    bob = await verify_erased(BOB, seeded)
    with caplog.at_level(logging.INFO, logger="touba.panel"):
        response = post(client, "/user/erase", {"owner": f"user:{ALICE}", "confirm": ALICE})
    assert response.status_code == 303
    assert response.headers["location"] == "/users"
    assert "Erased " in client.get("/users").text
    assert await verify_erased(ALICE, seeded) == {}
    assert await verify_erased(BOB, seeded) == bob
    logged = [r.getMessage() for r in caplog.records if r.name == "touba.panel"]
    digest = hashlib.sha256(ALICE.encode()).hexdigest()
    assert [m for m in logged if digest in m and "erased by the operator" in m]
    assert not [m for m in logged if ALICE in m or marker(ALICE) in m]


async def test_no_csrf_or_no_login_erases_nothing(
    seeded: Stores, client: TestClient, program: Program, memory: Any, history: Any
) -> None:
    before = await verify_erased(ALICE, seeded)
    form = {"owner": f"user:{ALICE}", "confirm": ALICE}
    assert client.post("/user/erase", data=form, headers=ORIGIN).status_code == 403
    app = create_app(program, memory, history, token=TOKEN)
    with TestClient(app, base_url=BASE, follow_redirects=False) as anonymous:
        response = anonymous.post("/user/erase", data={**form, "csrf": "x"}, headers=ORIGIN)
        assert response.status_code == 401
    assert await verify_erased(ALICE, seeded) == before


async def test_a_held_conversation_refuses_unless_the_workers_are_stopped(
    seeded: Stores, client: TestClient, history: SqliteHistoryStore
) -> None:
    listed = await history.list(purge=False)
    key = next(
        c.key for c in listed if c.identity and c.identity["run_id"] == sessions_of(ALICE)[0]
    )
    inside, leave = asyncio.Event(), asyncio.Event()

    async def hold(record: Any) -> tuple[Any, None]:
        inside.set()
        await leave.wait()
        return record, None

    holder = asyncio.create_task(history.transact(key, hold))
    await inside.wait()
    form = {"owner": f"user:{ALICE}", "confirm": ALICE}
    response = post(client, "/user/erase", form)
    assert "a worker holds" in client.get(response.headers["location"]).text
    assert (await verify_erased(ALICE, seeded))["history"]["conversations"] == 3
    response = post(client, "/user/erase", {**form, "workers_stopped": "yes"})
    assert response.headers["location"] == "/users"
    assert await verify_erased(ALICE, seeded) == {}
    leave.set()
    with pytest.raises(DecisionHistoryBusy):
        await holder

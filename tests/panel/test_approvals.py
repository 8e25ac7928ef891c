"""The approvals pages through HTTP: list, approve, deny, refusals, gone checkpoints, recover.

The panel is built over the application's runtime (a SQLite checkpoint
store); invocations are paused by the test exactly as the application would
pause them: a chat turn (ChatSession.send) or a plain ``runtime.invoke``.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from markupsafe import escape

from tests.panel._approvals import REFUNDS, build_program, crash_while_resuming
from tests.panel._data import HOSTILE
from tests.panel.conftest import ORIGIN, TOKEN, csrf_of, post
from touba import ChatSession, Runtime
from touba.errors import ConfigurationError
from touba.history.sqlite import SqliteHistoryStore
from touba.memory import ChatTurn, SqliteMemoryStore
from touba.panel import create_app
from touba.runtime import SqliteCheckpointStore
from touba.testing import ScriptedProvider


@pytest.fixture(autouse=True)
def no_refund_yet() -> Iterator[None]:
    REFUNDS.clear()
    yield
    REFUNDS.clear()


@pytest.fixture
async def checkpoints(private_dir: Path) -> AsyncIterator[SqliteCheckpointStore]:
    async with SqliteCheckpointStore(private_dir / "checkpoints.sqlite") as store:
        yield store


@pytest.fixture
def model() -> ScriptedProvider:
    return ScriptedProvider()


@pytest.fixture
def runtime(model: ScriptedProvider, checkpoints: SqliteCheckpointStore) -> Runtime:
    return Runtime(build_program(model), checkpoints=checkpoints)


@pytest.fixture
def app(runtime: Runtime, memory: SqliteMemoryStore, history: SqliteHistoryStore) -> Any:
    return create_app(runtime.program, memory, history, token=TOKEN, runtime=runtime)


async def paused_turn(
    runtime: Runtime,
    memory: SqliteMemoryStore,
    model: ScriptedProvider,
    *,
    session_id: str = "s-1",
    user_id: str = "alice",
    order: str = "A1",
) -> ChatTurn:
    """A chat turn of ``user_id`` stopped on ``refund(order)``, as the application runs it."""
    model.add(ScriptedProvider.call("refund", order_id=order))
    async with ChatSession(
        runtime, "support", user_id, session_id, store=memory, extract_in_background=False
    ) as chat:
        turn = await chat.send(f"please refund {order}")
    assert turn.status == "awaiting_approval"
    return turn


def decide(client: TestClient, turn: Any, choice: str, **extra: str) -> Any:
    """POST the approval page's form: ``choice`` for every pending call, confirmed."""
    result = turn.result if hasattr(turn, "result") else turn
    form = {"id": result.checkpoint_id, "confirm": "yes"}
    form.update({f"call:{c.call_id}": choice for c in result.pending})
    form.update(extra)
    return post(client, "/approval/decide", form)


def flashes(client: TestClient, path: str = "/approvals") -> str:
    return client.get(path).text


async def test_the_page_lists_what_awaits_approval(
    client: TestClient, runtime: Runtime, memory: SqliteMemoryStore, model: ScriptedProvider
) -> None:
    turn = await paused_turn(runtime, memory, model)
    model.add(ScriptedProvider.call("refund", order_id=HOSTILE))
    plain = await runtime.invoke("support", "refund the hostile order", run_id="run-9")
    assert plain.checkpoint_id is not None
    page = client.get("/approvals")
    assert page.status_code == 200
    text = page.text
    for checkpoint_id in (turn.result.checkpoint_id, plain.checkpoint_id):
        assert f"<code>{checkpoint_id}</code>" in text
        assert f'href="/approval?id={checkpoint_id}"' in text
    assert "<td>alice</td>" in text
    assert 'href="/session?id=s-1"' in text  # the chat turn names its session
    assert "{&#34;order_id&#34;: &#34;A1&#34;}" in text
    assert HOSTILE not in text  # arguments are shown as text
    assert f"{{&#34;order_id&#34;: &#34;{escape(HOSTILE)}&#34;}}" in text
    assert text.count("awaiting approval</span>") == 2
    one = client.get(f"/approval?id={turn.result.checkpoint_id}")
    assert one.status_code == 200
    [call] = turn.result.pending
    assert f'name="call:{call.call_id}" value="approve"' in one.text
    assert f'name="call:{call.call_id}" value="deny"' in one.text
    assert 'name="confirm" value="yes"' in one.text
    # The session page links the paused turn to its approval page.
    session = client.get("/session?id=s-1").text
    assert f'href="/approval?id={turn.result.checkpoint_id}"' in session
    assert "A turn awaits approval" in session


async def test_approve_runs_the_call_once_and_stores_the_chat_turn(
    client: TestClient,
    runtime: Runtime,
    memory: SqliteMemoryStore,
    model: ScriptedProvider,
    checkpoints: SqliteCheckpointStore,
) -> None:
    turn = await paused_turn(runtime, memory, model)
    model.add(ScriptedProvider.final("refunded"))
    response = decide(client, turn, "approve")
    assert response.status_code == 303
    assert response.headers["location"] == "/approvals"
    assert REFUNDS == ["A1"]
    assert await checkpoints.get(turn.result.checkpoint_id or "") is None
    page = flashes(client)
    assert "Approved 1, denied 0. The chat turn completed." in page
    assert "It is stored as turn 1 of session s-1." in page
    assert "Nothing awaits approval." in page
    [stored] = await memory.list_turns("s-1")
    assert stored.user == "please refund A1"
    assert stored.replies == ("refunded",)
    [[call]] = stored.trace
    assert (call.name, call.status) == ("refund", "ok")
    # The same approval again: the checkpoint is gone, nothing runs twice.
    again = decide(client, turn, "approve")
    assert again.status_code == 303
    assert REFUNDS == ["A1"]
    assert "Nothing done: no checkpoint" in flashes(client)


async def test_deny_tells_the_model_the_operator_refused(
    client: TestClient, runtime: Runtime, memory: SqliteMemoryStore, model: ScriptedProvider
) -> None:
    turn = await paused_turn(runtime, memory, model, order="B2")
    model.add(ScriptedProvider.final("no refund then"))
    assert decide(client, turn, "deny").status_code == 303
    assert REFUNDS == []
    [answer] = model.requests[-1].observations
    assert answer.status == "denied"
    assert answer.error == "'refund' needs approval and was not approved (refused by operator)"
    assert "Approved 0, denied 1." in flashes(client)
    [stored] = await memory.list_turns("s-1")
    assert stored.trace[0][0].status == "denied"


async def test_a_plain_invocation_resumes_through_the_runtime_with_the_actor_recorded(
    client: TestClient,
    runtime: Runtime,
    model: ScriptedProvider,
    checkpoints: SqliteCheckpointStore,
) -> None:
    model.add(ScriptedProvider.call("refund", order_id="A1"))
    first = await runtime.invoke("support", "two refunds", run_id="batch-1")
    # Approved, the first refund runs and the model asks for a second: paused again.
    model.add(ScriptedProvider.call("refund", order_id="C3"))
    assert decide(client, first, "approve").status_code == 303
    assert REFUNDS == ["A1"]
    [info] = await checkpoints.list(run_id="batch-1")
    assert "The invocation paused again, awaiting approval: checkpoint " + info.checkpoint_id in (
        flashes(client)
    )
    body = await checkpoints.get(info.checkpoint_id)
    assert body is not None
    trace: Any = body["trace"]
    [granted] = [e for e in trace if e["kind"] == "approval_granted"]
    assert granted["actor"] == "operator"
    assert granted["name"] == "refund"


@pytest.mark.parametrize("missing", ["confirm", "decision"])
async def test_nothing_runs_without_a_decision_for_every_call_and_the_confirmation(
    client: TestClient,
    runtime: Runtime,
    memory: SqliteMemoryStore,
    model: ScriptedProvider,
    checkpoints: SqliteCheckpointStore,
    missing: str,
) -> None:
    turn = await paused_turn(runtime, memory, model)
    form = {"id": turn.result.checkpoint_id or "", "confirm": "yes"}
    form.update({f"call:{c.call_id}": "approve" for c in turn.result.pending})
    if missing == "confirm":
        del form["confirm"]
    else:
        form = {k: v for k, v in form.items() if not k.startswith("call:")}
    response = post(client, "/approval/decide", form)
    assert response.status_code == 303
    assert REFUNDS == []
    assert await checkpoints.get(turn.result.checkpoint_id or "") is not None
    page = flashes(client, f"/approval?id={turn.result.checkpoint_id}")
    assert "Nothing done:" in page


@pytest.mark.parametrize(
    "headers",
    [
        {"origin": "http://evil.example"},
        {"origin": "null"},
        {},  # a POST with neither Origin nor Referer
    ],
)
async def test_a_cross_site_decision_is_refused(
    client: TestClient,
    runtime: Runtime,
    memory: SqliteMemoryStore,
    model: ScriptedProvider,
    checkpoints: SqliteCheckpointStore,
    headers: dict[str, str],
) -> None:
    turn = await paused_turn(runtime, memory, model)
    [call] = turn.result.pending
    form = {
        "csrf": csrf_of(client),
        "id": turn.result.checkpoint_id,
        f"call:{call.call_id}": "approve",
        "confirm": "yes",
    }
    response = client.post("/approval/decide", data=form, headers=headers)
    assert response.status_code == 403
    assert "Origin check" in response.text
    assert REFUNDS == []
    assert await checkpoints.get(turn.result.checkpoint_id or "") is not None


@pytest.mark.parametrize("csrf", [None, "wrong-token"])
async def test_a_decision_without_the_csrf_token_is_refused(
    client: TestClient,
    runtime: Runtime,
    memory: SqliteMemoryStore,
    model: ScriptedProvider,
    checkpoints: SqliteCheckpointStore,
    csrf: str | None,
) -> None:
    turn = await paused_turn(runtime, memory, model)
    [call] = turn.result.pending
    form = {"id": turn.result.checkpoint_id, f"call:{call.call_id}": "approve", "confirm": "yes"}
    if csrf is not None:
        form["csrf"] = csrf
    for path in ("/approval/decide", "/approval/recover"):
        response = client.post(path, data=form, headers=ORIGIN)
        assert response.status_code == 403
        assert "CSRF token is missing or wrong" in response.text
    assert REFUNDS == []
    assert await checkpoints.get(turn.result.checkpoint_id or "") is not None


def test_the_pages_need_a_logged_in_operator(anonymous: TestClient) -> None:
    for path in ("/approvals", "/approval?id=x"):
        assert anonymous.get(path).status_code == 401
    for path in ("/approval/decide", "/approval/recover"):
        assert anonymous.post(path, data={"id": "x"}, headers=ORIGIN).status_code == 401


async def test_an_unknown_checkpoint_is_one_line_and_changes_nothing(client: TestClient) -> None:
    page = client.get("/approval?id=nope")
    assert page.status_code == 404
    assert "no checkpoint &#39;nope&#39;: it is unknown, or it was already resumed" in page.text
    assert "Traceback" not in page.text
    response = post(client, "/approval/decide", {"id": "nope", "call:c1": "approve"})
    assert response.status_code == 303
    assert "Nothing done: no checkpoint &#39;nope&#39;" in flashes(client)
    response = post(client, "/approval/recover", {"id": "nope", "worker_stopped": "yes"})
    assert response.status_code == 303
    assert "Nothing done: no checkpoint &#39;nope&#39;" in flashes(client)


async def test_a_checkpoint_resumed_by_someone_else_meanwhile_is_refused(
    client: TestClient, runtime: Runtime, memory: SqliteMemoryStore, model: ScriptedProvider
) -> None:
    turn = await paused_turn(runtime, memory, model)
    page = client.get(f"/approval?id={turn.result.checkpoint_id}")  # the operator reads it...
    assert page.status_code == 200
    model.add(ScriptedProvider.final("done elsewhere"))
    async with ChatSession(  # ... while the application resumes it itself
        runtime, "support", "alice", "s-1", store=memory, extract_in_background=False
    ) as chat:
        await chat.resume(
            {c.call_id: True for c in turn.result.pending},
            checkpoint_id=turn.result.checkpoint_id,
        )
    assert REFUNDS == ["A1"]
    response = decide(client, turn, "deny")
    assert response.status_code == 303
    assert REFUNDS == ["A1"]
    assert "Nothing done: no checkpoint" in flashes(client)
    [stored] = await memory.list_turns("s-1")  # stored once, by the application's resume
    assert stored.replies == ("done elsewhere",)


async def test_a_checkpoint_a_live_worker_runs_offers_nothing(
    client: TestClient,
    runtime: Runtime,
    memory: SqliteMemoryStore,
    model: ScriptedProvider,
    checkpoints: SqliteCheckpointStore,
) -> None:
    turn = await paused_turn(runtime, memory, model)
    checkpoint_id = turn.result.checkpoint_id or ""
    body = await checkpoints.get(checkpoint_id)
    assert body is not None
    # Claimed by a resume of this very process (alive): a running checkpoint.
    import socket

    from touba.history._common import Reservation

    holder = Reservation.new("worker-here").describe()
    assert holder["pid"] == os.getpid()
    assert holder["host"] == socket.gethostname()
    running = {**body, "status": "running", "revision": 1, "holder": holder}
    assert await checkpoints.replace(checkpoint_id, running, revision=0)
    listed = client.get("/approvals").text
    assert '<span class="status running">running</span>' in listed
    assert "approve or deny</a>" not in listed
    assert "There is nothing to decide" not in listed
    one = client.get(f"/approval?id={checkpoint_id}").text
    assert "A worker runs this invocation now (worker-here)" in one
    assert decide(client, turn, "approve").status_code == 303
    assert "is not awaiting approval now" in flashes(client, f"/approval?id={checkpoint_id}")
    response = post(client, "/approval/recover", {"id": checkpoint_id, "worker_stopped": "yes"})
    assert response.status_code == 303
    assert "is not held by a stopped worker" in flashes(client, f"/approval?id={checkpoint_id}")
    assert REFUNDS == []
    assert await checkpoints.get(checkpoint_id) == running


async def test_a_checkpoint_held_by_a_killed_worker_shows_recover(
    client: TestClient,
    runtime: Runtime,
    memory: SqliteMemoryStore,
    model: ScriptedProvider,
    checkpoints: SqliteCheckpointStore,
    private_dir: Path,
) -> None:
    turn = await paused_turn(runtime, memory, model)
    checkpoint_id = turn.result.checkpoint_id or ""
    [call] = turn.result.pending
    await crash_while_resuming(private_dir, "s-1", checkpoint_id, call.call_id, "alice")
    body = await checkpoints.get(checkpoint_id)
    assert body is not None
    assert body["status"] == "running"
    listed = client.get("/approvals").text
    assert "held by a stopped worker" in listed
    assert "approve or deny</a>" not in listed
    one = client.get(f"/approval?id={checkpoint_id}").text
    assert "That process is gone (checked on this host)." in one
    assert 'action="/approval/recover"' in one
    assert 'action="/approval/decide"' not in one
    # Approving is refused; recovering needs the confirmation.
    assert decide(client, turn, "approve").status_code == 303
    assert "is not awaiting approval now" in flashes(client, f"/approval?id={checkpoint_id}")
    assert post(client, "/approval/recover", {"id": checkpoint_id}).status_code == 303
    assert "confirm that you stopped" in flashes(client, f"/approval?id={checkpoint_id}")
    assert await checkpoints.get(checkpoint_id) is not None
    model.add(ScriptedProvider.final("I could not tell whether the refund happened"))
    response = post(client, "/approval/recover", {"id": checkpoint_id, "worker_stopped": "yes"})
    assert response.status_code == 303
    page = flashes(client)
    assert "Recovered. The chat turn completed. It is stored as turn 1 of session s-1." in page
    assert REFUNDS == []  # the started refund was not run again
    assert await checkpoints.get(checkpoint_id) is None
    [answer] = model.requests[-1].observations
    assert answer.status == "error"
    assert "outcome of this call of 'refund' is unknown" in (answer.error or "")
    [stored] = await memory.list_turns("s-1")
    assert stored.trace[0][0].status == "error"


async def test_without_a_runtime_the_page_says_how_to_give_one(
    program: Any, memory: SqliteMemoryStore, history: SqliteHistoryStore
) -> None:
    app = create_app(program, memory, history, token=TOKEN)
    with TestClient(app, base_url="http://127.0.0.1:8765", follow_redirects=False) as client:
        client.get(f"/?token={TOKEN}")
        page = client.get("/approvals")
        assert page.status_code == 200
        assert "No checkpoint store was given: start the panel with --checkpoints-db" in page.text
        response = post(client, "/approval/decide", {"id": "x"})
        assert response.status_code == 303
        assert "No checkpoint store was given" in client.get("/approvals").text
        assert client.get("/approval?id=x").status_code == 404


async def test_create_app_refuses_a_runtime_of_another_program(
    runtime: Runtime, memory: SqliteMemoryStore
) -> None:
    with pytest.raises(ConfigurationError, match="running the panel's program"):
        create_app(build_program(), memory, token=TOKEN, runtime=runtime)


async def test_a_turn_whose_session_ended_since_resumes_through_the_runtime(
    client: TestClient,
    runtime: Runtime,
    memory: SqliteMemoryStore,
    model: ScriptedProvider,
    checkpoints: SqliteCheckpointStore,
) -> None:
    turn = await paused_turn(runtime, memory, model)
    async with ChatSession(  # another process's session object ends the session
        runtime, "support", "alice", "s-1", store=memory, extract_in_background=False
    ) as other:
        await other.end()
    model.add(ScriptedProvider.final("refunded"))
    assert decide(client, turn, "approve").status_code == 303
    assert REFUNDS == ["A1"]
    page = flashes(client)
    assert "The invocation completed. Its chat session had ended: the turn is not stored" in page
    assert await memory.list_turns("s-1") == ()
    assert await checkpoints.get(turn.result.checkpoint_id or "") is None


async def test_a_long_list_shows_the_oldest_and_counts_the_rest(
    client: TestClient,
    runtime: Runtime,
    memory: SqliteMemoryStore,
    model: ScriptedProvider,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("touba.panel._approvals.SHOWN", 1)
    first = await paused_turn(runtime, memory, model, session_id="s-1")
    second = await paused_turn(runtime, memory, model, session_id="s-2", user_id="bob")
    page = client.get("/approvals").text
    assert f"<code>{first.result.checkpoint_id}</code>" in page
    assert f"<code>{second.result.checkpoint_id}</code>" not in page
    assert "1 more not shown (the oldest are listed first)." in page

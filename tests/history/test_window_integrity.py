"""Nothing a provider would reject is sent: damaged rows are caught before any request.

Built-in durable stores keep messages as rows that anyone with access to the
database can damage. The rows of real SQLite files, PostgreSQL tables and
Redis lists are damaged here (a result row deleted, a ``call_id`` changed);
the next decision through the OpenAI provider, its context guard on, is
refused with ``DecisionHistoryRecordInvalid`` naming the conversation, the fake
server's request log shows that nothing was sent (no count, no generation),
and the store holds what it held, its key free. The check reads only the
window: damage outside it does not stop a decision.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import openai
import pytest

from tests._services import postgres_dsn
from tests.history._stores import LOOKUP, Stores, state
from touba.errors import DecisionHistoryRecordInvalid
from touba.history import (
    CapabilityCall,
    ConversationIdentity,
    DataMessage,
    DecisionHistory,
    DecisionMessage,
    HistoryConfig,
    HistoryWindow,
    Observation,
    ResultMessage,
    SummaryMessage,
)
from touba.history._integrity import check_window
from touba.history.sqlite import SqliteHistoryStore
from touba.providers import ContextConfig, DecisionRequest
from touba.providers.openai import create_openai_decision_provider
from touba.testing.fakes import FakeOpenAIServer, openai_function_call, openai_text

NS = "integrity"


def request(**kwargs: Any) -> DecisionRequest:
    return DecisionRequest(
        run_id="r1",
        invocation_id="i1",
        agent_ref="support",
        instructions="Help with orders.",
        input="Where are orders A1 and B2?",
        capabilities=(LOOKUP,),
        **kwargs,
    )


def answer(decision: Any, result: Any) -> tuple[Observation, ...]:
    (call,) = decision.calls
    return (Observation(call.call_id, call.name, call.arguments, "ok", result),)


# -- damaging the rows of each backend -----------------------------------------------------


class Rows:
    """The message rows of one conversation, edited behind the store's back."""

    def __init__(self, stores: Stores, store: Any, key: str) -> None:
        self.kind = stores.kind
        self.where = stores.location("main")
        self.store = store
        self.key = key

    async def _all(self) -> list[tuple[Any, int, dict[str, Any]]]:
        """(row handle, exchange, message) in order."""
        if self.kind == "sqlite":
            with sqlite3.connect(self.where[0]) as conn:
                found = conn.execute(
                    "SELECT id, exchange, body FROM touba_history_messages WHERE conv = "
                    "(SELECT id FROM touba_history_sessions WHERE key = ?) ORDER BY exchange, seq",
                    (self.key,),
                ).fetchall()
            return [(i, ex, json.loads(body)) for i, ex, body in found]
        if self.kind == "postgres":
            import psycopg
            from psycopg import sql

            table = sql.Identifier(*f"{self.where[1]}_messages".split("."))
            query = sql.SQL("SELECT seq, exchange, body FROM {} WHERE key = %s ORDER BY seq")
            with psycopg.connect(postgres_dsn(), autocommit=True) as conn:
                found = conn.execute(query.format(table), (self.key,)).fetchall()
            return [(seq, ex, json.loads(body)) for seq, ex, body in found]
        rows = await self.store._client.lrange(self._redis_list(), 0, -1)
        out = []
        for index, raw in enumerate(rows):
            exchange, _size, message = json.loads(raw)
            out.append((index, exchange, message))
        return out

    def _redis_list(self) -> str:
        return str(self.store._keys(self.key).messages)

    async def _find(self, exchange: int, kind: str) -> tuple[Any, dict[str, Any]]:
        for handle, ex, message in await self._all():
            if ex == exchange and message["kind"] == kind:
                return handle, message
        raise AssertionError(f"no {kind} row in exchange {exchange}")

    async def delete(self, exchange: int, kind: str) -> None:
        handle, _ = await self._find(exchange, kind)
        if self.kind == "sqlite":
            with sqlite3.connect(self.where[0]) as conn:
                conn.execute("DELETE FROM touba_history_messages WHERE id = ?", (handle,))
        elif self.kind == "postgres":
            await self._pg("DELETE FROM {} WHERE key = %s AND seq = %s", (self.key, handle))
        else:
            name = self._redis_list()
            await self.store._client.lset(name, handle, "deleted")
            await self.store._client.lrem(name, 1, "deleted")

    async def edit_call_id(self, exchange: int, kind: str, new: str) -> None:
        handle, message = await self._find(exchange, kind)
        if kind == "decision":
            message["calls"][0]["call_id"] = new
        else:
            message["call_id"] = new
        body = json.dumps(message, separators=(",", ":"))
        if self.kind == "sqlite":
            with sqlite3.connect(self.where[0]) as conn:
                conn.execute(
                    "UPDATE touba_history_messages SET body = ? WHERE id = ?", (body, handle)
                )
        elif self.kind == "postgres":
            await self._pg(
                "UPDATE {} SET body = %s WHERE key = %s AND seq = %s", (body, self.key, handle)
            )
        else:
            row = f"[{exchange},{len(body.encode())},{body}]"
            await self.store._client.lset(self._redis_list(), handle, row)

    async def _pg(self, statement: str, params: Sequence[Any]) -> None:
        import psycopg
        from psycopg import sql

        table = sql.Identifier(*f"{self.where[1]}_messages".split("."))
        with psycopg.connect(postgres_dsn(), autocommit=True) as conn:
            conn.execute(sql.SQL(statement).format(table), params)


DAMAGES = {
    "result row deleted": lambda rows: rows.delete(0, "result"),
    "result call_id changed": lambda rows: rows.edit_call_id(0, "result", "call_forged"),
    "decision call_id changed": lambda rows: rows.edit_call_id(1, "decision", "call_forged"),
    "pending decision deleted": lambda rows: rows.delete(1, "decision"),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
async def test_a_damaged_window_is_refused_before_any_request(
    durable: Stores, openai_server: FakeOpenAIServer, openai_client: openai.AsyncOpenAI, damage: str
) -> None:
    store = durable("main")
    provider = create_openai_decision_provider(
        model="gpt-test",
        client=openai_client,
        history=HistoryConfig(store=store, namespace=NS),
        context=ContextConfig(context_window_tokens=100_000),
        max_output_tokens=100,
    )
    openai_server.script_response(openai_function_call("lookup_order", {"order_id": "A1"}))
    first = await provider.decide(request())
    openai_server.script_response(openai_function_call("lookup_order", {"order_id": "B2"}))
    second = await provider.decide(request(observations=answer(first, {"status": "shipped"})))
    (row,) = await store.list()
    await DAMAGES[damage](Rows(durable, store, row.key))

    sent, before = len(openai_server.requests), await state(store)
    openai_server.script_response(openai_text("never generated"))
    with pytest.raises(DecisionHistoryRecordInvalid) as caught:
        await provider.decide(request(observations=answer(second, {"status": "late"})))
    assert f"conversation {row.key} is damaged" in str(caught.value)
    assert "Nothing was sent to the provider and nothing was written" in str(caught.value)
    assert len(openai_server.requests) == sent  # no count request, no generation
    assert openai_server.pending("responses") == 1
    assert await state(store) == before  # nothing appended, the key free (read works)
    assert not (await store.list())[0].active


# -- the check reads the window only -------------------------------------------------------


def identity() -> ConversationIdentity:
    return ConversationIdentity(NS, "openai", "m", "native", "r1", "i1", "support")


class Provider:
    def __init__(self) -> None:
        self.windows: list[HistoryWindow] = []
        self.count = 0

    async def __call__(self, window: HistoryWindow) -> DecisionMessage:
        self.windows.append(window)
        self.count += 1
        return DecisionMessage(calls=(CapabilityCall(f"c{self.count}", "lookup", {}),))


async def test_damage_outside_the_window_does_not_stop_a_decision(tmp_path: Path) -> None:
    path = tmp_path / "h.sqlite"
    async with SqliteHistoryStore(path) as store:
        history = DecisionHistory(HistoryConfig(store=store, namespace=NS, max_messages=4))
        provider = Provider()
        observations: list[Observation] = []
        for _ in range(40):
            await history.step(identity(), observations, provider)
            observations = [Observation(f"c{provider.count}", "lookup", {}, "ok", "done")]
        with sqlite3.connect(path) as conn:  # exchange 0 loses its result; it is long trimmed
            conn.execute(
                "DELETE FROM touba_history_messages WHERE exchange = 0 AND body LIKE "
                '\'%"kind":"result"%\''
            )
        await history.step(identity(), observations, provider)
        assert provider.windows[-1].start > 30  # the window is the last exchanges only
        with sqlite3.connect(path) as conn:  # now damage inside the window
            last = conn.execute("SELECT MAX(exchange) FROM touba_history_messages").fetchone()[0]
            conn.execute(
                "DELETE FROM touba_history_messages WHERE exchange = ? AND body LIKE "
                '\'%"kind":"result"%\'',
                (last - 1,),
            )
        observations = [Observation(f"c{provider.count}", "lookup", {}, "ok", "done")]
        with pytest.raises(DecisionHistoryRecordInvalid, match=f"in exchange {last - 1}"):
            await history.step(identity(), observations, provider)
        assert provider.count == 41


# -- the rules, one by one -----------------------------------------------------------------

CALL_A = CapabilityCall("a", "lookup", {})
CALL_B = CapabilityCall("b", "refund", {})


def result(call_id: str, name: str = "lookup") -> ResultMessage:
    return ResultMessage(call_id, name, {}, "ok", "done")


DECISION = DecisionMessage(calls=(CALL_A, CALL_B))
WELL_FORMED: list[list[Any]] = [
    [DECISION, result("a"), result("b", "refund")],
    [DataMessage((result("x"),))],
    [DecisionMessage(text="done", final=True)],
]
MALFORMED: dict[str, tuple[list[Any], str]] = {
    "empty exchange": ([], "holds no message"),
    "result first": ([result("a")], "comes without the decision"),
    "missing result": ([DECISION, result("a")], "call(s) 'b' have no result"),
    "results out of order": ([DECISION, result("b", "refund"), result("a")], "awaits it"),
    "result of another call": ([DECISION, result("a"), result("z", "refund")], "awaits it"),
    "result of another name": ([DECISION, result("a"), result("b")], "awaits it"),
    "extra result": ([DECISION, result("a"), result("b", "refund"), result("c")], "no call"),
    "answered twice": ([DECISION, result("a"), result("a"), result("b")], "awaits it"),
    "repeated call id": (
        [DecisionMessage(calls=(CALL_A, CALL_A)), result("a"), result("a")],
        "repeats a call id",
    ),
    "data with a result": ([DataMessage((result("x"),)), result("x")], "shares it"),
    "summary inside": ([SummaryMessage("s", 1, "sha256:x")], "starts with a summary"),
    "two decisions": ([DECISION, DecisionMessage(text="again")], "a decision message follows"),
}


def test_well_formed_exchanges_pass() -> None:
    check_window("k", 0, WELL_FORMED)


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_exchanges_are_refused(case: str) -> None:
    exchange, expected = MALFORMED[case]
    with pytest.raises(DecisionHistoryRecordInvalid) as caught:
        check_window("th1:key", 7, [*WELL_FORMED, exchange])
    message = str(caught.value)
    assert "conversation th1:key is damaged: in exchange 10" in message
    assert expected in message

"""How the integrations keep a framework's messages in a touba store.

One conversation (an Agents SDK session, a pydantic-ai conversation) is one
record of a :class:`~touba.history.HistoryStore`, under a key made by touba's
own :func:`~touba.history.conversation_key` from the namespace, the
integration's name and the conversation id (the other identity fields are
empty, so it never collides with a decision-history conversation, whose run,
invocation and agent are never empty). The record is::

    {"kind": "touba.<integration>", "version": 1, "namespace": ..., "conversation_id": ...,
     "items": [<the framework's messages as JSON>, ...], "bytes": int,
     "created_at": iso8601, "updated_at": iso8601}

Every change is one store transaction (``transact``, or ``transact_log`` for
version 2 below): the store's reservation makes it
exclusive (a concurrent operation on the same key is refused at once with
``DecisionHistoryBusy``), survives a crashed worker until
``store.recover(key, worker_stopped=True)``, and its capacity, expiry and
file protections apply unchanged. Version 1 is read and written whole by
each operation, at a cost that grows with the conversation; on the built-in
stores the integrations keep version 2, an append-only log of exchanges
(:mod:`touba.integrations._items_log`) or of turns
(:mod:`touba.integrations._turns_log`).
:class:`Held` and :class:`HeldLog` hold one of these transactions open across
a block of the caller's code (a whole run).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from datetime import UTC, datetime
from types import TracebackType
from typing import Any, Final, Generic, TypeVar

from touba.errors import (
    ConfigurationError,
    DecisionHistoryLimitExceeded,
    DecisionHistoryMismatch,
    DecisionHistoryRecordInvalid,
)
from touba.history import HistoryStore, conversation_key
from touba.history._model import canonical_json, json_problem
from touba.history._store import LogSnapshot, LogStore, LogWrite, StoreUsage

__all__ = [
    "RECORD_VERSION",
    "Held",
    "HeldLog",
    "Record",
    "check_id",
    "check_owner",
    "check_retained",
    "check_store",
    "conversation_store_key",
    "corrupt",
    "dump_item_texts",
    "exchange_objects",
    "foreign_kind",
    "log_head",
    "now",
    "record_items",
]

RECORD_VERSION: Final = 1
Record = dict[str, Any]
T = TypeVar("T")


def check_id(name: str, value: object) -> str:
    """A non-empty str, refused early with ``ConfigurationError`` otherwise."""
    if not isinstance(value, str) or not value:
        raise ConfigurationError(f"{name} must be a non-empty str, got {value!r}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ConfigurationError(f"{name} is not valid Unicode text ({e.reason})") from e
    return value


def check_store(store: object) -> HistoryStore:
    if not isinstance(store, HistoryStore):
        raise ConfigurationError(
            f"store must be a touba HistoryStore (SqliteHistoryStore, PostgresHistoryStore, "
            f"RedisHistoryStore, MemoryHistoryStore or your own), got {type(store).__name__}"
        )
    return store


def conversation_store_key(namespace: str, integration: str, conversation_id: str) -> str:
    """The store key of one integration conversation (touba's key function)."""
    return conversation_key(namespace, integration, "", "conversation", conversation_id, "", "")


def dump_item_texts(items: Sequence[object], what: str) -> tuple[list[Record], list[str]]:
    """JSON-compatible private copies of ``items``, with the compact JSON of each (what
    a store keeps); ``TypeError`` naming the first that is not."""
    copies: list[Record] = []
    texts: list[str] = []
    for index, item in enumerate(items):
        if not isinstance(item, Mapping):
            raise TypeError(f"{what} {index} is a {type(item).__name__}, not a JSON object")
        problem = json_problem(item, f"{what} {index}")  # nesting bounded as the history's
        if problem is not None:
            raise TypeError(f"{problem}; nothing saved")
        try:
            text = canonical_json(item)
            text.encode("utf-8")
        except (TypeError, ValueError) as e:
            raise TypeError(f"{what} {index} is not JSON-compatible ({e}); nothing saved") from e
        copies.append(json.loads(text))
        texts.append(text)
    return copies, texts


def now() -> str:
    """The time of a write, as records keep it (ISO 8601, UTC)."""
    return datetime.now(UTC).isoformat()


def log_head(
    kind: str, version: int, namespace: str, conversation_id: str, **fields: Any
) -> Record:
    """A new log record's head: who it belongs to, then ``fields``, then its times."""
    stamp = now()
    return {
        "kind": kind,
        "version": version,
        "namespace": namespace,
        "conversation_id": conversation_id,
        **fields,
        "created_at": stamp,
        "updated_at": stamp,
    }


def corrupt(kind: str, what: str) -> DecisionHistoryRecordInvalid:
    """The refusal of a record of ``kind`` that is damaged (``what`` says where)."""
    return DecisionHistoryRecordInvalid(
        f"the stored {kind} record is corrupt ({what}); it was not modified. Inspect it with "
        "`touba history show`"
    )


def exchange_objects(record: Record, kind: str) -> list[Record]:
    """The objects of a version 2 record's ``exchanges``, oldest first (``corrupt``
    when they are not lists of objects)."""
    exchanges = record.get("exchanges")
    if not isinstance(exchanges, list) or not all(
        isinstance(ex, list) and all(isinstance(o, dict) for o in ex) for ex in exchanges
    ):
        raise corrupt(kind, "its exchanges are not lists of objects")
    return [o for exchange in exchanges for o in exchange]


def check_retained(size: int, max_retained_bytes: int) -> None:
    """``DecisionHistoryLimitExceeded`` when a conversation would retain more than allowed."""
    if size > max_retained_bytes:
        raise DecisionHistoryLimitExceeded(
            f"this conversation would retain {size} bytes, over max_retained_bytes="
            f"{max_retained_bytes}; nothing was written. Clear or shorten the conversation, or "
            "raise max_retained_bytes",
            limit="max_retained_bytes",
        )


def record_items(
    record: Record | None, *, kind: str, namespace: str, conversation_id: str
) -> list[Record]:
    """The items of a stored record (``[]`` when there is none), after checking it is ours."""
    if record is None:
        return []
    if record.get("kind") != kind:
        raise foreign_kind(kind)
    if record.get("version") != RECORD_VERSION:
        raise DecisionHistoryRecordInvalid(
            f"the stored {kind} record has version {record.get('version')!r}; this touba reads "
            f"version {RECORD_VERSION}. Upgrade touba (or delete the record); it was not modified"
        )
    items = record.get("items")
    if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
        raise DecisionHistoryRecordInvalid(
            f"the stored {kind} record is corrupt (its items are not a list of objects); it "
            "was not modified. Inspect it with `touba history show`"
        )
    check_owner(record, namespace=namespace, conversation_id=conversation_id)
    return items


def foreign_kind(kind: str) -> DecisionHistoryRecordInvalid:
    """The refusal of a record of another kind under a conversation's key."""
    return DecisionHistoryRecordInvalid(
        f"the value stored under this conversation's key is not a {kind} record; it was "
        "not modified. Use another namespace, or delete the key"
    )


def check_owner(record: Mapping[str, Any], *, namespace: str, conversation_id: str) -> None:
    """``DecisionHistoryMismatch`` when ``record`` is another conversation's."""
    if record.get("namespace") != namespace or record.get("conversation_id") != conversation_id:
        raise DecisionHistoryMismatch(
            "the record found under this key belongs to another conversation; it was not modified"
        )


class _Abandon(Exception):
    """Tells a held transaction to keep the stored state."""


class _Holding(Generic[T]):
    """One store transaction held open across a block of the caller's code (see
    :class:`Held`); a subclass gives the transaction, whose operation loads through
    :meth:`_hold` and then saves."""

    def __init__(self, transaction: Callable[[], Coroutine[Any, Any, Any]]) -> None:
        self._transaction = transaction
        self._task: asyncio.Task[Any] | None = None
        self._loaded: asyncio.Future[T] | None = None
        self._outcome: asyncio.Future[None] | None = None

    async def _hold(self, loading: Awaitable[T]) -> None:
        """Give the block what ``loading`` gives, then wait for the block to end:
        raises ``_Abandon`` (or is cancelled) when the stored state must stay."""
        assert self._loaded is not None
        assert self._outcome is not None
        try:
            value = await loading
        except BaseException as e:
            self._loaded.set_exception(e)
            raise
        self._loaded.set_result(value)
        await self._outcome

    async def __aenter__(self) -> T:
        loop = asyncio.get_running_loop()
        self._loaded = loop.create_future()
        self._outcome = loop.create_future()
        self._task = asyncio.create_task(self._transaction())
        try:
            waited: set[asyncio.Future[Any]] = {self._task, self._loaded}
            await asyncio.wait(waited, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            raise
        if not self._loaded.done():  # the store refused before loading: busy, full, closed
            self._task.result()
            raise AssertionError("the store's transaction ended without running the operation")
        if self._loaded.exception() is not None:
            await asyncio.gather(self._task, return_exceptions=True)
        return self._loaded.result()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._task is not None
        assert self._outcome is not None
        if exc is None:
            self._outcome.set_result(None)
            await self._task  # the save's own refusal (capacity, busy) surfaces here
            return
        self._outcome.set_exception(_Abandon())
        with contextlib.suppress(_Abandon):
            await self._task


class Held(_Holding[T]):
    """One ``store.transact`` held open across a block of the caller's code.

    ``async with Held(store, key, load, save) as value:`` reserves ``key`` (or
    raises ``DecisionHistoryBusy`` at once), gives ``load(snapshot)``'s value,
    and on a clean exit saves ``save(snapshot)``, in the store's one atomic
    step that also clears the reservation. An exception (or cancellation) in
    the block keeps the stored state and releases the key; a crashed process
    leaves the key reserved until ``store.recover(key, worker_stopped=True)``.
    The store's transaction runs in a task this object owns and awaits before
    leaving the block.
    """

    def __init__(
        self,
        store: HistoryStore,
        key: str,
        load: Callable[[Record | None], T],
        save: Callable[[Record | None], Record | None],
    ) -> None:
        async def operation(snapshot: Record | None) -> tuple[Record | None, None]:
            async def loading() -> T:
                return load(snapshot)

            await self._hold(loading())
            return save(snapshot), None

        super().__init__(lambda: store.transact(key, operation))


class HeldLog(_Holding[T]):
    """:class:`Held` over a store's ``transact_log``: ``load(snapshot)`` reads what
    the block needs of the log, and on a clean exit ``save()``'s write is applied."""

    def __init__(
        self,
        store: LogStore,
        key: str,
        load: Callable[[LogSnapshot | None], Awaitable[T]],
        save: Callable[[], LogWrite | None],
    ) -> None:
        async def operation(
            snapshot: LogSnapshot | None, usage: StoreUsage | None
        ) -> tuple[LogWrite | None, None]:
            await self._hold(load(snapshot))
            return save(), None

        super().__init__(lambda: store.transact_log(key, operation))

"""OpenAI Agents SDK sessions on touba's stores: :class:`ToubaSession`.

```python
from agents import Agent, Runner
from touba.history.sqlite import SqliteHistoryStore
from touba.integrations.openai_agents import ToubaSession

async with SqliteHistoryStore(".touba/sessions.sqlite") as store:
    session = ToubaSession("user-42", store=store, namespace="support")
    result = await Runner.run(agent, "Where is my order?", session=session)
```

Behaviour decisions:

- **Storage.** A session is one record of the touba store you give (SQLite,
  PostgreSQL, Redis, RAM or your own ``HistoryStore``), under a key made by
  touba's key function from ``namespace`` and ``session_id``
  (:attr:`ToubaSession.session_key`). The store's guarantees apply as they
  are: 0600 SQLite files in a private directory, capacity refused atomically
  (``DecisionHistoryLimitExceeded``, nothing written), expiry, namespaces that
  never see each other's sessions.
- **One transaction per operation.** ``get_items``, ``add_items``,
  ``pop_item`` and ``clear_session`` each run as one store transaction: an
  operation that meets another in progress on the same session (another
  worker, another run) is refused at once with ``DecisionHistoryBusy`` rather
  than interleaving, and a worker that dies inside one that reserved leaves the
  session reserved until ``store.recover(session.session_key, worker_stopped=True)``.
  ``get_items`` on SQLite, PostgreSQL and Redis never reserves (see below): a
  worker killed while it reads leaves nothing to recover.
  Each counts as activity for the store's expiry (``ttl_seconds`` after the
  last operation, reads included). The session retains at most
  ``max_retained_bytes`` (8 MiB by default, refused atomically beyond).
- **What an operation costs.** On a built-in store the session is an
  append-only log of exchanges (:mod:`touba.integrations._items_log`):
  ``add_items`` reads the last exchange and appends, ``get_items`` reads the
  sizes of the exchanges its bounds can reach and the items it returns, and
  ``pop_item`` drops the newest item (``LogWrite.drop_last``: the save
  deletes the newest row); none of them loads or rewrites the whole history.
  On SQLite, PostgreSQL and Redis, ``get_items`` is the store's ``read_log``:
  one atomic read of what a reservation would read, without one (one SQLite
  transaction, one PostgreSQL statement, one Redis ``MULTI``), renewing the
  expiry, and sending no message back when the store object holds the
  session's tail at the stored version; a read that needs more is read again,
  wider (each read one consistent state). ``add_items`` is optimistic while
  the store object holds the session's tail (it does after any operation of
  its own, a read included): the operation runs on that tail and is saved in
  one call (one commit) only if the session is still at that version with
  that head, unreserved and live (Redis, which cannot tell another client's
  edit by the version, also compares the entries and rows the operation read);
  when anyone else wrote, edited or holds it, the store is untouched and the
  operation runs again through a reservation, with the outcomes below.
  ``pop_item`` is optimistic too (on Redis its drop is checked by those texts;
  on SQLite and PostgreSQL the save deletes the newest rows only if they weigh
  what the cached tail says). A read renews the
  expiry (reading is activity), nothing else; on SQLite and PostgreSQL that
  commit does not wait for the disk, so a power loss or a server crash may
  undo the renewal and nothing else. A worker that dies inside an
  optimistic operation or a read leaves nothing reserved.
  ``clear_session``, ``exclusive()`` and a custom ``HistoryStore`` (which
  only offers ``transact``) read and write the whole record. Reading a
  session that holds nothing takes no place in a full store.
- **One run, one writer.** ``async with session.exclusive(): await
  Runner.run(...)`` holds the session's reservation for the whole run: every
  operation of the run works on the reserved record, saved in one atomic step
  when the block ends cleanly (an exception saves nothing of the run), and a
  second concurrent run, in this process or another, is refused with
  ``DecisionHistoryBusy`` before it calls the model. A crash inside the block
  leaves the session reserved until ``recover``. Without it, exclusivity is
  per operation, as above.
- **Exchanges.** Items are grouped into exchanges as
  :mod:`touba.integrations._responses_items` defines them: a call and its
  output (by ``call_id``; MCP approvals by request id) are never separated, a
  reasoning item stays with the items of its response, and an exchange with a
  call that never got its output, or an output whose call is missing, is
  *incomplete*.
- **What ``get_items`` returns.** The longest suffix of complete exchanges
  within ``limit`` items (the SDK's "latest N", counted by whole exchanges, so
  it may return fewer, or none when the last exchange alone is longer) and
  within the session's ``max_messages`` / ``max_bytes`` bounds (touba's rule:
  the last complete exchange must fit them, else
  ``DecisionHistoryLimitExceeded`` rather than a silently empty history).
  Incomplete exchanges are kept in the store (``pop_item`` still sees them)
  but never returned, so a run never sends the model a call without its
  output nor an output without its call. This is where ToubaSession departs
  from the SDK's ``SQLiteSession``, whose ``get_items(limit=2)`` can return a
  ``function_call_output`` whose call it cut off: ToubaSession never does.
- **Items** must be JSON objects (the SDK's input items); anything else is a
  ``TypeError`` before anything is written.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any, Final, TypeVar

from touba.errors import ConfigurationError, DecisionHistoryLimitExceeded
from touba.history import HistoryStore
from touba.history._store import (
    LogOperation,
    LogSnapshot,
    LogStore,
    LogWrite,
    StoreUsage,
)
from touba.integrations._cut import check_bound, check_limit
from touba.integrations._items_log import (
    Legacy,
    check_head,
    new_head,
    plan_append,
    plan_pop,
    plan_read,
    plan_wider,
    record_of,
    select,
    whole_items,
)
from touba.integrations._records import (
    Held,
    Record,
    check_id,
    check_store,
    conversation_store_key,
    dump_item_texts,
)
from touba.integrations._responses_items import select_items

try:
    from agents.items import TResponseInputItem
    from agents.memory.session import SessionABC
    from agents.memory.session_settings import (
        SessionSettings,
        coerce_session_settings,
        resolve_session_limit,
    )
except ImportError as e:  # pragma: no cover - exercised without the extra installed
    raise ImportError(
        "touba.integrations.openai_agents needs the OpenAI Agents SDK: "
        'pip install "touba[openai-agents]"'
    ) from e

__all__ = ["ToubaSession"]

KIND: Final = "touba.openai_agents.session"
INTEGRATION: Final = "openai-agents"
R = TypeVar("R")
MiB: Final = 1024 * 1024


def _rerunnable(
    log: LogStore, *, drops: bool = False
) -> Callable[[str, LogOperation[R]], Awaitable[R]]:
    """How to run an operation that only reads its snapshot and returns a write: the
    store's optimistic path where it has one (one round trip while its cached tail is
    current: the built-in durable stores), else ``transact_log``. ``drops``: its write
    drops messages (a pop)."""
    optimistic = getattr(log, "transact_log_optimistic", None)
    if not callable(optimistic):
        return log.transact_log
    return functools.partial(optimistic, drops=drops) if drops else optimistic


class ToubaSession(SessionABC):
    """An Agents SDK session kept in a touba store, never handing back half an exchange.

    ``session_id`` names the conversation inside ``namespace`` (trusted
    configuration, never the model's). ``max_messages`` and ``max_bytes``
    bound what :meth:`get_items` hands to a run (``None``: unbounded);
    ``max_retained_bytes`` bounds what the session keeps.
    ``session_settings`` are the SDK's (``limit``), overridable per run with
    ``RunConfig(session_settings=...)``. Raises ``ConfigurationError`` on a
    bad argument, at construction.
    """

    session_settings: SessionSettings | None = None

    def __init__(
        self,
        session_id: str,
        *,
        store: HistoryStore,
        namespace: str,
        max_messages: int | None = None,
        max_bytes: int | None = None,
        max_retained_bytes: int = 8 * MiB,
        session_settings: SessionSettings | dict[str, Any] | None = None,
    ) -> None:
        self.session_id = check_id("session_id", session_id)
        self.namespace = check_id("namespace", namespace)
        self.store = check_store(store)
        self.max_messages = max_messages
        self.max_bytes = max_bytes
        self._max_messages = check_bound("max_messages", max_messages)
        self._max_bytes = check_bound("max_bytes", max_bytes)
        self.max_retained_bytes = check_limit("max_retained_bytes", max_retained_bytes)
        self.session_settings = (
            coerce_session_settings(session_settings)
            if session_settings is not None
            else SessionSettings()
        )
        self.session_key = conversation_store_key(self.namespace, INTEGRATION, self.session_id)
        self._held: list[Record | None] | None = None  # the record reserved by exclusive()
        self._checked: HistoryStore | None = None  # the store _log last checked
        self._log_store: LogStore | None = None

    @asynccontextmanager
    async def exclusive(self) -> AsyncIterator[ToubaSession]:
        """Hold this session for the block (a whole run): see "One run, one writer".

        Raises ``DecisionHistoryBusy`` at once when another operation or run
        holds it, ``ConfigurationError`` when this object already holds it;
        a refused save at the end (capacity) raises as ``add_items`` does.
        """
        if self._held is not None:
            raise ConfigurationError("this ToubaSession is already held by exclusive()")
        cell: list[Record | None] = []

        def load(snapshot: Record | None) -> None:
            self._items(snapshot)  # refuse a record that is not this session's
            cell.append(snapshot)

        async with Held(self.store, self.session_key, load, lambda _old: cell[0]):
            self._held = cell
            try:
                yield self
            finally:
                self._held = None

    async def _apply(
        self, operation: Callable[[Record | None], Awaitable[tuple[Record | None, R]]]
    ) -> R:
        """Run one operation: on the held record inside exclusive(), else in a transaction."""
        held = self._held
        if held is None:
            return await self.store.transact(self.session_key, operation)
        record, result = await operation(held[0])
        held[0] = record
        return result

    def _items(self, record: Record | None) -> list[Record]:
        return whole_items(
            record, kind=KIND, namespace=self.namespace, conversation_id=self.session_id
        )

    def _record(self, old: Record | None, items: list[Record]) -> Record | None:
        return record_of(  # None: an empty session takes no place in the store
            old,
            items,
            kind=KIND,
            namespace=self.namespace,
            conversation_id=self.session_id,
            max_retained_bytes=self.max_retained_bytes,
        )

    def _check(self, head: Record) -> None:
        check_head(head, kind=KIND, namespace=self.namespace, conversation_id=self.session_id)

    def _log(self) -> LogStore | None:
        """The store's append-only interface, outside exclusive() (built-in stores)."""
        if self._held is not None:
            return None
        store = self.store
        if store is not self._checked:  # (a Protocol isinstance costs more than the call)
            self._checked = store
            self._log_store = store if isinstance(store, LogStore) else None
        return self._log_store

    async def get_items(self, limit: int | None = None) -> list[TResponseInputItem]:
        """The session's history for a run: whole complete exchanges, oldest first.

        ``limit`` (default ``session_settings.limit``) keeps at most that many
        items, by whole exchanges. Raises ``DecisionHistoryLimitExceeded``
        when the last complete exchange alone exceeds ``max_messages`` or
        ``max_bytes``, ``DecisionHistoryBusy`` while another operation holds
        the session, ``DecisionHistoryRecordInvalid`` for a record this touba
        cannot read.
        """
        resolved = resolve_session_limit(limit, self.session_settings)
        bounds = {"max_messages": self._max_messages, "max_bytes": self._max_bytes}
        log = self._log()
        if log is not None:
            reader = getattr(log, "read_log", None)
            read_log = reader if callable(reader) else _rerunnable(log)
            try:
                tail = await read_log(self.session_key, self._read_tail(resolved))
            except Legacy:
                pass
            except DecisionHistoryLimitExceeded as e:
                if e.limit != "max_sessions":
                    raise
                return []  # a full store refused a key without a record: nothing stored
            else:
                return tail  # type: ignore[return-value]  # JSON dicts: the SDK's items

        async def read(record: Record | None) -> tuple[Record | None, list[Mapping[str, Any]]]:
            return record, select_items(self._items(record), limit=resolved, **bounds)

        peek = getattr(self.store, "read", None)
        if self._held is None and callable(peek) and await peek(self.session_key) is None:
            return []  # nothing stored: a read takes no place in a full store
        items = await self._apply(read)
        return items  # type: ignore[return-value]  # JSON dicts: the SDK's input items

    def _read_tail(self, limit: int | None) -> LogOperation[list[Record]]:
        """Read only the exchanges the bounds can reach; renew the expiry."""

        async def read(
            snapshot: LogSnapshot | None, usage: StoreUsage | None
        ) -> tuple[LogWrite | None, list[Record]]:
            if snapshot is None:
                return None, []  # nothing stored: the reservation is released
            head = snapshot.head
            self._check(head)
            count = snapshot.exchange_count
            bounds = {"max_messages": self._max_messages, "max_bytes": self._max_bytes}
            first = plan_read(head, count, limit=limit, **bounds)
            while True:
                sizes = await snapshot.sizes(first) if count else []
                chosen = select(head, first, sizes, limit=limit, **bounds)
                widened = plan_wider(head, count, first, chosen, limit=limit, **bounds)
                if widened == first:
                    break
                first = widened
            if not chosen:
                return LogWrite(head=head), []
            loaded = await snapshot.exchanges(chosen[0], count)
            wanted = set(chosen)
            items = [item for n, ex in enumerate(loaded, chosen[0]) if n in wanted for item in ex]
            return LogWrite(head=head), items  # an unchanged head: the read is activity

        return read

    async def add_items(self, items: list[TResponseInputItem]) -> None:
        """Append ``items`` atomically: all of them are saved, or none.

        On a built-in store only the last exchange is read and the new items
        are appended, whatever the session's length. Raises ``TypeError`` when
        an item is not a JSON object, ``DecisionHistoryLimitExceeded`` when the
        session would exceed ``max_retained_bytes`` or the store is full,
        ``DecisionHistoryBusy`` while another operation holds the session.
        """
        new, texts = dump_item_texts(items, "item")
        if not new:
            return
        log = self._log()
        if log is not None:

            async def append_log(
                snapshot: LogSnapshot | None, usage: StoreUsage | None
            ) -> tuple[LogWrite, None]:
                head, count, last = await self._last(snapshot)
                plan = plan_append(
                    head,
                    count,
                    last,
                    new,
                    max_retained_bytes=self.max_retained_bytes,
                    texts=texts,
                )
                return LogWrite(head=plan.head, append=plan.rows, bodies=plan.bodies), None

            with contextlib.suppress(Legacy):
                await _rerunnable(log)(self.session_key, append_log)
                return

        async def append(record: Record | None) -> tuple[Record | None, None]:
            return self._record(record, [*self._items(record), *new]), None

        await self._apply(append)

    async def _last(self, snapshot: LogSnapshot | None) -> tuple[Record, int, list[Record]]:
        """The head (checked), the exchange count and the last exchange's items."""
        if snapshot is None:
            return new_head(KIND, self.namespace, self.session_id), 0, []
        head = snapshot.head
        self._check(head)
        count = snapshot.exchange_count
        last = (await snapshot.exchanges(count - 1, count))[0] if count else []
        return head, count, last

    async def pop_item(self) -> TResponseInputItem | None:
        """Remove and return the most recent item (``None`` when empty), in one transaction."""
        log = self._log()
        if log is not None and getattr(log, "log_drops", False) is True:  # (as log_drops)

            async def pop_log(
                snapshot: LogSnapshot | None, usage: StoreUsage | None
            ) -> tuple[LogWrite | None, Record | None]:
                head, count, last = await self._last(snapshot)
                if snapshot is None or not last:
                    return None, None
                if head["items"] <= 1:
                    raise Legacy  # the session empties: its record leaves the store
                popped, item = plan_pop(head, count, last)
                return LogWrite(head=popped, drop_last=1), item

            with contextlib.suppress(Legacy):
                item = await _rerunnable(log, drops=True)(self.session_key, pop_log)
                return item  # type: ignore[return-value]

        async def pop(record: Record | None) -> tuple[Record | None, Record | None]:
            items = self._items(record)
            if not items:
                return record, None
            last = items.pop()
            return self._record(record, items), last

        item = await self._apply(pop)
        return item  # type: ignore[return-value]

    async def clear_session(self) -> None:
        """Delete every item of this session (its record leaves the store)."""

        async def clear(record: Record | None) -> tuple[Record | None, None]:
            self._items(record)  # never delete a record that is not this session's
            return None, None

        await self._apply(clear)

"""A LangGraph checkpointer on touba's stores: :class:`ToubaSaver`.

```python
from touba.integrations.langgraph import ToubaSaver

async with ToubaSaver.sqlite(".touba/graph.sqlite") as saver:
    graph = builder.compile(checkpointer=saver)
    await graph.ainvoke({"messages": [("user", "hi")]}, {"configurable": {"thread_id": "t1"}})
```

Behaviour decisions:

- **Logged channels.** The channels named in ``log_channels`` (``("messages",)`` by
  default: the ``add_messages`` channel of ``MessagesState`` and ``create_agent``) are kept
  as an append-only log per ``(thread, namespace, channel)``; a checkpoint stores the
  spans of log positions its value is made of, never a copy. At each ``put`` the new list
  is compared with its parent checkpoint's (the same items first, compared as Python
  compares lists: identity first, then equality, so an untouched message costs a pointer
  comparison): only the items after the shared prefix are serialized and appended. A list
  that drops or replaces an earlier item (``RemoveMessage``, an edited message) keeps the
  prefix it still shares and appends the rest; a value that is not a list is stored as
  LangGraph's own savers store it, whole, at its version. Every other channel is stored
  as LangGraph's savers do: a blob per ``(channel, version)``, written only when
  ``new_versions`` names it.
- **Cost of a step.** ``aput`` serializes and writes only what the step added (new log
  items, changed channels, the checkpoint's own small record); ``aget_tuple`` reads the
  log entries this process does not already hold. The decoded items of each log are kept
  in process between steps (the last ``cache_logs`` logs used, 64 by default), checked
  against the log's token and length that the store returns on every read and write, so
  another writer's appends are fetched and a prune or delete elsewhere empties the cache.
  The lists a read returns share their items with that cache (LangGraph's reducers never
  mutate a message in place; a node that does so changes what this process reads back,
  not what is stored).
- **Faults.** A checkpoint whose spans name positions that no longer exist (pruned,
  deleted, damaged) raises :class:`~touba.errors.DecisionHistoryRecordInvalid` naming the
  thread, checkpoint and channel: never a silently shorter list. A value the serializer
  cannot write or read back raises :class:`~touba.errors.ConfigurationError` naming the
  channel (or the pending write, or the metadata key), before anything is written.
- **Serializer.** ``serde`` (LangGraph's ``JsonPlusSerializer`` by default,
  ``EncryptedSerializer`` accepted) encodes every value: each log item separately, each
  blob, the checkpoint without its values, the metadata. The metadata is also stored as
  JSON (the keys JSON can hold) for ``list(filter=...)``: a filter matches keys whose
  JSON value is equal (``1`` is not ``True``), as LangGraph's SQL savers do.
- **Sync and async.** The async methods run on the caller's event loop. The store is
  bound to the first loop that uses it; the sync methods (``put``, ``get_tuple``, ...,
  for ``graph.invoke``) and async calls from another loop run there through
  ``run_coroutine_threadsafe``. A saver first used synchronously starts a loop thread
  of its own. A sync call from inside that loop's own thread is refused
  (:class:`~touba.errors.ConfigurationError`: use the async method), as LangGraph's async
  savers do.
- **Deletion, copy, prune.** ``delete_thread``, ``delete_for_runs`` (checkpoints whose
  metadata ``run_id`` is listed, with their writes; their blobs and log entries stay, as
  later checkpoints may name them), ``copy_thread`` (every checkpoint, write, blob and log
  entry, appended to the target's logs with the spans shifted) and ``prune``
  (``"keep_latest"`` per namespace, removing the log entries and blobs the kept
  checkpoint does not name; ``"delete"``) touch only what they remove or copy.
  ``DeltaChannel`` users: the same caveats as LangGraph's savers (pruning or deleting runs
  drops the writes a delta channel replays).

Where it differs from LangGraph's savers: the logged channels above (same values read
back, different storage); ``list(filter=...)`` values must be JSON values; a damaged
or pruned log position is an error, not a shorter list; ``prune``, ``delete_for_runs``
and ``copy_thread`` exist on every store; SQLite files are private (0600, symbolic links
refused).
"""

from __future__ import annotations

import asyncio
import builtins
import dataclasses
import json
import os
import random
import threading
from collections import OrderedDict
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Collection,
    Coroutine,
    Iterator,
    Mapping,
    Sequence,
)
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, TypeVar, cast

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import (
    WRITES_IDX_MAP,
    BaseCheckpointSaver,
    ChannelVersions,
    Checkpoint,
    CheckpointMetadata,
    CheckpointTuple,
    get_checkpoint_id,
    get_checkpoint_metadata,
)
from langgraph.checkpoint.serde.base import SerializerProtocol

from touba.errors import ConfigurationError, DecisionHistoryRecordInvalid
from touba.history._deadline import STORE_DEADLINE_SECONDS
from touba.integrations.langgraph._backend import (
    ChannelBlob,
    CheckpointPage,
    CheckpointRow,
    HeldLog,
    ListQuery,
    LogAppend,
    LogKey,
    LogRead,
    LogState,
    PruneStrategy,
    PutCheckpoint,
    SaverBackend,
    Span,
    TypedBlob,
    WriteRecord,
    span_length,
)

__all__ = ["ToubaSaver"]

_Logged = dict[str, tuple[tuple["Span", ...], list[Any]]]
"""Per logged channel: its spans and its value."""

R = TypeVar("R")


def _prefix(spans: Sequence[Span], count: int) -> tuple[Span, ...]:
    """The spans naming the first ``count`` items of ``spans``."""
    out: list[Span] = []
    left = count
    for s in spans:
        if left <= 0:
            break
        take = min(left, s.end - s.start)
        out.append(Span(s.start, s.start + take))
        left -= take
    return tuple(out)


def _shared_prefix(old: Sequence[Any], new: Sequence[Any]) -> int:
    """How many first items ``new`` shares with ``old`` (identity, then equality)."""
    n = min(len(old), len(new))
    if n and new[n - 1] is old[n - 1] and list(new[:n]) == list(old[:n]):
        return n
    for i in range(n):
        a, b = old[i], new[i]
        if a is b:
            continue
        if getattr(a, "id", None) != getattr(b, "id", None) or a != b:
            return i
    return n


@dataclass(slots=True)
class _Log:
    """The decoded items of one log this process holds: positions ``[0, len(items))``
    without a gap, positions beyond the first gap in ``extra``, and ``end``, one past the
    highest position held.

    A position below ``end`` missing from both is a gap: pruned away (a prune leaves the
    entries the kept checkpoint names, a fork's spans skip what its siblings appended)
    or, rarely, an entry this process has not fetched yet (another writer's, a sibling
    fork's). Reads claim to hold everything below ``end`` (:meth:`ToubaSaver._held`), so
    that a pruned log's gap does not make every read fetch again all that follows it;
    a read that then lacks a position reads again claiming only ``len(items)``.
    """

    token: str
    items: list[Any] = field(default_factory=list)
    extra: dict[int, Any] = field(default_factory=dict)
    end: int = 0

    def place(self, position: int, value: Any) -> None:
        if position < len(self.items):
            return
        self.end = max(self.end, position + 1)
        if position == len(self.items):
            self.items.append(value)
            while (nxt := len(self.items)) in self.extra:
                self.items.append(self.extra.pop(nxt))
        else:
            self.extra[position] = value

    def get(self, position: int) -> Any:
        if position < len(self.items):
            return self.items[position]
        return self.extra.get(position, _MISSING)


_MISSING = object()


@dataclass(slots=True)
class _Head:
    """The last checkpoint this process put or read on a (thread, namespace): its logged
    channels' spans and values, to compare the next ``put`` with."""

    checkpoint_id: str
    logs: _Logged


class _LoopThread:
    """An event loop on a daemon thread of the saver's own, for sync calls."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self.thread = threading.Thread(target=self._run, name="touba-langgraph-loop", daemon=True)
        self.thread.start()
        self._ready.wait()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._ready.set)
        self.loop.run_forever()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        if threading.current_thread() is not self.thread:
            self.thread.join()
        self.loop.close()


@dataclass(slots=True)
class _State:
    """The loop the store is bound to, the saver's own loop thread, and whether closed."""

    loop: asyncio.AbstractEventLoop | None = None
    own: _LoopThread | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    closed: bool = False


class ToubaSaver(BaseCheckpointSaver[str]):
    """A LangGraph checkpointer on a touba store (see the module docstring).

    Build it with :meth:`memory`, :meth:`sqlite`, :meth:`postgres` or :meth:`redis`, or
    give it a :class:`~touba.integrations.langgraph._backend.SaverBackend`. Close it with
    ``await saver.aclose()`` / ``saver.close()``, or use it as a context manager.
    """

    def __init__(
        self,
        backend: SaverBackend,
        *,
        serde: SerializerProtocol | None = None,
        log_channels: Collection[str] = ("messages",),
        cache_logs: int = 64,
    ) -> None:
        super().__init__(serde=serde)
        if isinstance(log_channels, str):
            raise ConfigurationError(
                "log_channels is a collection of channel names, e.g. ('messages',)"
            )
        if cache_logs < 0:
            raise ConfigurationError("cache_logs must be >= 0")
        self.backend = backend
        self.log_channels = frozenset(log_channels)
        self._cache_size = cache_logs
        self._logs: OrderedDict[LogKey, _Log] = OrderedDict()
        self._heads: OrderedDict[tuple[str, str], _Head] = OrderedDict()
        # Shared with the clones LangGraph makes (``with_allowlist`` at compile time): one
        # store, one loop, one cache, one close.
        self._state = _State()

    # -- constructors ---------------------------------------------------------------------

    @classmethod
    def memory(
        cls,
        *,
        serde: SerializerProtocol | None = None,
        log_channels: Collection[str] = ("messages",),
    ) -> ToubaSaver:
        """A saver in this process's RAM (nothing survives the process)."""
        from touba.integrations.langgraph._memory import MemorySaverBackend

        return cls(MemorySaverBackend(), serde=serde, log_channels=log_channels)

    @classmethod
    def sqlite(
        cls,
        path: str | os.PathLike[str],
        *,
        serde: SerializerProtocol | None = None,
        log_channels: Collection[str] = ("messages",),
    ) -> ToubaSaver:
        """A saver in a private SQLite file (0600, WAL), opened on first use.

        The directory must exist and be private (mode 0700); raises
        :class:`~touba.errors.DecisionHistoryStorageUnsafe` on first use otherwise.
        """
        from touba.integrations.langgraph._sqlite import SqliteSaverBackend

        return cls(SqliteSaverBackend(path), serde=serde, log_channels=log_channels)

    @classmethod
    def postgres(
        cls,
        dsn: str,
        *,
        table_prefix: str = "touba_lg",
        serde: SerializerProtocol | None = None,
        log_channels: Collection[str] = ("messages",),
        deadline_seconds: float = STORE_DEADLINE_SECONDS,
    ) -> ToubaSaver:
        """A saver in PostgreSQL tables named ``{table_prefix}_...`` (schema-qualified
        prefixes accepted), connected on first use. ``deadline_seconds`` bounds each
        store call (a silent network fails it with the retryable
        ``DecisionHistoryStoreUnavailable`` within that time). Needs ``touba[postgres]``."""
        from touba.integrations.langgraph._postgres import (  # type: ignore[import-not-found,unused-ignore]
            PostgresSaverBackend,
        )

        backend: SaverBackend = PostgresSaverBackend(
            dsn, table_prefix=table_prefix, deadline_seconds=deadline_seconds
        )
        return cls(backend, serde=serde, log_channels=log_channels)

    @classmethod
    def redis(
        cls,
        url: str,
        *,
        prefix: str = "touba:lg:",
        serde: SerializerProtocol | None = None,
        log_channels: Collection[str] = ("messages",),
        deadline_seconds: float = STORE_DEADLINE_SECONDS,
    ) -> ToubaSaver:
        """A saver in Redis under keys starting with ``prefix``, connected on first use.
        ``deadline_seconds`` (default 10) bounds each step: past it the call fails with
        the retryable ``DecisionHistoryStoreUnavailable``. Needs ``touba[redis]``."""
        from touba.integrations.langgraph._redis import (  # type: ignore[import-not-found,unused-ignore]
            RedisSaverBackend,
        )

        backend: SaverBackend = RedisSaverBackend(
            url, prefix=prefix, deadline_seconds=deadline_seconds
        )
        return cls(backend, serde=serde, log_channels=log_channels)

    # -- lifecycle ------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Close the store (idempotent). Later calls raise ConfigurationError."""
        with self._state.lock:
            if self._state.closed:
                return
            self._state.closed = True
        try:
            await self._forward(self.backend.close())
        finally:
            self._drop_caches()
            own = self._state.own
            if own is not None and threading.current_thread() is not own.thread:
                self._state.own = None
                own.stop()

    def close(self) -> None:
        """Close the store from sync code (idempotent); inside an event loop use aclose."""
        with self._state.lock:
            if self._state.closed:
                return
        loop = self._state.loop
        if loop is not None and not loop.is_closed() and loop.is_running():
            self._sync(self.aclose(), check_closed=False)
            own, self._state.own = self._state.own, None
            if own is not None:
                own.stop()
        else:
            asyncio.run(self.aclose())

    async def __aenter__(self) -> ToubaSaver:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def __enter__(self) -> ToubaSaver:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- loops ----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._state.closed:
            raise ConfigurationError("this ToubaSaver is closed; create a new one")

    async def _forward(self, coro: Coroutine[Any, Any, R]) -> R:
        """Run ``coro`` on the loop the store is bound to (binding it to this one first)."""
        running = asyncio.get_running_loop()
        with self._state.lock:
            if self._state.loop is None or self._state.loop.is_closed():
                self._state.loop = running
            loop = self._state.loop
        if loop is running:
            return await coro
        if not loop.is_running():
            coro.close()
            raise ConfigurationError(
                "this ToubaSaver's store is bound to an event loop that is not running; "
                "use one saver per event loop"
            )
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, loop))

    def _sync(self, coro: Coroutine[Any, Any, R], *, check_closed: bool = True) -> R:
        if check_closed and self._state.closed:
            coro.close()
            self._check_open()
        with self._state.lock:
            if self._state.loop is None or self._state.loop.is_closed():
                self._state.own = _LoopThread()
                self._state.loop = self._state.own.loop
            loop = self._state.loop
        try:
            current = asyncio.get_running_loop()
        except RuntimeError:
            current = None
        if current is loop:
            coro.close()
            raise ConfigurationError(
                "a synchronous ToubaSaver method was called from inside the event loop its "
                "store runs on; await the async method (aget_tuple, aput, ...) instead"
            )
        if not loop.is_running():
            coro.close()
            raise ConfigurationError(
                "this ToubaSaver's store is bound to an event loop that is not running, so a "
                "synchronous call cannot reach it; close that loop, or use the async methods"
            )
        return asyncio.run_coroutine_threadsafe(coro, loop).result()

    # -- serialization ----------------------------------------------------------------------

    def _dump(self, value: Any, what: str) -> TypedBlob:
        try:
            typed = self.serde.dumps_typed(value)
            self.serde.loads_typed(typed)
        except Exception as e:
            raise ConfigurationError(
                f"{what} cannot be stored: LangGraph's serializer "
                f"({type(self.serde).__name__}) does not round-trip it ({type(e).__name__}: "
                f"{e}); nothing was written"
            ) from e
        return (str(typed[0]), bytes(typed[1]))

    def _load(self, blob: TypedBlob, what: str) -> Any:
        try:
            return self.serde.loads_typed(blob)
        except Exception as e:
            raise DecisionHistoryRecordInvalid(
                f"{what} cannot be read back by the serializer ({type(e).__name__}: {e})"
            ) from e

    # -- caches -----------------------------------------------------------------------------

    def _drop_caches(self, thread_id: str | None = None) -> None:
        if thread_id is None:
            self._logs.clear()
            self._heads.clear()
            return
        for key in [k for k in self._logs if k.thread_id == thread_id]:
            del self._logs[key]
        for head_key in [k for k in self._heads if k[0] == thread_id]:
            del self._heads[head_key]

    def _touch(self, key: LogKey, log: _Log) -> None:
        self._logs[key] = log
        self._logs.move_to_end(key)
        while len(self._logs) > self._cache_size:
            self._logs.popitem(last=False)

    def _remember_head(self, thread_id: str, ns: str, head: _Head) -> None:
        if self._cache_size == 0:
            return
        self._heads[(thread_id, ns)] = head
        self._heads.move_to_end((thread_id, ns))
        while len(self._heads) > self._cache_size:
            self._heads.popitem(last=False)

    def _held(self, key: LogKey, *, claim: bool) -> HeldLog | None:
        """What to tell the store this process holds of a log: every position below its
        ``end`` (``claim``: gaps taken for pruned) or only its gapless prefix."""
        log = self._logs.get(key)
        if log is None:
            return None
        return HeldLog(log.token, log.end if claim else len(log.items))

    async def _fetch(
        self,
        keys: Callable[[LogKey], bool],
        read: Callable[[dict[LogKey, HeldLog]], Awaitable[CheckpointPage]],
        heads: dict[str, _Head] | None = None,
    ) -> list[CheckpointTuple]:
        """The tuples of the page ``read`` returns given what this process holds of the
        logs ``keys`` selects: first claiming every position below each log's ``end``;
        when a row then names a position the cache lacks and that claim hid it, once
        more claiming only the gapless prefixes (a missing position is then an error)."""
        selected = [key for key in list(self._logs) if keys(key)]
        claimed = {key: h for key in selected if (h := self._held(key, claim=True)) is not None}
        try:
            page = await read(claimed)
            views: dict[LogKey, _Log | None] = {}
            return [self._tuple(row, page, views, heads) for row in page.rows]
        except DecisionHistoryRecordInvalid:
            surely = {key: h for key in selected if (h := self._held(key, claim=False)) is not None}
            if surely == claimed:
                raise
        page = await read(surely)
        views = {}
        return [self._tuple(row, page, views, heads) for row in page.rows]

    def _absorb(self, key: LogKey, read: LogRead) -> _Log | None:
        """Merge what a read returned for a log into the cache; the log's view to build
        values from (not cached when the cache is off)."""
        if read.state is None:
            self._logs.pop(key, None)
            return None
        log = self._logs.get(key)
        if log is None or log.token != read.state.token:
            log = _Log(read.state.token)
        label = f"log {key.channel!r} of thread {key.thread_id!r}"
        for position in sorted(read.entries):
            log.place(position, self._load(read.entries[position], f"an item of the {label}"))
        if self._cache_size:
            self._touch(key, log)
        return log

    def _value(
        self, log: _Log | None, spans: Sequence[Span], row: CheckpointRow, ch: str
    ) -> list[Any]:
        record = row.record
        out: list[Any] = []
        for s in spans:
            if log is not None and s.end <= len(log.items):
                out.extend(log.items[s.start : s.end])
                continue
            for position in range(s.start, s.end):
                item = _MISSING if log is None else log.get(position)
                if item is _MISSING:
                    raise DecisionHistoryRecordInvalid(
                        f"checkpoint {record.checkpoint_id!r} of thread {record.thread_id!r} "
                        f"(namespace {record.checkpoint_ns!r}) names position {position} of "
                        f"its {ch!r} log, which no longer exists (pruned, deleted or "
                        "damaged); refusing to return a shorter list"
                    )
                out.append(item)
        return out

    # -- reading ----------------------------------------------------------------------------

    def _tuple(
        self,
        row: CheckpointRow,
        page: CheckpointPage,
        views: dict[LogKey, _Log | None],
        heads: dict[str, _Head] | None = None,
    ) -> CheckpointTuple:
        record = row.record
        where = f"checkpoint {record.checkpoint_id!r} of thread {record.thread_id!r}"
        checkpoint = self._load(record.checkpoint, where)
        values: dict[str, Any] = {}
        for channel, blob in row.blobs.items():
            if blob is not None:
                values[channel] = self._load(blob, f"channel {channel!r} of {where}")
        logged: _Logged = {}
        for channel, spans in record.logs.items():
            key = LogKey(record.thread_id, record.checkpoint_ns, channel)
            if key not in views:
                views[key] = self._absorb(key, page.logs.get(key, LogRead(None)))
            value = self._value(views[key], spans, row, channel)
            values[channel] = value
            logged[channel] = (spans, value)
        thread_id, ns = record.thread_id, record.checkpoint_ns
        read = _Head(record.checkpoint_id, {k: (s, list(v)) for k, (s, v) in logged.items()})
        if heads is not None:
            heads[record.checkpoint_id] = read
        head = self._heads.get((thread_id, ns))
        if head is None or head.checkpoint_id <= record.checkpoint_id:
            self._remember_head(thread_id, ns, read)
        return CheckpointTuple(
            config={
                "configurable": {
                    "thread_id": thread_id,
                    "checkpoint_ns": ns,
                    "checkpoint_id": record.checkpoint_id,
                }
            },
            checkpoint=cast(Checkpoint, {**checkpoint, "channel_values": values}),
            metadata=self._load(record.metadata, f"the metadata of {where}"),
            parent_config=(
                {
                    "configurable": {
                        "thread_id": thread_id,
                        "checkpoint_ns": ns,
                        "checkpoint_id": record.parent_id,
                    }
                }
                if record.parent_id
                else None
            ),
            pending_writes=[
                (w.task_id, w.channel, self._load(w.value, f"a pending write of {where}"))
                for w in row.writes
            ],
        )

    async def _read(
        self,
        thread_id: str,
        ns: str,
        checkpoint_id: str | None,
        heads: dict[str, _Head] | None = None,
    ) -> CheckpointTuple | None:
        def get(held: dict[LogKey, HeldLog]) -> Awaitable[CheckpointPage]:
            channels = {key.channel: h for key, h in held.items()}
            return self.backend.get(thread_id, ns, checkpoint_id, channels)

        found = await self._fetch(
            lambda key: key.thread_id == thread_id and key.checkpoint_ns == ns, get, heads
        )
        return found[0] if found else None

    async def _get_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        self._check_open()
        configurable = config["configurable"]
        thread_id = str(configurable["thread_id"])
        ns = str(configurable.get("checkpoint_ns", ""))
        return await self._read(thread_id, ns, get_checkpoint_id(config))

    async def aget_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        """The checkpoint ``config`` names (``checkpoint_id``), or the thread's latest in
        its namespace; None when there is none. Raises DecisionHistoryRecordInvalid for a
        checkpoint whose log positions no longer exist."""
        return await self._forward(self._get_tuple(config))

    def get_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        """Sync :meth:`aget_tuple` (runs on the store's loop; see the module docstring)."""
        return self._sync(self._get_tuple(config))

    async def _list(
        self,
        config: RunnableConfig | None,
        filter: dict[str, Any] | None,
        before: RunnableConfig | None,
        limit: int | None,
    ) -> list[CheckpointTuple]:
        self._check_open()
        configurable = (config or {}).get("configurable", {})
        wanted = dict(filter or {})
        try:
            metadata = json.loads(json.dumps(wanted))
        except (TypeError, ValueError) as e:
            raise ConfigurationError(
                f"list(filter=...) values must be JSON values ({e}); touba compares the "
                "metadata as JSON"
            ) from e
        thread_id = configurable.get("thread_id")
        ns = configurable.get("checkpoint_ns")
        query = ListQuery(
            thread_id=None if thread_id is None else str(thread_id),
            checkpoint_ns=None if ns is None else str(ns),
            checkpoint_id=configurable.get("checkpoint_id") or None,
            before=get_checkpoint_id(before) if before else None,
            metadata=metadata,
            limit=limit,
        )
        return await self._fetch(lambda key: True, lambda held: self.backend.list(query, held))

    async def alist(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> AsyncIterator[CheckpointTuple]:
        """Checkpoints newest first: of ``config``'s thread (and namespace, when given),
        or of every thread for ``config`` None; ``filter`` compares metadata keys as
        JSON, ``before`` keeps older ids, ``limit`` caps the count."""
        for item in await self._forward(self._list(config, filter, before, limit)):
            yield item

    def list(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> Iterator[CheckpointTuple]:
        """Sync :meth:`alist`."""
        yield from self._sync(self._list(config, filter, before, limit))

    # -- writing ----------------------------------------------------------------------------

    async def _parent_logs(self, thread_id: str, ns: str, parent_id: str | None) -> _Logged:
        if parent_id is None:
            return {}
        head = self._heads.get((thread_id, ns))
        if head is not None and head.checkpoint_id == parent_id:
            return head.logs
        heads: dict[str, _Head] = {}
        try:
            await self._read(thread_id, ns, parent_id, heads)
        except DecisionHistoryRecordInvalid:
            return {}  # an unreadable parent: the new value starts afresh
        found = heads.get(parent_id)
        return {} if found is None else found.logs

    async def _put(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        self._check_open()
        configurable = config["configurable"]
        thread_id = str(configurable["thread_id"])
        ns = str(configurable.get("checkpoint_ns", ""))
        parent_id = configurable.get("checkpoint_id") or None
        checkpoint_id = str(checkpoint["id"])
        c = dict(checkpoint)
        values = cast(dict[str, Any], c.pop("channel_values"))
        versions = checkpoint["channel_versions"]
        where = f"checkpoint {checkpoint_id!r} of thread {thread_id!r}"

        logged = {
            ch for ch in self.log_channels if ch in versions and isinstance(values.get(ch), list)
        }
        parents = await self._parent_logs(thread_id, ns, parent_id) if logged else {}
        appends: builtins.list[LogAppend] = []
        mine: dict[str, tuple[builtins.list[Any], int]] = {}
        for ch in sorted(logged):
            value: builtins.list[Any] = values[ch]
            spans, old = parents.get(ch, ((), []))
            shared = _shared_prefix(old, value)
            fresh = value[shared:]
            items = tuple(
                self._dump(item, f"item {shared + i} of channel {ch!r} of {where}")
                for i, item in enumerate(fresh)
            )
            appends.append(LogAppend(ch, _prefix(spans, shared), items))
            mine[ch] = (list(value), len(fresh))
        blobs = tuple(
            ChannelBlob(
                ch,
                str(v),
                self._dump(values[ch], f"channel {ch!r} of {where}") if ch in values else None,
            )
            for ch, v in new_versions.items()
            if ch not in logged
        )
        stored_metadata = get_checkpoint_metadata(config, metadata)
        metadata_blob = self._dump(stored_metadata, f"the metadata of {where}")
        run_id = stored_metadata.get("run_id")
        request = PutCheckpoint(
            thread_id=thread_id,
            checkpoint_ns=ns,
            checkpoint_id=checkpoint_id,
            parent_id=parent_id,
            checkpoint=self._dump(c, where),
            metadata=metadata_blob,
            metadata_json=_metadata_json(stored_metadata),
            run_id=run_id if isinstance(run_id, str) else None,
            versions={ch: str(v) for ch, v in versions.items() if ch not in logged},
            blobs=blobs,
            logs=tuple(appends),
        )
        try:
            result = await self.backend.put(request)
        except DecisionHistoryRecordInvalid:
            if not any(a.base for a in appends):
                raise
            # The parent's positions are gone (the thread was deleted or pruned elsewhere):
            # store the whole values afresh rather than fail the step.
            self._drop_caches(thread_id)
            fresh_appends = tuple(
                LogAppend(
                    a.channel,
                    (),
                    tuple(
                        self._dump(item, f"item {i} of channel {a.channel!r} of {where}")
                        for i, item in enumerate(mine[a.channel][0])
                    ),
                )
                for a in appends
            )
            mine = {ch: (v, len(v)) for ch, (v, _) in mine.items()}
            request = dataclasses.replace(request, logs=fresh_appends)
            result = await self.backend.put(request)
        heads: _Logged = {}
        for ch, (value, added) in mine.items():
            key = LogKey(thread_id, ns, ch)
            state: LogState = result.logs[ch]
            log = self._logs.get(key)
            if log is None or log.token != state.token:
                log = _Log(state.token)
            start = state.length - added
            for i, item in enumerate(value[len(value) - added :]):
                log.place(start + i, item)
            if self._cache_size:
                self._touch(key, log)
            spans = result.spans[ch]
            if span_length(spans) != len(value):
                raise DecisionHistoryRecordInvalid(
                    f"the store answered spans of {span_length(spans)} items for the "
                    f"{len(value)} of channel {ch!r} of {where}"
                )
            heads[ch] = (spans, value)
        self._remember_head(thread_id, ns, _Head(checkpoint_id, heads))
        return {
            "configurable": {
                "thread_id": thread_id,
                "checkpoint_ns": ns,
                "checkpoint_id": checkpoint_id,
            }
        }

    async def aput(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        """Store a checkpoint in one atomic step: the logged channels' new items, the
        blobs of ``new_versions``, the checkpoint and its metadata. Raises
        ConfigurationError (naming the channel) for a value the serializer cannot
        round-trip, before anything is written."""
        return await self._forward(self._put(config, checkpoint, metadata, new_versions))

    def put(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        """Sync :meth:`aput`."""
        return self._sync(self._put(config, checkpoint, metadata, new_versions))

    async def _put_writes(
        self,
        config: RunnableConfig,
        writes: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str,
    ) -> None:
        self._check_open()
        configurable = config["configurable"]
        thread_id = str(configurable["thread_id"])
        ns = str(configurable.get("checkpoint_ns", ""))
        checkpoint_id = str(configurable["checkpoint_id"])
        records = [
            WriteRecord(
                task_id=task_id,
                idx=WRITES_IDX_MAP.get(channel, idx),
                channel=channel,
                value=self._dump(
                    value,
                    f"pending write {idx} (channel {channel!r}, task {task_id!r}) of checkpoint "
                    f"{checkpoint_id!r}",
                ),
                task_path=task_path,
            )
            for idx, (channel, value) in enumerate(writes)
        ]
        if records:
            await self.backend.put_writes(thread_id, ns, checkpoint_id, records)

    async def aput_writes(
        self,
        config: RunnableConfig,
        writes: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str = "",
    ) -> None:
        """Store a task's pending writes atomically (regular ones insert-or-ignore, the
        special channels of ``WRITES_IDX_MAP`` replace)."""
        await self._forward(self._put_writes(config, writes, task_id, task_path))

    def put_writes(
        self,
        config: RunnableConfig,
        writes: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str = "",
    ) -> None:
        """Sync :meth:`aput_writes`."""
        self._sync(self._put_writes(config, writes, task_id, task_path))

    # -- deleting, copying, pruning -------------------------------------------------------

    async def _delete_thread(self, thread_id: str) -> None:
        self._check_open()
        self._drop_caches(str(thread_id))
        await self.backend.delete_thread(str(thread_id))

    async def adelete_thread(self, thread_id: str) -> None:
        """Remove every checkpoint, write and log of a thread (atomic)."""
        await self._forward(self._delete_thread(thread_id))

    def delete_thread(self, thread_id: str) -> None:
        """Sync :meth:`adelete_thread`."""
        self._sync(self._delete_thread(thread_id))

    async def _delete_for_runs(self, run_ids: Sequence[str]) -> None:
        self._check_open()
        ids = [str(r) for r in run_ids]
        if ids:
            self._heads.clear()
            await self.backend.delete_for_runs(ids)

    async def adelete_for_runs(self, run_ids: Sequence[str]) -> None:
        """Remove the checkpoints whose metadata ``run_id`` is listed, with their writes."""
        await self._forward(self._delete_for_runs(run_ids))

    def delete_for_runs(self, run_ids: Sequence[str]) -> None:
        """Sync :meth:`adelete_for_runs`."""
        self._sync(self._delete_for_runs(run_ids))

    async def _copy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        self._check_open()
        self._drop_caches(str(target_thread_id))
        await self.backend.copy_thread(str(source_thread_id), str(target_thread_id))

    async def acopy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        """Copy every checkpoint, write and log entry of a thread to another (atomic)."""
        await self._forward(self._copy_thread(source_thread_id, target_thread_id))

    def copy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        """Sync :meth:`acopy_thread`."""
        self._sync(self._copy_thread(source_thread_id, target_thread_id))

    async def _prune(self, thread_ids: Sequence[str], strategy: str) -> None:
        self._check_open()
        if strategy not in ("keep_latest", "delete"):
            raise ConfigurationError(
                f"prune strategy {strategy!r} is unknown; use 'keep_latest' or 'delete'"
            )
        chosen: PruneStrategy = "delete" if strategy == "delete" else "keep_latest"
        ids = [str(t) for t in thread_ids]
        for t in ids:
            self._drop_caches(t)
        if ids:
            await self.backend.prune(ids, chosen)

    async def aprune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        """``"keep_latest"``: keep each namespace's latest checkpoint (and what it names);
        ``"delete"``: remove the threads. Raises ConfigurationError for another strategy."""
        await self._forward(self._prune(thread_ids, strategy))

    def prune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        """Sync :meth:`aprune`."""
        self._sync(self._prune(thread_ids, strategy))

    def get_next_version(self, current: str | None, channel: None) -> str:
        """The next channel version: a counter and a random tie-breaker, so forks never share
        a version, as ``InMemorySaver``'s; but 21 characters (12 digits, 32 random bits in hex)
        where theirs take about 50.

        A checkpoint holds a version per channel and per node that saw it, so the short form
        takes about half of a step's checkpoint record off what each step writes. The
        counter's zero padding keeps the string order of versions their numeric order.
        """
        current_v = 0 if current is None else int(str(current).split(".")[0])
        return f"{current_v + 1:012}.{random.getrandbits(32):08x}"


def _metadata_json(metadata: Mapping[str, Any]) -> str:
    """The metadata keys JSON can hold, as a JSON object."""
    kept: dict[str, Any] = {}
    for key, value in metadata.items():
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            continue
        kept[str(key)] = value
    return json.dumps(kept)

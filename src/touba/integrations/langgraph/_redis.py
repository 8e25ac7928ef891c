"""``RedisSaverBackend``: ToubaSaver's checkpoints in Redis, one cluster slot per thread.

Behaviour decisions:

- **Layout.** Every key of a thread starts with ``prefix + "{" + sha256(thread_id) + "}:"``:
  one hash tag per thread, so a thread lives in one cluster slot and every step on it is
  one Lua script (``lua/*.lua``, loaded by :func:`touba.history._lua.load`), atomic. The
  thread id never reaches a key name; namespaces and channels are named by a digest of
  their text with a registry that refuses a second text under the same digest.
  ``lua/_thread.lua`` lists every key. The store-wide indexes (which threads exist, which
  threads hold a run) live under a tag of their own (``prefix + "{" + sha256(prefix)[:10] +
  "}:"``): ``threads`` (HASH thread digest -> id, for a list over every thread) and
  ``run:<sha1(run_id)>`` (SET of thread digests, for ``delete_for_runs``).
- **Logs.** A log is a HASH ``position -> entry`` with its token and length: a put adds
  only its new entries (HSET of k fields), a read asks for the positions it lacks (HMGET),
  and a prune removes positions without renumbering the others. Costs are the protocol's:
  a put O(what it adds + blobs + metadata keys), a warm get O(what the step added).
- **Indexes before data.** The first put on a thread (or with a new run id there) finds
  the thread not marked indexed and writes nothing; the backend then sends the store-wide
  index updates and the put again in one round trip (a pipeline: two slots cannot share a
  script). Later puts are one script, no index traffic. A delete removes the thread's
  index entries before its script (in the same round trip), and ``delete_for_runs`` the
  runs' entries of each thread before that thread's script, so a put that makes the
  thread or run again after the script stays indexed (a put landing between the two, or
  a crash between a put's index update and its script, leaves an index entry naming a
  thread or run with nothing behind it, which readers skip). A delete whose connection
  fails past its retries between the index update and the script raises
  ``DecisionHistoryStoreUnavailable`` and may leave the thread stored but missing from a
  list over every thread: delete it again. A prune leaves the runs it emptied in the
  thread's run set, removes their index entries, then (``retire.lua``) drops from the
  set those still empty and indexes again those a put gave a checkpoint meanwhile.
- **Atomic per thread.** ``delete_for_runs`` and ``prune`` are atomic per thread, not
  across threads (each thread is its own slot); ``copy_thread`` reads the source in one
  script and writes the target in one, so the target shows all of the copy or none of it.
  LangGraph's own savers run these in one SQL transaction; here another client may see
  thread A pruned and thread B not yet.
- **Retries.** The client made from ``url`` sends a command again, on a new connection,
  when its connection failed (redis-py's ``Retry``). A put carries a token, and a copy
  too: run twice, the second run finds its token stored and writes nothing, so a retried
  put never appends its entries twice. Every other script is idempotent as it is. A
  failure that survives the retries is
  :class:`~touba.errors.DecisionHistoryStoreUnavailable` (transient), the driver's error
  chained; the write happened whole or not at all.
- **Deadline.** Every step runs under ``deadline_seconds`` (one ``asyncio.timeout`` around
  the step's round trips, redis-py's retries included; see
  :mod:`touba.history._redis_client`), whichever client is used: a silent network fails
  it with ``DecisionHistoryStoreUnavailable`` within that time. A step cut short may
  have run on the server (its reply was lost); run again, it finds its token stored.
- **Redis Cluster.** Give a ``redis.asyncio.RedisCluster`` as ``client``: each thread's
  scripts run on the node of its slot, the indexes' commands on theirs (a cluster
  client's pipelines refuse scripts, so a put is two round trips there instead of one).
- **No expiry.** Keys never expire (LangGraph's savers keep threads until deleted or
  pruned either).
- **Values.** Blobs, entries and writes are stored as the serializer gave them (a type tag
  and bytes, length-prefixed), never decoded here. Metadata keys are also stored one by
  one as canonical JSON (sorted keys, integral floats as integers) so that a filter is a
  string comparison in the script: ``1`` and ``1.0`` match, ``1`` and ``true`` do not.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any, Final

from touba.errors import (
    ConfigurationError,
    DecisionHistoryRecordInvalid,
    DecisionHistoryStoreUnavailable,
)
from touba.history._deadline import STORE_DEADLINE_SECONDS, check_deadline
from touba.history._lua import LuaScript, load
from touba.history._redis_client import bounded, no_answer, redis_client
from touba.integrations.langgraph._backend import (
    CheckpointPage,
    CheckpointRecord,
    CheckpointRow,
    HeldLog,
    ListQuery,
    LogKey,
    LogRead,
    LogState,
    PruneStrategy,
    PutCheckpoint,
    PutResult,
    Span,
    TypedBlob,
    WriteRecord,
)

try:
    import redis.asyncio as aioredis
    from redis.exceptions import NoScriptError, RedisError
except ImportError as e:  # pragma: no cover - exercised by a test that hides redis
    raise ImportError(
        'ToubaSaver.redis needs redis-py; install it with: pip install "touba[redis]"'
    ) from e

__all__ = ["RedisSaverBackend"]

_PACKAGE: Final = "touba.integrations.langgraph"


def _b(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")


def _s(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", "surrogatepass")
    return str(value)


def _damaged(what: str) -> DecisionHistoryRecordInvalid:
    return DecisionHistoryRecordInvalid(
        f"{what} of this thread in Redis is damaged (not what touba wrote); nothing was "
        "changed. Delete the thread (saver.delete_thread) or restore it from a copy"
    )


def _pack(*parts: bytes) -> bytes:
    """Parts as one value: each but the last prefixed by its length (``b"4:json..."``)."""
    return b"".join(b"%d:%s" % (len(p), p) for p in parts[:-1]) + parts[-1]


def _unpack(raw: Any, count: int, what: str) -> list[bytes]:
    """The ``count`` parts :func:`_pack` joined (damaged when they do not parse)."""
    if not isinstance(raw, bytes):
        raise _damaged(what)
    out, at = [], 0
    try:
        for _ in range(count - 1):
            colon = raw.index(b":", at)
            size = int(raw[at:colon])
            end = colon + 1 + size
            if size < 0 or end > len(raw):
                raise ValueError
            out.append(raw[colon + 1 : end])
            at = end
    except ValueError:
        raise _damaged(what) from None
    out.append(raw[at:])
    return out


def _typed(raw: Any, what: str) -> TypedBlob:
    kind, data = _unpack(raw, 2, what)
    return _s(kind), data


def _spans(text: str, what: str = "a checkpoint's spans") -> tuple[Span, ...]:
    if not text:
        return ()
    out = []
    try:
        for part in text.split(","):
            start, end = part.split("-")
            out.append(Span(int(start), int(end)))
    except ValueError:
        raise _damaged(what) from None
    return tuple(out)


def _normal(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():  # 1.0 == 1, as Python and JSON say
        return int(value)
    if isinstance(value, dict):
        return {k: _normal(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_normal(v) for v in value]
    return value


def canonical(value: Any) -> str | None:
    """A metadata value as the text a filter compares (None: JSON cannot hold it)."""
    try:
        return json.dumps(_normal(value), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError):
        return None


@asynccontextmanager
async def _driver_errors(
    what: str, seconds: float, client: aioredis.Redis | aioredis.RedisCluster
) -> AsyncIterator[None]:
    """The one place where redis-py exceptions, and a deadline that expired, become
    touba errors: the body runs under a deadline of ``seconds``."""
    try:
        async with bounded(seconds, client):
            yield
    except RedisError as e:
        raise DecisionHistoryStoreUnavailable(
            f"Redis failed during {what} ({type(e).__name__}: {e}); it was written whole or "
            "not at all. Check the server and retry"
        ) from e
    except TimeoutError as e:
        raise DecisionHistoryStoreUnavailable(
            f"{no_answer(what, seconds)}; it was written whole or not at all. Check the "
            "network and retry"
        ) from e


class RedisSaverBackend:
    """The :class:`~touba.integrations.langgraph._backend.SaverBackend` on Redis.

    Give exactly one of ``url`` (``redis://host:port/db``: the backend makes its client,
    which retries a command twice on a failed connection, and closes it) or ``client``
    (a ``redis.asyncio.Redis`` or ``RedisCluster`` you own, with its own retry policy,
    not decoding responses; ``close()`` leaves it open). ``deadline_seconds`` bounds
    each step (see the module docstring). ``prefix`` starts every key, so savers with
    different prefixes never see each other's threads; it must be non-empty and without
    braces (the backend adds its own hash tags). Needs Redis 5 or later. See the module
    docstring for the layout and what is atomic.
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        prefix: str = "touba:lg:",
        client: aioredis.Redis | aioredis.RedisCluster | None = None,
        deadline_seconds: float = STORE_DEADLINE_SECONDS,
    ) -> None:
        if not isinstance(prefix, str) or not prefix or "{" in prefix or "}" in prefix:
            raise ConfigurationError(
                f"prefix must be a non-empty str without braces, got {prefix!r}: the saver "
                "adds its own hash tags so that each thread's keys share one cluster slot"
            )
        self.deadline_seconds = check_deadline(deadline_seconds, owner="RedisSaverBackend")
        self._client, self._owns_client = redis_client(
            url, client, owner="RedisSaverBackend", deadline=self.deadline_seconds
        )
        if not self._owns_client and self._client.get_encoder().decode_responses:
            raise ConfigurationError(
                "client must not decode responses (decode_responses=False): checkpoints are bytes"
            )
        self.prefix = prefix
        tag = hashlib.sha256(_b(prefix)).hexdigest()[:10]
        self._global = f"{prefix}{{{tag}}}:"
        self._threads = self._global + "threads"
        self._scripts = {
            name: load(name, _PACKAGE)
            for name in (
                "put",
                "writes",
                "read",
                "delete",
                "runs",
                "prune",
                "retire",
                "export",
                "import",
            )
        }
        self._closed = False

    # -- keys and round trips -----------------------------------------------------------

    def _base(self, thread_id: str) -> str:
        return self._thread_base(hashlib.sha256(_b(thread_id)).hexdigest())

    def _thread_base(self, digest: str) -> str:
        return f"{self.prefix}{{{digest}}}:"

    def _run_index(self, run_id: str) -> str:
        return self._global + "run:" + hashlib.sha1(_b(run_id), usedforsecurity=False).hexdigest()

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigurationError("this RedisSaverBackend is closed; open a new saver")

    async def _eval(
        self,
        name: str,
        base: str,
        args: Sequence[Any],
        what: str,
        before: Sequence[tuple[Any, ...]] = (),
    ) -> Any:
        """One round trip: the commands ``before`` (pipelined, not atomic with it), then
        the script ``name`` on the thread at ``base``; its reply. A script the server
        lost (a restart, SCRIPT FLUSH) is loaded again and run once more."""
        self._check_open()
        script: LuaScript = self._scripts[name]
        command = ("EVALSHA", script.sha, 1, base + "meta", *args)
        if isinstance(self._client, aioredis.RedisCluster):
            # A cluster client's pipelines refuse scripts: the index commands go first
            # (spread over their nodes), then the script, routed by its key's slot;
            # one deadline for both.
            async with _driver_errors(what, self.deadline_seconds, self._client):
                await self._commands(before, what)
                try:
                    return await self._client.execute_command(*command)
                except NoScriptError:
                    await self._client.script_load(script.source)  # on every primary
                    return await self._client.execute_command(*command)
        async with _driver_errors(what, self.deadline_seconds, self._client):
            for attempt in (1, 2):
                async with self._client.pipeline(transaction=False) as pipe:
                    for c in before:
                        pipe.execute_command(*c)
                    pipe.execute_command(*command)
                    replies = await pipe.execute(raise_on_error=False)
                reply = replies[-1]
                if isinstance(reply, NoScriptError) and attempt == 1:
                    await self._client.script_load(script.source)
                    before = ()  # they ran
                    continue
                for outcome in replies:
                    if isinstance(outcome, Exception):
                        raise outcome
                return reply
        raise AssertionError("unreachable")  # pragma: no cover

    async def _eval_many(
        self, name: str, calls: Sequence[tuple[str, Sequence[Any]]], what: str
    ) -> list[Any]:
        """The read-only script ``name`` on many threads (base, args): one pipelined round
        trip (on a cluster client, concurrent calls), each run atomic on its own."""
        self._check_open()
        if isinstance(self._client, aioredis.RedisCluster):
            return list(await asyncio.gather(*(self._eval(name, b, a, what) for b, a in calls)))
        script: LuaScript = self._scripts[name]
        async with _driver_errors(what, self.deadline_seconds, self._client):
            for attempt in (1, 2):
                async with self._client.pipeline(transaction=False) as pipe:
                    for base, args in calls:
                        pipe.execute_command("EVALSHA", script.sha, 1, base + "meta", *args)
                    replies = list(await pipe.execute(raise_on_error=False))
                if attempt == 1 and any(isinstance(r, NoScriptError) for r in replies):
                    await self._client.script_load(script.source)  # it only reads: run again
                    continue
                for outcome in replies:
                    if isinstance(outcome, Exception):
                        raise outcome
                return replies
        raise AssertionError("unreachable")  # pragma: no cover

    async def _commands(self, commands: Sequence[tuple[Any, ...]], what: str) -> list[Any]:
        """Plain commands in one round trip (not atomic)."""
        self._check_open()
        if not commands:
            return []
        async with (
            _driver_errors(what, self.deadline_seconds, self._client),
            self._client.pipeline(transaction=False) as pipe,
        ):
            for c in commands:
                pipe.execute_command(*c)
            return list(await pipe.execute())

    # -- the protocol -------------------------------------------------------------------

    async def put(self, request: PutCheckpoint) -> PutResult:
        """``SaverBackend.put``: put.lua; on a thread or run new here, the store-wide index
        updates first and put.lua again, in one round trip."""
        thread = request.thread_id
        base = self._base(thread)
        try:
            metadata = json.loads(request.metadata_json)
        except ValueError:
            metadata = None
        if not isinstance(metadata, dict):
            raise ConfigurationError("metadata_json must be a JSON object; nothing was stored")
        fields: list[Any] = []
        for key, value in metadata.items():
            text = canonical(value)
            if text is not None:
                fields += [_b(key), _b(text)]
        args: list[Any] = [
            _b(thread),
            _b(request.checkpoint_ns),
            _b(request.checkpoint_id),
            _b(request.parent_id or ""),
            _b(request.checkpoint[0]),
            request.checkpoint[1],
            _b(request.metadata[0]),
            request.metadata[1],
            _b(request.metadata_json),
            _b(request.run_id or ""),
            uuid.uuid4().hex[:16],
            uuid.uuid4().hex[:16],
            "0",  # the indexes: see below
            len(fields) // 2,
            *fields,
            len(request.versions),
        ]
        for channel, version in request.versions.items():
            args += [_b(channel), _b(version)]
        args.append(len(request.blobs))
        for blob in request.blobs:
            packed = b"" if blob.blob is None else _pack(_b(blob.blob[0]), blob.blob[1])
            args += [_b(blob.channel), _b(blob.version), packed]
        args.append(len(request.logs))
        for log in request.logs:
            args += [_b(log.channel), len(log.base)]
            for s in log.base:
                args += [s.start, s.end]
            args.append(len(log.items))
            args += [_pack(_b(kind), data) for kind, data in log.items]
        reply = await self._eval("put", base, args, "a checkpoint put")
        status = _s(reply[0])
        if status == "unindexed":  # a new thread or run here: index it first, then put
            digest = hashlib.sha256(_b(thread)).hexdigest()
            before: list[tuple[Any, ...]] = [("HSET", self._threads, digest, _b(thread))]
            if request.run_id:
                before.append(("SADD", self._run_index(request.run_id), digest))
            args[12] = "1"
            reply = await self._eval("put", base, args, "a checkpoint put", before)
            status = _s(reply[0])
        if status == "base":
            raise DecisionHistoryRecordInvalid(
                f"the log of channel {_s(reply[1])!r} is shorter than the parent checkpoint "
                "says (pruned or damaged); nothing was stored. Resume from a checkpoint "
                "that still exists"
            )
        if status == "collision":
            raise _damaged("a namespace or channel name")
        if status != "ok":
            raise _damaged("a reply")
        spans: dict[str, tuple[Span, ...]] = {}
        logs: dict[str, LogState] = {}
        for i in range(1, len(reply), 4):
            channel = _s(reply[i])
            logs[channel] = LogState(_s(reply[i + 1]), int(reply[i + 2]))
            spans[channel] = _spans(_s(reply[i + 3]))
        return PutResult(spans, logs)

    async def put_writes(
        self,
        thread_id: str,
        checkpoint_ns: str,
        checkpoint_id: str,
        writes: Sequence[WriteRecord],
    ) -> None:
        """``SaverBackend.put_writes``: writes.lua."""
        if not writes:
            return
        args: list[Any] = [_b(thread_id), _b(checkpoint_ns), _b(checkpoint_id), len(writes)]
        for w in writes:
            value = _pack(_b(w.task_path), _b(w.channel), _b(w.value[0]), w.value[1])
            args += [_b(f"{w.idx}:{w.task_id}"), "1" if w.idx < 0 else "0", value]
        reply = await self._eval("writes", self._base(thread_id), args, "a writes put")
        if _s(reply[0]) == "collision":
            raise _damaged("a namespace name")

    async def get(
        self,
        thread_id: str,
        checkpoint_ns: str,
        checkpoint_id: str | None,
        held: Mapping[str, HeldLog],
    ) -> CheckpointPage:
        """``SaverBackend.get``: read.lua on one namespace, limit 1."""
        query = ListQuery(
            thread_id=thread_id, checkpoint_ns=checkpoint_ns, checkpoint_id=checkpoint_id, limit=1
        )
        keyed = {LogKey(thread_id, checkpoint_ns, c): h for c, h in held.items()}
        return await self._read_thread(thread_id, query, keyed)

    async def list(self, query: ListQuery, held: Mapping[LogKey, HeldLog]) -> CheckpointPage:
        """``SaverBackend.list``: read.lua on the thread, or on every thread the store-wide
        index names, pipelined in one round trip (each thread read atomically, up to the
        limit), merged newest first and cut to the limit."""
        if query.thread_id is not None:
            return await self._read_thread(query.thread_id, query, held)
        if query.limit is not None and query.limit <= 0:
            return CheckpointPage((), {})
        [indexed] = await self._commands([("HGETALL", self._threads)], "a list")
        threads = sorted(_s(v) for v in indexed.values())
        calls = []
        for thread in threads:
            args = _read_args(thread, query, held)
            if args is None:
                return CheckpointPage((), {})
            calls.append((self._base(thread), args))
        replies = await self._eval_many("read", calls, "a checkpoint list")
        rows: list[CheckpointRow] = []
        logs: dict[LogKey, LogRead] = {}
        for thread, reply in zip(threads, replies, strict=True):
            page = _page(thread, reply)
            rows += page.rows
            logs.update(page.logs)
        rows.sort(key=lambda r: r.record.checkpoint_id, reverse=True)  # stable: thread order
        if query.limit is not None:
            rows = rows[: query.limit]
        return CheckpointPage(tuple(rows), _named(rows, logs))

    async def _read_thread(
        self, thread_id: str, query: ListQuery, held: Mapping[LogKey, HeldLog]
    ) -> CheckpointPage:
        args = _read_args(thread_id, query, held)
        if args is None:
            return CheckpointPage((), {})
        reply = await self._eval("read", self._base(thread_id), args, "a checkpoint read")
        return _page(thread_id, reply)

    async def delete_thread(self, thread_id: str) -> None:
        """``SaverBackend.delete_thread``: delete.lua, then the store-wide indexes."""
        digest = hashlib.sha256(_b(thread_id)).hexdigest()
        await self._drop(digest)

    async def _drop(self, digest: str) -> None:
        """The thread's store-wide index entries removed first, then delete.lua, in one
        round trip after reading the thread's runs: a put landing after the script
        (which finds the thread unindexed and indexes it again) is never undone by a
        cleanup sent after it. A put landing between the two leaves an index entry
        with nothing behind it, which readers skip."""
        base = self._thread_base(digest)
        [runs] = await self._commands([("SMEMBERS", base + "runs")], "a thread delete")
        cleanup: list[tuple[Any, ...]] = [("HDEL", self._threads, digest)]
        cleanup += [("SREM", self._global + "run:" + _s(r), digest) for r in sorted(runs)]
        await self._eval("delete", base, [], "a thread delete", cleanup)

    async def delete_for_runs(self, run_ids: Sequence[str]) -> None:
        """``SaverBackend.delete_for_runs``: on each thread the run index names, the
        index entries then runs.lua (atomic per thread), in one round trip: a put of
        one of the runs landing after the script indexes the run again and stays so."""
        if not run_ids:
            return
        indexes = sorted({self._run_index(r) for r in run_ids})
        found = await self._commands([("SMEMBERS", i) for i in indexes], "a run delete")
        by_thread: dict[str, list[str]] = {}
        for index, members in zip(indexes, found, strict=True):
            for member in members:
                by_thread.setdefault(_s(member), []).append(index)
        for digest, thread_indexes in sorted(by_thread.items()):
            rshas = [i.rsplit(":", 1)[1] for i in thread_indexes]
            cleanup: list[tuple[Any, ...]] = [("SREM", i, digest) for i in thread_indexes]
            await self._eval("runs", self._thread_base(digest), rshas, "a run delete", cleanup)

    async def copy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        """``SaverBackend.copy_thread``: export.lua on the source, import.lua on the target
        (one script each: the target shows the whole copy or none of it). A copy of a
        thread onto itself is a no-op."""
        if source_thread_id == target_thread_id:
            return
        runs, spaces = await self._eval("export", self._base(source_thread_id), [], "a thread copy")
        if not spaces:
            return
        args: list[Any] = [
            _b(target_thread_id),
            uuid.uuid4().hex[:16],
            uuid.uuid4().hex[:16],
            len(spaces),
        ]
        for ns, cps, writes, blobs, logs in spaces:
            args += [ns, len(cps)]
            for cid, fields in cps:
                args += [cid, len(fields) // 2, *fields]
            args.append(len(writes))
            for cid, fields in writes:
                args += [cid, len(fields) // 2, *fields]
            args += [len(blobs) // 2, *blobs, len(logs)]
            for log in logs:
                args += [log[0], log[1], (len(log) - 2) // 2, *log[2:]]
        digest = hashlib.sha256(_b(target_thread_id)).hexdigest()
        before: list[tuple[Any, ...]] = [("HSET", self._threads, digest, _b(target_thread_id))]
        before += [("SADD", self._global + "run:" + _s(r), digest) for r in runs]
        reply = await self._eval(
            "import", self._base(target_thread_id), args, "a thread copy", before
        )
        if _s(reply[0]) == "collision":
            raise _damaged("a namespace or channel name")

    async def prune(self, thread_ids: Sequence[str], strategy: PruneStrategy) -> None:
        """``SaverBackend.prune``: delete.lua or prune.lua per thread (atomic per thread)."""
        if strategy not in ("keep_latest", "delete"):
            raise ConfigurationError(
                f"strategy must be 'keep_latest' or 'delete', got {strategy!r}"
            )
        for thread in dict.fromkeys(thread_ids):
            digest = hashlib.sha256(_b(thread)).hexdigest()
            if strategy == "delete":
                await self._drop(digest)
                continue
            base = self._thread_base(digest)
            emptied = await self._eval("prune", base, [uuid.uuid4().hex[:16]], "a prune")
            if not emptied:
                continue
            # the emptied runs' index entries, then retire.lua: a put of one of them that
            # landed since the prune gets its entry back
            cleanup: list[tuple[Any, ...]] = [
                ("SREM", self._global + "run:" + _s(r), digest) for r in emptied
            ]
            back = await self._eval("retire", base, list(emptied), "a prune", cleanup)
            await self._commands(
                [("SADD", self._global + "run:" + _s(r), digest) for r in back], "a prune"
            )

    async def close(self) -> None:
        """Close the client; idempotent. Calls after it raise ConfigurationError."""
        if self._closed:
            return
        self._closed = True
        if self._owns_client:
            async with _driver_errors("close", self.deadline_seconds, self._client):
                await self._client.aclose()


def _read_args(
    thread_id: str, query: ListQuery, held: Mapping[LogKey, HeldLog]
) -> list[Any] | None:
    """read.lua's ARGV after B for ``query`` on one thread; None when a metadata filter
    holds a value JSON cannot (no stored value equals it)."""
    filters: list[Any] = []
    for name, value in query.metadata.items():
        text = canonical(value)
        if text is None:
            return None
        filters += [_b(name), _b(text)]
    mine = [(k, h) for k, h in held.items() if k.thread_id == thread_id]
    args: list[Any] = [
        "0" if query.checkpoint_ns is None else "1",
        _b(query.checkpoint_ns or ""),
        _b(query.checkpoint_id or ""),
        _b(query.before or ""),
        -1 if query.limit is None else max(0, query.limit),
        len(filters) // 2,
        *filters,
        len(mine),
    ]
    for log, h in mine:
        args += [_b(log.checkpoint_ns), _b(log.channel), _b(h.token), h.length]
    return args


def _page(thread_id: str, reply: Sequence[Any]) -> CheckpointPage:
    """read.lua's reply on one thread as a page."""
    raw_rows, raw_logs = reply
    rows = tuple(_row(thread_id, raw) for raw in raw_rows)
    logs: dict[LogKey, LogRead] = {}
    for raw in raw_logs:
        key = LogKey(thread_id, _s(raw[0]), _s(raw[1]))
        token = _s(raw[2])
        if not token:
            logs[key] = LogRead(None)
            continue
        entries = {int(raw[i]): _typed(raw[i + 1], "a log entry") for i in range(4, len(raw), 2)}
        logs[key] = LogRead(LogState(token, int(raw[3])), entries)
    return CheckpointPage(rows, logs)


def _row(thread_id: str, raw: Sequence[Any]) -> CheckpointRow:
    """A row of read.lua's reply as the protocol gives it."""
    ns, cid, flat, blobs, writes = raw
    fields = {_s(flat[i]): flat[i + 1] for i in range(0, len(flat), 2)}
    versions: dict[str, str] = {}
    logs: dict[str, tuple[Span, ...]] = {}
    for name, value in fields.items():
        if name.startswith("v:"):
            versions[name[2:]] = _s(value)
        elif name.startswith("l:"):
            logs[name[2:]] = _spans(_s(value))
    try:
        checkpoint = (_s(fields["ct"]), fields["c"])
        metadata = (_s(fields["mt"]), fields["m"])
        metadata_json = _s(fields["mj"])
    except KeyError:
        raise _damaged("a checkpoint") from None
    parent, run = fields.get("p"), fields.get("r")
    record = CheckpointRecord(
        thread_id=thread_id,
        checkpoint_ns=_s(ns),
        checkpoint_id=_s(cid),
        parent_id=None if parent is None else _s(parent),
        checkpoint=checkpoint,
        metadata=metadata,
        metadata_json=metadata_json,
        run_id=None if run is None else _s(run),
        versions=versions,
        logs=logs,
    )
    found: dict[str, TypedBlob | None] = {}
    for i in range(0, len(blobs), 2):
        value = blobs[i + 1]
        found[_s(blobs[i])] = None if value == b"" else _typed(value, "a channel blob")
    pending = []
    for i in range(0, len(writes), 2):
        idx, _, task_id = _s(writes[i]).partition(":")
        path, channel, kind, data = _unpack(writes[i + 1], 4, "a pending write")
        try:
            index = int(idx)
        except ValueError:
            raise _damaged("a pending write") from None
        pending.append(WriteRecord(task_id, index, _s(channel), (_s(kind), data), _s(path)))
    pending.sort(key=lambda w: (w.task_path, w.task_id, w.idx))
    return CheckpointRow(record, found, tuple(pending))


def _named(rows: Sequence[CheckpointRow], logs: Mapping[LogKey, LogRead]) -> dict[LogKey, LogRead]:
    """``logs`` cut to the entries ``rows``' spans name (after a merge dropped rows)."""
    wanted: dict[LogKey, set[int]] = {}
    for row in rows:
        r = row.record
        for channel, spans in r.logs.items():
            positions = wanted.setdefault(LogKey(r.thread_id, r.checkpoint_ns, channel), set())
            for s in spans:
                positions.update(range(s.start, s.end))
    out = {}
    for key, positions in wanted.items():
        read = logs.get(key, LogRead(None))
        entries = {p: e for p, e in read.entries.items() if p in positions}
        out[key] = LogRead(read.state, entries)
    return out

"""The Redis client of a touba store: one it makes from ``url=`` or one it is given.

Shared by ``RedisHistoryStore`` and the Redis backends of the ADK session service and
the LangGraph saver, so that all three take the same two forms and make the same
client. The client made from ``url=`` sends a command again, on a new connection,
when its connection failed (a server restart, a proxy's idle timeout, CLIENT KILL):
safe for these stores, since every write is a script that a second run finds done.
redis-py is imported here only when a client is made: each store module raises its
own ``pip install "touba[redis]"`` ImportError first.

Deadlines. Each store takes ``deadline_seconds`` (:mod:`touba.history._deadline`) and
runs every round trip under :func:`bounded`: an ``asyncio.timeout`` of that many
seconds around the whole command, redis-py's retries included, so a network that goes
silent fails the operation with the store's retryable ``DecisionHistoryStoreUnavailable``
instead of hanging. The client made from ``url=`` also gets that deadline as its
``socket_connect_timeout`` and ``socket_timeout`` (unless the url sets them), and a
retry budget that fits in it (two retries, backoff 50 ms doubling, at most 0.5 s);
a client the host gives keeps its own settings, and our operations on it are bounded
all the same. redis-py drops a connection whose command timed out or was cancelled
(``Connection.read_response`` disconnects on any error), so a late reply is never read
as the answer to the next command (``tests/history/test_redis_deadlines.py``); after a
deadline expired the client's idle connections are closed too (:func:`drop_idle`), so
the first operation after the network returns does not wait on one that lived
through the silence.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Final, TypeAlias

from touba.errors import ConfigurationError

if TYPE_CHECKING:
    import redis.asyncio as aioredis

    Client: TypeAlias = aioredis.Redis | aioredis.RedisCluster

__all__ = ["RETRIES", "bounded", "drop_idle", "no_answer", "redis_client", "slot_base"]

RETRIES: Final = 2
CLOSE_SECONDS: Final = 0.5  # the most closing idle connections may take (local work)


def redis_client(
    url: str | None, client: Client | None, *, owner: str, deadline: float
) -> tuple[Client, bool]:
    """The client to use and whether the store owns it (and so closes it).

    Exactly one of ``url`` and ``client`` must be given, else ``ConfigurationError``
    naming ``owner``; ``client`` must be a ``redis.asyncio`` client, ``url`` a str
    redis-py can parse. The client made from ``url`` times out connects and replies
    after ``deadline`` seconds (unless the url's own ``socket_timeout`` /
    ``socket_connect_timeout`` say otherwise); ``client`` is left as configured.
    Nothing connects here.
    """
    import redis.asyncio as aioredis
    from redis.asyncio.retry import Retry
    from redis.backoff import ExponentialBackoff

    if (url is None) == (client is None):
        raise ConfigurationError(
            f"{owner} needs exactly one of url= (e.g. 'redis://127.0.0.1:6379/0') "
            "or client= (a redis.asyncio.Redis or RedisCluster you own)"
        )
    if client is not None:
        if not isinstance(client, aioredis.Redis | aioredis.RedisCluster):
            raise ConfigurationError(
                f"client must be a redis.asyncio.Redis or RedisCluster, got "
                f"{type(client).__name__} (the synchronous redis.Redis is not supported)"
            )
        return client, False
    if not isinstance(url, str):
        raise ConfigurationError(f"url must be a str, got {type(url).__name__}")
    try:
        retry = Retry(ExponentialBackoff(cap=0.5, base=0.05), RETRIES)
        made = aioredis.Redis.from_url(
            url, retry=retry, socket_connect_timeout=deadline, socket_timeout=deadline
        )
        return made, True
    except ValueError as e:
        raise ConfigurationError(f"invalid Redis url ({e})") from e


@asynccontextmanager
async def bounded(seconds: float, client: Client) -> AsyncIterator[None]:
    """Run the body under a deadline: past ``seconds`` it is cancelled, ``client``'s
    idle connections are closed (:func:`drop_idle`) and ``TimeoutError`` raised (each
    store turns it into its own typed error)."""
    try:
        async with asyncio.timeout(seconds):
            yield
    except BaseException as e:
        from redis.exceptions import TimeoutError as RedisTimeout  # a socket timeout

        if isinstance(e, TimeoutError | RedisTimeout):
            await drop_idle(client)
        raise


async def drop_idle(client: Client) -> None:
    """Close the connections ``client`` keeps idle (every node's, on a cluster client).

    After a deadline expired they may have lived through the silence, and a network
    that forgot their flow never answers on them again: the next command then opens a
    new connection instead of waiting out another deadline. Connections other
    operations are using are left alone; closing is local and bounded; a failure to
    close changes nothing else."""
    import redis.asyncio as aioredis

    try:
        async with asyncio.timeout(CLOSE_SECONDS):
            if isinstance(client, aioredis.RedisCluster):
                for node in client.get_nodes():
                    close = getattr(node, "disconnect_free_connections", None)
                    if close is not None:  # (redis-py 6+)
                        await close()
            else:
                await client.connection_pool.disconnect(inuse_connections=False)
    except Exception:  # noqa: S110 - best effort: the operation's own error is raised
        pass


def no_answer(what: str, seconds: float) -> str:
    """The start of a store's message for an operation that hit its deadline."""
    return (
        f"Redis gave no answer during {what} within {seconds:g} s (deadline_seconds): the "
        "network or the server is silent"
    )


def slot_base(prefix: str, *, owner: str) -> str:
    """``prefix`` with a hash tag of its own (``prefix{tag}:``): every key built on it
    falls in one cluster slot, and two prefixes never share keys.

    ``ConfigurationError`` (saying what ``owner`` is) unless ``prefix`` is a non-empty
    str without braces."""
    if not isinstance(prefix, str) or not prefix or "{" in prefix or "}" in prefix:
        raise ConfigurationError(
            f"prefix must be a non-empty str without braces, got {prefix!r}: the {owner} "
            "adds its own hash tag so that all its keys share one cluster slot"
        )
    tag = hashlib.sha256(prefix.encode("utf-8", "surrogatepass")).hexdigest()[:10]
    return f"{prefix}{{{tag}}}:"

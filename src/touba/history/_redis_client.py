"""The Redis client of a touba store: one it makes from ``url=`` or one it is given.

Shared by ``RedisHistoryStore`` and the Redis backends of the ADK session service and
the LangGraph saver, so that all three take the same two forms and make the same
client. The client made from ``url=`` sends a command again, on a new connection,
when its connection failed (a server restart, a proxy's idle timeout, CLIENT KILL):
safe for these stores, since every write is a script that a second run finds done.
redis-py is imported here only when a client is made: each store module raises its
own ``pip install "touba[redis]"`` ImportError first.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Final, TypeAlias

from touba.errors import ConfigurationError

if TYPE_CHECKING:
    import redis.asyncio as aioredis

    Client: TypeAlias = aioredis.Redis | aioredis.RedisCluster

__all__ = ["RETRIES", "redis_client", "slot_base"]

RETRIES: Final = 2


def redis_client(url: str | None, client: Client | None, *, owner: str) -> tuple[Client, bool]:
    """The client to use and whether the store owns it (and so closes it).

    Exactly one of ``url`` and ``client`` must be given, else ``ConfigurationError``
    naming ``owner``; ``client`` must be a ``redis.asyncio`` client, ``url`` a str
    redis-py can parse. Nothing connects here.
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
        return aioredis.Redis.from_url(url, retry=retry), True
    except ValueError as e:
        raise ConfigurationError(f"invalid Redis url ({e})") from e


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

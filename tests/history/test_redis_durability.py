"""RedisHistoryStore says when its server's persistence can lose an acknowledged write.

The rules are :func:`touba.history._redis_durability.durability_of`'s; the store reads
the settings once (entered, or its first command) from private ``redis-server``s
started with each setting (``tests/_private_servers.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import pytest
import redis

from tests._private_servers import private_redis_or_skip
from touba.history._redis_durability import UNKNOWN, durability_of
from touba.history.redis import RedisHistoryStore

LOGGER = "touba.history"


@pytest.mark.parametrize(
    ("settings", "start", "safe"),
    [
        (
            {"appendonly": "yes", "appendfsync": "always", "aof-load-truncated": "no", "save": ""},
            "appendfsync always, aof-load-truncated no",
            True,
        ),
        (
            {"appendonly": "yes", "appendfsync": "always", "aof-load-truncated": "yes", "save": ""},
            "appendfsync always with aof-load-truncated yes",
            False,
        ),
        ({"appendonly": "yes", "appendfsync": "always", "save": ""}, "unknown", False),
        (
            {
                "appendonly": "yes",
                "appendfsync": "everysec",
                "aof-load-truncated": "no",
                "save": "",
            },
            "appendfsync everysec",
            False,
        ),
        (
            {"appendonly": "yes", "appendfsync": "no", "aof-load-truncated": "yes", "save": "1 1"},
            "appendfsync no",
            False,
        ),
        (
            {
                "appendonly": "no",
                "appendfsync": "always",
                "aof-load-truncated": "yes",
                "save": "3600 1 300 100",
            },
            "appendonly no, RDB",
            False,
        ),
        (
            {
                "appendonly": "no",
                "appendfsync": "everysec",
                "aof-load-truncated": "yes",
                "save": "",
            },
            "no persistence",
            False,
        ),
        (
            {
                "appendonly": "maybe",
                "appendfsync": "always",
                "aof-load-truncated": "no",
                "save": "",
            },
            "unknown",
            False,
        ),
        ({"appendonly": "yes"}, "unknown", False),
        (None, "unknown", False),
    ],
)
def test_what_each_setting_means(
    settings: Mapping[str, str] | None, start: str, safe: bool
) -> None:
    text, is_safe = durability_of(settings)
    assert text.startswith(start)
    assert is_safe is safe


async def usage_and_logs(
    url: str, caplog: pytest.LogCaptureFixture, *, enter: bool
) -> tuple[str | None, list[logging.LogRecord]]:
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        store = RedisHistoryStore(url, prefix="durability:")
        try:
            if enter:
                await store.__aenter__()

            async def put(record: object) -> tuple[dict[str, int], None]:
                return {"n": 1}, None

            await store.transact("k", put)
            await store.transact("k", put)
            usage = await store.usage()
        finally:
            await store.close()
    return usage.durability, [r for r in caplog.records if r.name == LOGGER]


@pytest.mark.parametrize("enter", [True, False], ids=["entered", "first-command"])
async def test_no_persistence_is_said_in_usage_and_warned_once(
    caplog: pytest.LogCaptureFixture, enter: bool
) -> None:
    with private_redis_or_skip({"appendonly": "no", "save": ""}) as server:
        durability, logs = await usage_and_logs(server.url, caplog, enter=enter)
    assert durability is not None
    assert durability.startswith("no persistence")
    warnings = [r for r in logs if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "lost when the server restarts" in warnings[0].getMessage()
    assert str(server.port) not in warnings[0].getMessage()  # no address in the log


async def test_everysec_is_said_in_usage_and_warned(caplog: pytest.LogCaptureFixture) -> None:
    with private_redis_or_skip({"appendonly": "yes", "appendfsync": "everysec"}) as server:
        durability, logs = await usage_and_logs(server.url, caplog, enter=True)
    assert durability == (
        "appendfsync everysec: up to 1 s of acknowledged writes can be lost on a server crash"
    )
    assert [r.levelno for r in logs if "acknowledged writes" in r.getMessage()] == [logging.WARNING]


async def test_appendfsync_always_is_durable_and_not_warned(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with private_redis_or_skip({"appendonly": "yes", "appendfsync": "always"}) as server:
        durability, logs = await usage_and_logs(server.url, caplog, enter=False)
    assert durability is not None
    assert durability.startswith("appendfsync always")
    assert [r for r in logs if r.levelno >= logging.WARNING] == []


async def test_aof_load_truncated_yes_is_warned(caplog: pytest.LogCaptureFixture) -> None:
    """Redis's default loads a file cut inside a MULTI block by keeping the block's first
    commands, which the next restart applies (``tests/history/test_server_crashes.py``
    found it; ``tests/test_private_servers.py`` shows it on the server itself)."""
    settings = {"appendonly": "yes", "appendfsync": "always", "aof-load-truncated": "yes"}
    with private_redis_or_skip(settings) as server:
        durability, logs = await usage_and_logs(server.url, caplog, enter=True)
    assert durability is not None
    assert durability.startswith("appendfsync always with aof-load-truncated yes")
    warnings = [r.getMessage() for r in logs if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "aof-load-truncated no" in warnings[0]


async def test_a_refused_config_get_is_unknown_said_as_such(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with private_redis_or_skip({"appendonly": "no", "save": ""}) as server:
        admin = redis.Redis.from_url(server.url)
        try:
            admin.acl_setuser(
                "app",
                enabled=True,
                passwords=["+s3cret-pw"],
                keys=["*"],
                commands=["+@all", "-config"],
            )
        finally:
            admin.close()
        url = f"redis://app:s3cret-pw@127.0.0.1:{server.port}/0"
        durability, logs = await usage_and_logs(url, caplog, enter=True)
    assert durability == UNKNOWN
    assert [r.levelno for r in logs if "durability" in r.getMessage()] == [logging.INFO]
    assert all("s3cret" not in r.getMessage() for r in logs)

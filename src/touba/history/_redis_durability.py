"""What a Redis server's persistence settings mean for an acknowledged write.

``RedisHistoryStore`` reads ``appendonly``, ``appendfsync``, ``aof-load-truncated`` and
``save`` (``CONFIG GET``) once, when it is entered or on its first command, and says in
one short, stable text whether a write Redis acknowledged survives a server crash (kill
-9, an OOM kill, a power cut). Only ``appendonly yes`` with ``appendfsync always`` and
``aof-load-truncated no`` keeps every one, and nothing else: Redis then writes and
fsyncs the append-only file before it replies, and refuses to start on a file a crash
cut short (``redis-check-aof --fix`` repairs it). With ``aof-load-truncated yes``
(Redis's default), a file cut inside a MULTI block, as a script's writes are logged, is
truncated after the block's complete commands, not before its MULTI: the writes
acknowledged after that restart join the unfinished block, and the next restart drops
them all, or applies the cut block's commands when a later block's EXEC closes it
(Redis 7.0.15: ``tests/test_private_servers.py``; ``tests/history/test_server_crashes.py``
found it as one decision's two messages stored twice; fixed in Valkey by
valkey-io/valkey#4342). The text is the store's
``usage().durability``; a setting that can lose writes is also logged once, as a
warning, naming no key, content or address. A server that refuses ``CONFIG`` (an ACL, a
managed service) gives "unknown", said as such and logged at INFO level (the operator
may not be able to change it; the service's own documentation says what it keeps).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

__all__ = ["SETTINGS", "UNKNOWN", "durability_of"]

SETTINGS: Final = ("appendonly", "appendfsync", "aof-load-truncated", "save")
UNKNOWN: Final = (
    "unknown: the server refused CONFIG GET (an ACL or a managed service), so touba cannot "
    "tell whether an acknowledged write survives a server crash"
)


def durability_of(settings: Mapping[str, str] | None) -> tuple[str, bool]:
    """``(text, safe)`` for the settings read (None: ``CONFIG GET`` was refused).

    ``safe`` is True only when every acknowledged write survives a server crash.
    """
    if settings is None or any(name not in settings for name in SETTINGS):
        return UNKNOWN, False
    appendonly = settings["appendonly"].strip().lower()
    fsync = settings["appendfsync"].strip().lower()
    save = settings["save"].strip()
    if appendonly == "yes":
        truncated = settings["aof-load-truncated"].strip().lower()
        if fsync == "always" and truncated == "no":
            return (
                "appendfsync always, aof-load-truncated no: an acknowledged write is on disk "
                "before Redis replies"
            ), True
        if fsync == "always" and truncated == "yes":
            return (
                "appendfsync always with aof-load-truncated yes: after a crash that cuts the "
                "append-only file inside a transaction, a later restart can lose writes "
                "acknowledged since, or bring back part of one that never was"
            ), False
        if fsync == "always":
            return UNKNOWN, False
        if fsync == "everysec":
            return (
                "appendfsync everysec: up to 1 s of acknowledged writes can be lost on a server "
                "crash"
            ), False
        if fsync == "no":
            return (
                "appendfsync no: acknowledged writes the OS has not flushed yet (about 30 s) can "
                "be lost on a server crash"
            ), False
        return UNKNOWN, False
    if appendonly != "no":
        return UNKNOWN, False
    if save:
        return (
            f"appendonly no, RDB snapshots only (save {save}): the writes acknowledged since "
            "the last snapshot are lost on a server crash"
        ), False
    return (
        'no persistence (appendonly no, save ""): every conversation is lost when the server '
        "restarts"
    ), False

"""Who holds a reserved conversation, and the exact command that frees it.

A reservation records its holder (:class:`touba.history._common.Reservation`):
the worker id, its process id, its host name and since when. When the host is
this one, whether that process id is running says much (not running: the worker
is gone; running: it may still be working, or the number was reused). The
command to free the conversation repeats the store options the operator gave,
except a secret: a DSN or URL read from ``TOUBA_DSN`` is left to the
environment, and one given on the command line is shown with its password
masked and a note to put it back.
"""

from __future__ import annotations

import os
import shlex
import socket
from datetime import UTC, datetime
from typing import Any

from touba.cli._stores import DSN_ENV, Backend

__all__ = ["holder_lines", "process_state", "recover_command"]

_OPTIONS = {"sqlite": "--db", "postgresql": "--dsn", "redis": "--redis-url"}


def process_state(pid: object, host: object) -> str | None:
    """Whether process ``pid`` runs here, when ``host`` is this host (else None)."""
    if not isinstance(pid, int) or host != socket.gethostname():
        return None
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return f"pid {pid} is not running on this host: the worker is gone"
    except PermissionError:
        return f"pid {pid} is running on this host (another user's process)"
    except OSError:
        return None
    return (
        f"pid {pid} is running on this host: the worker may still be working (or another "
        "program got that number)"
    )


def _age(since: object) -> str:
    if not isinstance(since, str):
        return ""
    try:
        then = datetime.fromisoformat(since)
    except ValueError:
        return ""
    seconds = max(0, int((datetime.now(UTC) - then).total_seconds()))
    if seconds < 120:
        return f" ({seconds} s ago)"
    if seconds < 7200:
        return f" ({seconds // 60} min ago)"
    return f" ({seconds // 3600} h ago)"


def holder_lines(reservation: dict[str, Any]) -> list[str]:
    """The holder as lines of plain text: worker, pid, host, since, and the pid's state."""
    pid, host, since = reservation.get("pid"), reservation.get("host"), reservation.get("since")
    lines = [
        f"worker: {reservation.get('worker_id')}",
        f"pid: {pid} on host {host}",
        f"since: {since}{_age(since)}",
    ]
    state = process_state(pid, host)
    lines.append(state if state is not None else "its host is another one: check it there")
    return lines


def recover_command(
    backend: Backend, key: str, *, table: str | None = None, prefix: str | None = None
) -> tuple[str, bool]:
    """``touba history recover KEY`` with the store options given, and whether a password
    was masked in it (the operator puts it back)."""
    words = ["touba", "history", "recover", shlex.quote(key)]
    shown = backend.shown
    if not (backend.kind == "postgresql" and os.environ.get(DSN_ENV) == backend.address):
        words += [_OPTIONS[backend.kind], shlex.quote(shown)]
    if table is not None:
        words += ["--table", shlex.quote(table)]
    if prefix is not None:
        words += ["--prefix", shlex.quote(prefix)]
    masked = (
        backend.kind != "sqlite" and shown != backend.address and _OPTIONS[backend.kind] in words
    )
    return " ".join(words), masked

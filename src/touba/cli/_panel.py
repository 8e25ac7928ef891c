"""``touba panel``: serve the web memory panel over the application's stores.

- Stores: the memory store is ``--db PATH`` or ``--dsn DSN`` (``TOUBA_DSN``,
  ``--prefix``), as for ``touba events``; the decision-history store, optional,
  is one of ``--history-db PATH``, ``--history-dsn DSN`` (``--history-table``)
  or ``--redis-url URL`` (``--history-prefix``), with the application's
  ``--max-sessions`` / ``--max-store-bytes`` for its usage. Neither is
  created: a missing one is an error, as for every administration command,
  and each is opened as the read-only commands open theirs (a store of the
  other kind, another application's database, a file that opening would
  migrate or chmod, are refused before anything is written).
- Encrypted stores: ``--keys-file PATH`` (``--current KEY_ID``) as every command takes
  them (:mod:`touba.cli._keys`); the memory, history and checkpoint stores are opened
  with that :class:`~touba.Encryption`, so every page reads them.
- ``--program module:attr`` gives the agents (their names, kinds, the
  program's ``MemoryConfig``, and the model the preview box runs).
- Approvals: the approvals page lists and resumes the checkpoints of the
  application's runtime. When ``--program`` names a ``touba.Runtime`` (or a
  factory of one), its checkpoint store and resources binding are used;
  otherwise ``--checkpoints-db PATH`` opens the application's
  ``SqliteCheckpointStore`` file under a runtime of the program (with RAM
  resources: name a Runtime when capabilities use business resources). The
  file is checked as the stores are (it must exist and hold a touba
  checkpoint store; nothing is created); it is written when an operator
  approves, denies or recovers. Neither: the page says how to give one.
- It binds ``--host`` (127.0.0.1) and ``--port`` (8765; 0 picks a free one)
  and refuses a host that is not loopback unless ``--allow-remote`` says a
  TLS proxy is in front.
- The access token is ``TOUBA_PANEL_TOKEN``, or a random one printed once as
  the URL to open (``http://127.0.0.1:PORT/?token=...``). Request lines are
  logged without their query string, so the token is never logged.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import sys
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Annotated, Any, Final

import typer
from rich.markup import escape

from touba.cli._common import errors
from touba.cli._events import Db, PrefixOption, memory_target
from touba.cli._keys import CurrentOption, KeysFileOption
from touba.cli._kinds import sqlite_contents
from touba.cli._programs import ProgramOption, load_host
from touba.cli._stores import (
    Backend,
    DsnOption,
    HistoryAdmin,
    HistoryDbOption,
    HistoryDsnOption,
    HistoryPrefixOption,
    HistoryTableOption,
    Kind,
    Limits,
    RedisUrlOption,
    check_store,
    open_history,
    open_memory,
)
from touba.errors import ToubaError
from touba.runtime import Program, Runtime

__all__ = ["TOKEN_ENV", "panel"]

TOKEN_ENV = "TOUBA_PANEL_TOKEN"  # noqa: S105 - the name of the variable, not a secret


# The panel opens its stores as the read-only commands do, with its own options as advice.
_MEMORY_HINT: Final = "did you mean --history-db?"
_HISTORY_HINT: Final = "did you mean --db (the memory store)?"


def _usage(message: str) -> typer.Exit:
    errors.print(f"[bold red]usage[/]: {message}")
    return typer.Exit(2)


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _history_backend(
    history_db: Path | None, history_dsn: str | None, redis_url: str | None
) -> Backend | None:
    offered: tuple[tuple[str, Kind, str | None], ...] = (
        ("--history-db", "sqlite", None if history_db is None else str(history_db)),
        ("--history-dsn", "postgresql", history_dsn),
        ("--redis-url", "redis", redis_url),
    )
    given = [(name, Backend(kind, value)) for name, kind, value in offered if value]
    if len(given) > 1:
        names = " and ".join(name for name, _ in given)
        raise _usage(f"give at most one history store; got {names}")
    return given[0][1] if given else None


@asynccontextmanager
async def _maybe_history(
    backend: Backend | None, table: str | None, prefix: str | None, limits: Limits
) -> AsyncIterator[HistoryAdmin | None]:
    if backend is None:
        yield None
        return
    async with open_history(
        backend, table=table, prefix=prefix, read_only=True, hint=_HISTORY_HINT, **limits
    ) as store:
        yield store


def _refused(path: Path, why: str) -> typer.Exit:
    errors.print(f"[bold red]{escape(str(path))}[/]: {escape(why)}")
    return typer.Exit(1)


def _check_checkpoints(path: Path) -> None:
    """Refuse ``path`` unless it is a touba checkpoint store this touba opens as it is
    (exists, schema version 1, mode 0600, a private location); reads only."""
    import sqlite3

    from touba.history._files import check_private_location
    from touba.history._sqlite import describe
    from touba.runtime._checkpoints import SCHEMA_VERSION

    if not path.exists():
        raise _refused(path, "no such file; nothing was created (give the application's file)")
    try:
        check_private_location(path)
        found = sqlite_contents(path)
    except (sqlite3.Error, OSError) as e:
        raise _refused(path, f"this file cannot be read as SQLite ({describe(e)})") from e
    except ToubaError as e:
        raise _refused(path, e.message) from e
    if "checkpoint" not in found.kinds:
        raise _refused(path, "this SQLite file holds no touba checkpoint store")
    if found.kinds["checkpoint"] != str(SCHEMA_VERSION):
        raise _refused(
            path,
            f"this file holds touba checkpoint schema version {found.kinds['checkpoint']}; "
            f"this touba reads version {SCHEMA_VERSION}",
        )
    if found.mode & 0o077:
        raise _refused(
            path,
            f"this file is readable or writable by group or others (mode {found.mode:o}); "
            f"opening it would reset it to 0600: chmod 600 {path}",
        )


def _hosts(spec: str | None, checkpoints_db: Path | None) -> tuple[Program, Runtime | None]:
    """The program, and the runtime whose checkpoints the approvals page resumes (if any)."""
    loaded = load_host(spec)
    if isinstance(loaded, Runtime):
        if checkpoints_db is not None:
            raise _usage(
                "--checkpoints-db applies to a --program naming a touba.Program; this one "
                "names a touba.Runtime, whose own checkpoint store the panel uses"
            )
        return loaded.program, loaded
    return loaded, None


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host.strip("[]"), port))
        sock.listen(128)
    except OSError as e:
        sock.close()
        errors.print(f"[bold red]cannot listen on {host}:{port}[/]: {e}")
        raise typer.Exit(1) from e
    return sock


def _logging() -> None:
    logger = logging.getLogger("touba.panel")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


def panel(
    db: Db = None,
    dsn: DsnOption = None,
    prefix: PrefixOption = None,
    history_db: HistoryDbOption = None,
    history_dsn: HistoryDsnOption = None,
    redis_url: RedisUrlOption = None,
    history_table: HistoryTableOption = None,
    history_prefix: HistoryPrefixOption = None,
    max_sessions: Annotated[
        int | None,
        typer.Option("--max-sessions", min=1, help="The history store's max_sessions (128)."),
    ] = None,
    max_store_bytes: Annotated[
        int | None,
        typer.Option("--max-store-bytes", min=1, help="The history store's max_store_bytes."),
    ] = None,
    keys_file: KeysFileOption = None,
    current: CurrentOption = None,
    program: ProgramOption = None,
    checkpoints_db: Annotated[
        Path | None,
        typer.Option(
            "--checkpoints-db",
            help="The application's SqliteCheckpointStore file: the approvals page resumes "
            "its invocations (not with a --program naming a Runtime).",
        ),
    ] = None,
    host: Annotated[
        str, typer.Option("--host", help="The address to bind (loopback unless --allow-remote).")
    ] = "127.0.0.1",
    port: Annotated[
        int, typer.Option("--port", min=0, max=65535, help="The port (0: a free one).")
    ] = 8765,
    allow_remote: Annotated[
        bool,
        typer.Option(
            "--allow-remote",
            help="Serve a non-loopback --host: only behind a TLS proxy (the cookie is Secure).",
        ),
    ] = False,
) -> None:
    """Serve the web memory panel: settings, users, key events, conversations, jobs,
    approvals."""
    if not _loopback(host) and not allow_remote:
        raise _usage(
            f"--host {host} is not a loopback address: the panel shows conversation data and "
            "its token would travel in clear. Put a TLS proxy in front and pass "
            "--allow-remote, or keep --host 127.0.0.1"
        )
    target = memory_target(db, dsn, prefix, keys_file, current)
    encryption = target.encryption
    history = _history_backend(history_db, history_dsn, redis_url)
    if history_table is not None and (history is None or history.kind != "postgresql"):
        raise _usage("--history-table applies to --history-dsn only")
    if history_prefix is not None and (history is None or history.kind != "redis"):
        raise _usage("--history-prefix applies to --redis-url only")
    limits = Limits()
    if max_sessions is not None:
        limits["max_sessions"] = max_sessions
    if max_store_bytes is not None:
        limits["max_store_bytes"] = max_store_bytes
    if encryption is not None:
        limits["encryption"] = encryption
    loaded, runtime = _hosts(program, checkpoints_db)
    if checkpoints_db is not None:
        _check_checkpoints(checkpoints_db)
    token = os.environ.get(TOKEN_ENV) or None
    if token is not None and len(token) < 16:
        raise _usage(f"{TOKEN_ENV} must hold at least 16 characters")

    try:
        import uvicorn

        from touba.panel import create_app
        from touba.panel._auth import new_token
    except ImportError as e:
        errors.print(f"[bold red]{e}[/]")
        raise typer.Exit(2) from e

    async def go() -> None:
        # Both stores are checked before either is opened: nothing is touched when one
        # of them is refused.
        await check_store(
            target.backend, "memory", name=target.prefix, read_only=True, hint=_MEMORY_HINT
        )
        if history is not None:
            await check_store(
                history, "history", name=history_table, read_only=True, hint=_HISTORY_HINT
            )
        async with AsyncExitStack() as stack:
            memory: Any = await stack.enter_async_context(
                open_memory(
                    target.backend,
                    prefix=target.prefix,
                    read_only=True,
                    hint=_MEMORY_HINT,
                    encryption=encryption,
                )
            )
            history_store = await stack.enter_async_context(
                _maybe_history(history, history_table, history_prefix, limits)
            )
            runtime_now: Runtime | None = runtime
            if checkpoints_db is not None:
                from touba.runtime import SqliteCheckpointStore

                checkpoints = await stack.enter_async_context(
                    SqliteCheckpointStore(checkpoints_db, encryption=encryption)
                )
                runtime_now = Runtime(loaded, checkpoints=checkpoints)
            secret = token or new_token()
            hosts = ("127.0.0.1", "localhost", "::1", "[::1]", host)
            app = create_app(
                loaded,
                memory,
                history_store,
                token=secret,
                allow_remote=allow_remote,
                allowed_hosts=hosts,
                runtime=runtime_now,
            )
            sock = _listen(host, port)
            bound = sock.getsockname()[1]
            shown = f"[{host.strip('[]')}]" if ":" in host else host
            scheme = "http"  # what it listens on; with --allow-remote, TLS is the proxy's
            if token is None:
                url = f"{scheme}://{shown}:{bound}/?token={secret}"
                print(f"touba panel: open {url}", flush=True)  # the one place the token shows
            else:
                print(
                    f"touba panel: open {scheme}://{shown}:{bound}/ (token: ${TOKEN_ENV})",
                    flush=True,
                )
            _logging()
            config = uvicorn.Config(
                app, log_level="warning", access_log=False, lifespan="off", proxy_headers=False
            )
            server = uvicorn.Server(config)
            await server.serve(sockets=[sock])

    secrets = tuple(b.address for b in (target.backend, history) if b and b.kind != "sqlite")
    from touba.cli._common import run

    run(go(), secret=secrets)

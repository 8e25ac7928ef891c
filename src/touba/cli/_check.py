"""``touba check``: what each store given is and what needs doing, by reading only.

- Stores: the memory store is ``--db PATH`` or ``--dsn DSN`` (``TOUBA_DSN``,
  ``--prefix``); the decision-history store ``--history-db PATH``,
  ``--history-dsn DSN`` (``--history-table``) or ``--redis-url URL``
  (``--history-prefix``): the options of ``touba panel``. At least one store;
  either may be left out.
- It never creates, migrates or changes a mode: a SQLite file is read with
  :func:`touba.history._sqlite_kinds.sqlite_contents` (read-only, no side file
  left) and a PostgreSQL name with :func:`touba.cli._kinds.pg_contents`. A store
  is opened for its counts only when that writes nothing: of the expected kind,
  at the current schema version, mode 0600, in a safe place (opened with
  ``create=False``, listed with ``purge=False``).
- Each store gets its facts (kind, schema version and whether opening would
  migrate it, file mode and owner, counts, reserved conversations, expired ones
  waiting for a purge) and its problems, each with the command or step that
  fixes it. A problem needs action (exit 1); a note does not (an expired
  conversation is purged by the next access anyway; a reservation held on
  another host may be a live worker). A reservation whose holder ran on this
  host under a pid that no longer exists is a problem: ``touba history recover``.
- ``--json`` prints the same as one object: ``{"healthy": ..., "stores": [...]}``.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import socket
import sqlite3
import stat
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape

from touba.cli._common import JsonOption, console, errors, print_json, redact, scrub
from touba.cli._kinds import StoreKind, pg_contents
from touba.cli._stores import (
    DsnOption,
    HistoryDbOption,
    HistoryDsnOption,
    HistoryPrefixOption,
    HistoryTableOption,
    RedisUrlOption,
    no_new_journal,
    pg_version,
    postgres_connection,
    store_deadline,
)
from touba.errors import ToubaError
from touba.history._files import check_private_location
from touba.history._sqlite import describe, failure_kind
from touba.history._sqlite_kinds import sqlite_contents
from touba.history._sqlite_schema import SCHEMA_VERSION as HISTORY_SQLITE_VERSION
from touba.memory.sqlite import SCHEMA_VERSION as MEMORY_SQLITE_VERSION

__all__ = ["check"]

_SQLITE_VERSIONS: dict[StoreKind, int] = {
    "history": HISTORY_SQLITE_VERSION,
    "memory": MEMORY_SQLITE_VERSION,
}
_OPTIONS: dict[StoreKind, dict[str, str]] = {
    "memory": {"sqlite": "--db", "postgresql": "--dsn", "name": "--prefix"},
    "history": {"sqlite": "--history-db", "postgresql": "--history-dsn", "name": "--history-table"},
}


@dataclass
class Report:
    """One store's diagnosis: facts, problems (each with its fix) and notes."""

    kind: StoreKind
    option: str
    backend: str
    address: str
    facts: dict[str, Any] = field(default_factory=dict)
    problems: list[dict[str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def problem(self, problem: str, fix: str) -> None:
        self.problems.append({"problem": problem, "fix": fix})

    @property
    def healthy(self) -> bool:
        return not self.problems

    def data(self) -> dict[str, Any]:
        return {
            "store": self.kind,
            "option": self.option,
            "backend": self.backend,
            "address": self.address,
            "healthy": self.healthy,
            **self.facts,
            "problems": self.problems,
            "notes": self.notes,
        }


# -- SQLite ----------------------------------------------------------------------------------


def _owner(uid: int) -> str:
    try:
        import pwd

        return pwd.getpwuid(uid).pw_name
    except (ImportError, KeyError):
        return str(uid)


def _version_problem(report: Report, version: str, current: int, fix_migrate: str) -> bool:
    """Record what opening would do to a store of ``version``; whether it is current."""
    migrates = version.isdigit() and int(version) < current
    report.facts["schema_version"] = version
    report.facts["current_schema_version"] = current
    report.facts["opening_migrates"] = migrates
    if version == str(current):
        return True
    if migrates:
        report.problem(
            f"touba {report.kind} schema version {version}: opening it migrates it to "
            f"version {current}, so the read-only commands and the panel refuse it",
            fix_migrate,
        )
    else:
        report.problem(
            f"touba {report.kind} schema version {version}, written by a newer touba",
            "upgrade touba (pip install -U touba) before using this store",
        )
    return False


def _sqlite(path: Path, kind: StoreKind, option: str) -> tuple[Report, bool]:
    """Diagnose the file ``path`` by reading only; also whether opening it writes nothing."""
    report = Report(kind, option, "SQLite", str(path))
    if not os.path.lexists(path):
        report.facts["exists"] = False
        creator = "touba chat" if kind == "memory" else "your application"
        report.problem(
            f"no file at {path}", f"check {option}; {creator} creates the store on first use"
        )
        return report, False
    report.facts["exists"] = True
    safe = True
    try:
        check_private_location(path)
    except ToubaError as e:
        safe = False
        report.problem(
            str(e).split("; nothing was opened")[0],
            "move it to a private directory (mode 0700) of your own, as a regular file you own",
        )
    st = os.lstat(path)
    mode = stat.S_IMODE(st.st_mode)
    report.facts["mode"] = f"{mode:o}"
    report.facts["owner"] = _owner(st.st_uid)
    report.facts["unsafe_mode"] = bool(mode & 0o077)
    if not stat.S_ISREG(st.st_mode):
        return report, False
    try:
        found = sqlite_contents(path)
    except (sqlite3.Error, OSError) as e:
        if failure_kind(e) == "not_a_database":
            report.problem("this file is not a SQLite database", f"check {option}")
        else:
            report.problem(f"this SQLite file cannot be read ({describe(e)})", f"check {option}")
        return report, False
    report.facts["holds"] = found.kinds
    for suffix in ("-wal", "-journal"):
        side = f"{path}{suffix}"
        # An empty -journal is the one every opening makes 0600 in advance (SPEC 6).
        if os.path.exists(side) and (suffix == "-wal" or os.path.getsize(side) > 0):
            report.notes.append(
                f"a {suffix} file is beside it: a process has the store open, or one stopped "
                "without closing it (the next opening recovers it)"
            )
    if kind not in found.kinds:
        other = [k for k in found.kinds if k in _OPTIONS and k != kind]
        if other:
            right = _OPTIONS[other[0]]["sqlite"]
            report.problem(
                f"this file holds a touba {other[0]} store, not a {kind} store",
                f"give it as {right}, and the {kind} store's file as {option}",
            )
        elif found.kinds:
            names = " and ".join(found.kinds)
            report.problem(
                f"this file holds touba {names} data, no {kind} store", f"check {option}"
            )
        else:
            report.problem(
                "this SQLite file has no touba tables (another application's database?)",
                f"check {option}",
            )
        return report, False
    if mode & 0o077:  # said of touba's stores only: another file's mode is not ours to fix
        safe = False
        report.problem(
            f"the file is readable or writable by group or others (mode {mode:o}); opening "
            "it resets it to 0600, so the read-only commands and the panel refuse it",
            f"chmod 600 {shlex.quote(str(path))}",
        )
    writer = (
        f"touba history purge --db {shlex.quote(str(path))}"
        if kind == "history"
        else f"touba chat --db {shlex.quote(str(path))}"
    )
    fix = f"open it once with your application (or `{writer}`), which migrates it"
    current = _version_problem(report, found.kinds[kind], _SQLITE_VERSIONS[kind], fix)
    return report, safe and current


# -- counts (a store that opening leaves unchanged) -----------------------------------------


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


async def _history_counts(report: Report, store: Any, recover: str) -> None:
    rows = await store.list(purge=False)
    live = [r for r in rows if not r.expired or r.active]
    expired = [r for r in rows if r.expired and not r.active]
    reserved = [r for r in rows if r.active]
    report.facts["conversations"] = len(live)
    report.facts["stored_bytes"] = sum(r.bytes for r in rows)
    report.facts["expired_waiting_for_purge"] = len(expired)
    report.facts["reserved"] = [{"key": r.key, "holder": r.reservation} for r in reserved]
    if expired:
        report.notes.append(
            f"{len(expired)} expired conversation(s) still stored; the next access purges "
            f"them, or now: touba history purge {recover}"
        )
    here = socket.gethostname()
    for row in reserved:
        holder = row.reservation or {}
        pid, host = holder.get("pid"), holder.get("host")
        command = f"touba history recover {shlex.quote(row.key)} {recover} --worker-stopped"
        if host == here and isinstance(pid, int) and not _alive(pid):
            report.problem(
                f"conversation {row.key} is reserved by pid {pid} on this host, which is no "
                f"longer running (since {holder.get('since')})",
                command,
            )
        else:
            report.notes.append(
                f"conversation {row.key} is reserved by pid {pid} on {host} since "
                f"{holder.get('since')}; if that worker stopped: {command}"
            )


async def _memory_counts(report: Report, store: Any) -> None:
    report.facts["sessions"] = await store.count_sessions()
    report.facts["owners"] = await store.count_owners()
    jobs = await store.count_jobs()
    report.facts["jobs"] = jobs
    if jobs.get("failed"):
        report.notes.append(
            f"{jobs['failed']} extraction job(s) failed: touba events jobs --status failed"
        )


async def _check_sqlite(path: Path, kind: StoreKind, option: str) -> Report:
    report, openable = await asyncio.to_thread(_sqlite, path, kind, option)
    if not openable:
        return report
    if kind == "history":
        from touba.history.sqlite import SqliteHistoryStore

        with no_new_journal(str(path)):
            async with SqliteHistoryStore(path, create=False) as store:
                await _history_counts(report, store, f"--db {shlex.quote(str(path))}")
    else:
        from touba.memory import SqliteMemoryStore

        with no_new_journal(str(path)):
            async with SqliteMemoryStore(path, create=False) as memory:
                await _memory_counts(report, memory)
    return report


# -- PostgreSQL and Redis ----------------------------------------------------------------------


async def _check_postgres(dsn: str, name: str | None, kind: StoreKind) -> Report:
    options = _OPTIONS[kind]
    default = "touba_history" if kind == "history" else "touba_memory"
    name = name or default
    report = Report(kind, options["postgresql"], "PostgreSQL", redact(dsn))
    report.facts["name"] = name
    async with postgres_connection(dsn) as conn:
        found = await pg_contents(conn, name)
        main = name if kind == "history" else f"{name}_sessions"
        owner = await (
            await conn.execute(
                "SELECT pg_get_userbyid(relowner) FROM pg_class WHERE oid = to_regclass(%s)",
                (main,),
            )
        ).fetchone()
    report.facts["exists"] = kind in found.kinds
    report.facts["holds"] = dict.fromkeys(found.kinds, found.version)
    if owner is not None:
        report.facts["owner"] = str(owner[0])
    where = f"{options['name']} {name!r}"
    if kind not in found.kinds:
        if found.kinds:
            report.problem(
                f"{where} holds a touba {found.kinds[0]} store, not a {kind} store",
                f"check {options['name']}",
            )
        elif found.main:
            report.problem(f"{where} is a table that is not touba's", f"check {options['name']}")
        else:
            report.problem(
                f"there is no touba {kind} store {where} in this database",
                f"check {options['postgresql']} and {options['name']}; the application "
                "creates it on first use",
            )
        return report
    fix = "open it once with your application, which migrates it"
    if not _version_problem(report, str(found.version), int(pg_version(kind)), fix):
        return report
    if kind == "history":
        from touba.history.postgres import PostgresHistoryStore

        async with PostgresHistoryStore(
            dsn, table=name, create=False, deadline_seconds=store_deadline()
        ) as store:
            await _history_counts(report, store, f"--dsn DSN --table {shlex.quote(name)}")
    else:
        from touba.memory.postgres import PostgresMemoryStore

        async with PostgresMemoryStore(
            dsn, prefix=name, create=False, deadline_seconds=store_deadline()
        ) as memory:
            await _memory_counts(report, memory)
    return report


async def _check_redis(url: str, prefix: str | None) -> Report:
    from redis.asyncio import Redis

    from touba.history.redis import RedisHistoryStore

    prefix = prefix if prefix is not None else "touba:"
    report = Report("history", "--redis-url", "Redis", redact(url))
    report.facts["prefix"] = prefix
    client = Redis.from_url(url)
    try:
        await client.ping()
        store = RedisHistoryStore(client=client, prefix=prefix)
        try:
            usage = await store.usage(purge=False)
            report.facts["exists"] = usage.sessions > 0
            if not usage.sessions:
                report.problem(
                    f"nothing is stored under the prefix {prefix!r} (an empty store, or not "
                    "the application's prefix)",
                    "check --redis-url and --history-prefix (the prefix given to "
                    "RedisHistoryStore)",
                )
                return report
            await _history_counts(report, store, f"--redis-url URL --prefix {shlex.quote(prefix)}")
        finally:
            await store.close()
    finally:
        await client.aclose()
    return report


# -- the command --------------------------------------------------------------------------------


def _unreachable(kind: StoreKind, option: str, backend: str, address: str, e: Exception) -> Report:
    report = Report(kind, option, backend, redact(address))
    reason = scrub(str(e), (address,)).strip().splitlines()[0] if str(e).strip() else ""
    report.problem(
        f"cannot open it ({type(e).__name__}{': ' + reason if reason else ''})",
        "check the address, that the server runs and the credentials",
    )
    return report


def _print(report: Report) -> None:
    state = "[green]healthy[/]" if report.healthy else "[bold red]needs action[/]"
    console.print(
        f"[bold]{report.kind} store[/] {report.option} {escape(report.address)} "
        f"({report.backend}): {state}"
    )
    for name, value in report.facts.items():
        shown = value
        if name == "holds":
            shown = ", ".join(f"touba {k} store (schema {v})" for k, v in value.items())
            shown = shown or "no touba store"
        elif isinstance(value, dict):
            shown = ", ".join(f"{k} {v}" for k, v in value.items()) or "none"
        elif isinstance(value, list):
            shown = ", ".join(str(v.get("key", v) if isinstance(v, dict) else v) for v in value)
            shown = shown or "none"
        console.print(f"  {name.replace('_', ' ')}: {escape(str(shown))}")
    for problem in report.problems:
        console.print(f"  [bold red]problem[/]: {escape(problem['problem'])}")
        console.print(f"    fix: {escape(problem['fix'])}")
    for note in report.notes:
        console.print(f"  [yellow]note[/]: {escape(note)}")


def check(
    db: Annotated[Path | None, typer.Option("--db", help="Path of the SQLite memory file.")] = None,
    dsn: DsnOption = None,
    prefix: Annotated[
        str | None,
        typer.Option("--prefix", help="With --dsn: the memory store's table prefix."),
    ] = None,
    history_db: HistoryDbOption = None,
    history_dsn: HistoryDsnOption = None,
    redis_url: RedisUrlOption = None,
    history_table: HistoryTableOption = None,
    history_prefix: HistoryPrefixOption = None,
    raw: JsonOption = False,
) -> None:
    """Diagnose the stores given, reading only: what each is, and what needs doing.

    Exit 0 when every store is healthy, 1 when one needs action (each problem
    comes with the command that fixes it). Creates, migrates and changes nothing.
    """
    if db is not None and dsn is not None:
        raise _usage("give one memory store: --db or --dsn")
    history_given = [v for v in (history_db, history_dsn, redis_url) if v]
    if len(history_given) > 1:
        raise _usage("give one history store: --history-db, --history-dsn or --redis-url")
    if db is None and dsn is None and not history_given:
        raise _usage(
            "give a store: --db or --dsn (memory), --history-db, --history-dsn or --redis-url "
            "(history)"
        )
    if prefix is not None and dsn is None:
        raise _usage("--prefix applies to --dsn only")
    if history_table is not None and history_dsn is None:
        raise _usage("--history-table applies to --history-dsn only")
    if history_prefix is not None and redis_url is None:
        raise _usage("--history-prefix applies to --redis-url only")

    async def one(
        kind: StoreKind,
        option: str,
        backend: str,
        address: str,
        diagnose: Coroutine[Any, Any, Report],
    ) -> Report:
        try:
            return await diagnose
        except (ToubaError, OSError, ImportError) as e:
            return _unreachable(kind, option, backend, address, e)
        except Exception as e:  # the driver's own errors (psycopg, redis)
            if type(e).__module__.split(".")[0] not in ("psycopg", "redis", "psycopg_pool"):
                raise
            return _unreachable(kind, option, backend, address, e)

    async def go() -> list[Report]:
        reports = []
        if db is not None:
            reports.append(
                await one("memory", "--db", "SQLite", str(db), _check_sqlite(db, "memory", "--db"))
            )
        elif dsn is not None:
            reports.append(
                await one(
                    "memory", "--dsn", "PostgreSQL", dsn, _check_postgres(dsn, prefix, "memory")
                )
            )
        if history_db is not None:
            reports.append(
                await one(
                    "history",
                    "--history-db",
                    "SQLite",
                    str(history_db),
                    _check_sqlite(history_db, "history", "--history-db"),
                )
            )
        elif history_dsn is not None:
            reports.append(
                await one(
                    "history",
                    "--history-dsn",
                    "PostgreSQL",
                    history_dsn,
                    _check_postgres(history_dsn, history_table, "history"),
                )
            )
        elif redis_url is not None:
            reports.append(
                await one(
                    "history",
                    "--redis-url",
                    "Redis",
                    redis_url,
                    _check_redis(redis_url, history_prefix),
                )
            )
        return reports

    reports = asyncio.run(go())
    healthy = all(r.healthy for r in reports)
    if raw:
        print_json({"healthy": healthy, "stores": [r.data() for r in reports]})
    else:
        for report in reports:
            _print(report)
    if not healthy:
        raise typer.Exit(1)


def _usage(message: str) -> typer.Exit:
    errors.print(f"[bold red]usage[/]: {message}")
    return typer.Exit(2)

"""A pytest plugin that runs openai-agents' own session tests against ToubaSession.

Loaded into the test suite of the openai-agents source distribution (see
``run_openai_agents.py``), it replaces the SDK's ``SQLiteSession`` with
:class:`PeerSession`, a :class:`~touba.integrations.openai_agents.ToubaSession`
taking ``SQLiteSession``'s constructor: a file path gets a
:class:`~touba.history.sqlite.SqliteHistoryStore` on that file, ``":memory:"``
a :class:`~touba.history.MemoryHistoryStore`. Nothing else is changed: the
tests run as upstream wrote them, except those listed in :data:`DESELECTED`
with the reason each cannot apply.
"""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path
from typing import Any

import agents
import agents.memory
import agents.memory.sqlite_session
import pytest

from touba.history import HistoryStore, MemoryHistoryStore
from touba.history.sqlite import SqliteHistoryStore
from touba.integrations.openai_agents import ToubaSession

PRIVATE = "reads or patches SQLiteSession's private internals"
SCHEMA = "reads or alters SQLiteSession's own tables (agent_sessions, agent_messages)"

DESELECTED: dict[str, str] = {
    "test_session.py::test_sqlite_session_close_closes_worker_thread_connections": (
        f"{PRIVATE} (session._connections)"
    ),
    "test_session.py::test_sqlite_session_reaps_connections_from_exited_worker_threads": (
        f"{PRIVATE} (session._connections)"
    ),
    "test_session.py::test_sqlite_session_closes_retired_connections_before_the_next_allocation": (
        f"{PRIVATE} (session._connections, sqlite3.connect); its three threads also write "
        "concurrently, which ToubaSession refuses by design (DecisionHistoryBusy)"
    ),
    "test_session.py::test_sqlite_session_keeps_connections_of_live_worker_threads": (
        f"{PRIVATE} (session._connections)"
    ),
    "test_session.py::test_sqlite_session_closed_rejects_empty_add_items": (
        "expects SQLiteSession's own close() message; a ToubaSession does not own its store"
    ),
    "test_session.py::test_sqlite_session_pop_item_skips_corrupt_most_recent": (
        f"{PRIVATE} (_locked_connection) to insert a corrupt row; touba refuses a corrupt "
        "record typed (DecisionHistoryRecordInvalid) instead of skipping it"
    ),
    "test_session.py::test_sqlite_session_pop_item_returns_none_after_dropping_only_corrupt_rows": (
        f"{PRIVATE} (_locked_connection) to insert a corrupt row"
    ),
    "test_session.py::test_sqlite_session_get_items_limit_skips_corrupt_newest_rows": (
        f"{PRIVATE} (_locked_connection) to insert a corrupt row"
    ),
    "test_session.py::test_sqlite_session_get_items_session_settings_limit_skips_corrupt_rows": (
        f"{PRIVATE} (_locked_connection) to insert a corrupt row"
    ),
    "test_session.py::test_sqlite_session_concurrent_access": (
        "five threads add to one session at the same time: ToubaSession refuses an operation "
        "that meets another in progress (DecisionHistoryBusy) instead of interleaving, by design"
    ),
    "test_session.py::test_sqlite_session_file_lock_is_shared_across_instances": (
        f"{PRIVATE} (_lock, _file_lock_counts, _file_locks)"
    ),
    "test_session.py::test_sqlite_session_failed_add_items_releases_write_lock": SCHEMA,
    "test_session.py::test_sqlite_session_failed_clear_session_rolls_back": SCHEMA,
    "test_session.py::test_sqlite_session_failed_pop_item_releases_write_lock": SCHEMA,
    "test_session.py::test_sqlite_session_rollback_failure_evicts_connection": (
        f"{PRIVATE} (_connections, _get_connection)"
    ),
    "test_session.py::test_sqlite_session_close_retries_quarantined_connection": (
        f"{PRIVATE} (_connections, _get_connection, _closed, _quarantined_connections)"
    ),
    "test_session.py::"
    "test_sqlite_session_post_commit_cancellation_propagates_after_known_outcome": (
        f"{PRIVATE} (_connections, _get_connection) to pause a commit"
    ),
    "test_session_limit.py::test_session_limit_drops_unmatched_history_function_call_output": (
        "expects get_items(limit=2) to return a function_call_output without its call: "
        "ToubaSession cuts by complete exchanges and never returns one side of a pair, by design"
    ),
}


def _close_store(store: HistoryStore) -> None:
    """Close ``store`` from sync code that may run inside an event loop (SQLiteSession.close)."""
    close = getattr(store, "close", None)
    if close is None:
        return
    errors: list[BaseException] = []

    def run() -> None:
        try:
            asyncio.run(close())
        except BaseException as e:  # reported to the caller below
            errors.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]


_CURRENT: list[str] = [""]
_USED: set[str] = set()


class PeerSession(ToubaSession):
    """ToubaSession behind SQLiteSession's constructor and its synchronous ``close()``."""

    def __init__(
        self,
        session_id: str,
        db_path: str | Path = ":memory:",
        sessions_table: str = "agent_sessions",
        messages_table: str = "agent_messages",
        session_settings: Any = None,
    ) -> None:
        _USED.add(_CURRENT[0])
        store: HistoryStore
        if str(db_path) == ":memory:":
            store = MemoryHistoryStore()
        else:
            store = SqliteHistoryStore(os.fspath(db_path))
        try:
            super().__init__(
                session_id, store=store, namespace="peer-suite", session_settings=session_settings
            )
        except BaseException:
            _close_store(store)
            raise
        self.db_path = db_path

    def close(self) -> None:
        _close_store(self.store)


setattr(agents, "SQLiteSession", PeerSession)  # noqa: B010 - swapped for the upstream tests
setattr(agents.memory, "SQLiteSession", PeerSession)  # noqa: B010
setattr(agents.memory.sqlite_session, "SQLiteSession", PeerSession)  # noqa: B010


def _reason(item: pytest.Item) -> str | None:
    name = item.nodeid.split("[", 1)[0]
    for suffix, reason in DESELECTED.items():
        if name.endswith(suffix):
            return reason
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    kept: list[pytest.Item] = []
    dropped: list[pytest.Item] = []
    for item in items:
        (dropped if _reason(item) else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
    config.stash[_DROPPED] = dropped


_DROPPED = pytest.StashKey[list[pytest.Item]]()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    _CURRENT[0] = item.nodeid


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if not _USED and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED  # the swap did not take: a false green


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    dropped = config.stash.get(_DROPPED, [])
    terminalreporter.section("touba: ToubaSession in place of SQLiteSession")
    terminalreporter.line(f"{len(_USED)} tests constructed a ToubaSession (as SQLiteSession)")
    terminalreporter.section(f"touba: {len(dropped)} upstream tests deselected")
    for item in dropped:
        terminalreporter.line(f"{item.nodeid}: {_reason(item)}")

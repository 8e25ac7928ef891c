"""A pytest plugin that runs openai-agents' own session tests against ToubaSession.

Loaded into the test suite of the openai-agents source distribution (see
``run_openai_agents.py``), it replaces the SDK's ``SQLiteSession`` with
:class:`PeerSession`, a :class:`~touba.integrations.openai_agents.ToubaSession`
taking ``SQLiteSession``'s constructor: a file path gets a
:class:`~touba.history.sqlite.SqliteHistoryStore` on that file, ``":memory:"``
a :class:`~touba.history.MemoryHistoryStore`. In the modules of :data:`STREAMED`, which
exercise sessions under ``Runner.run_streamed`` with the suite's in-memory
``SimpleListSession``, that list session is swapped too, for
:class:`PeerListSession` (a ToubaSession on a RAM store taking its
constructor). Nothing else is changed: the tests run as upstream wrote them,
except those listed in :data:`DESELECTED` with the reason each cannot apply.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from pathlib import Path
from typing import Any

import agents
import agents.memory
import agents.memory.sqlite_session
import pytest
from agents.items import TResponseInputItem
from agents.run import AgentRunner

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
    "test_agent_runner_streamed.py::test_run_llm_again_approval_persists_completed_sibling": (
        "reads get_items() while the approval tool's call, in the same response as the "
        "completed sibling, still waits for its output: ToubaSession stores that exchange but "
        "never returns an incomplete one, by design (the rest of the test passes: after the "
        "resume both pairs are returned once each)"
    ),
    "test_resume.py::test_a_detached_resume_does_not_make_the_next_one_rewrite_the_session": (
        "expects get_items() to return the parked call_PARKED, whose output the detached "
        "resume never wrote to this session: ToubaSession keeps that incomplete exchange but "
        "never returns it, by design (stored, call_PARKED is there once, as the test wants)"
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


class PeerListSession(ToubaSession):
    """ToubaSession on a RAM store behind the suite's ``SimpleListSession`` constructor.

    ``history`` is written before the session's first operation (the constructor is
    synchronous, the store asynchronous).
    """

    def __init__(
        self, session_id: str = "test", history: list[TResponseInputItem] | None = None
    ) -> None:
        _USED.add(_CURRENT[0])
        super().__init__(session_id, store=MemoryHistoryStore(), namespace="peer-suite")
        self._history = list(history) if history else []

    async def _seed(self) -> None:
        history, self._history = self._history, []
        if history:
            await super().add_items(history)

    async def get_items(self, limit: int | None = None) -> list[TResponseInputItem]:
        """As ToubaSession's, after writing the constructor's history."""
        await self._seed()
        return await super().get_items(limit)

    async def add_items(self, items: list[TResponseInputItem]) -> None:
        """As ToubaSession's, after writing the constructor's history."""
        await self._seed()
        await super().add_items(items)

    async def pop_item(self) -> TResponseInputItem | None:
        """As ToubaSession's, after writing the constructor's history."""
        await self._seed()
        return await super().pop_item()

    async def clear_session(self) -> None:
        """As ToubaSession's (the constructor's history is dropped too)."""
        self._history = []
        await super().clear_session()


# The modules whose tests run sessions under Runner.run_streamed with the suite's
# SimpleListSession (tests/utils/simple_session.py): there it is swapped for PeerListSession.
STREAMED = (
    "tests.test_agent_runner_streamed",
    "tests.test_cancel_streaming",
    "tests.deferred_session_writes.helpers",
    "tests.deferred_session_writes.test_filters",
    "tests.deferred_session_writes.test_max_turns",
    "tests.deferred_session_writes.test_resume",
    "tests.test_runtime_symmetry_contract",
)
_STREAMED_WITH_TOUBA: set[str] = set()
_run_streamed = AgentRunner.run_streamed


def _counting_run_streamed(self: AgentRunner, *args: Any, **kwargs: Any) -> Any:
    """Runner.run_streamed, noting each test that streams a run with a ToubaSession."""
    if isinstance(kwargs.get("session"), ToubaSession):
        _STREAMED_WITH_TOUBA.add(_CURRENT[0])
    return _run_streamed(self, *args, **kwargs)


setattr(AgentRunner, "run_streamed", _counting_run_streamed)  # noqa: B010
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
    for name in STREAMED:  # imported by now: collected (or imported by a collected module)
        module = sys.modules.get(name)
        if module is not None and hasattr(module, "SimpleListSession"):
            setattr(module, "SimpleListSession", PeerListSession)  # noqa: B010
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
    terminalreporter.line(
        f"{len(_USED)} tests constructed a ToubaSession (as SQLiteSession or SimpleListSession)"
    )
    terminalreporter.line(
        f"{len(_STREAMED_WITH_TOUBA)} tests ran Runner.run_streamed with a ToubaSession"
    )
    terminalreporter.section(f"touba: {len(dropped)} upstream tests deselected")
    for item in dropped:
        terminalreporter.line(f"{item.nodeid}: {_reason(item)}")

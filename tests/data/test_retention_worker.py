"""The extraction worker applies its retention periodically and reports the counts as an
event without content (a callback and a log line)."""

from __future__ import annotations

import logging
from datetime import timedelta
from pathlib import Path

import pytest

from tests.memory.conftest import FakeClock
from touba.data import Retention, RetentionReport
from touba.errors import ConfigurationError
from touba.memory import ExtractionWorker, SqliteMemoryStore
from touba.runtime import MemoryCheckpointStore, Program, Runtime

SECRET = "MARK-words-of-the-user"


async def _old_turn(store: SqliteMemoryStore, clock: FakeClock, session: str) -> None:
    await store.open_session(session, owner="user:u", agent_ref="a", mode="live")
    await store.append_turn(session, user=SECRET, replies=["r"])
    clock.advance(3 * 86_400)


class _Monotonic:
    """The worker's ``time.monotonic``, moved by the test (the period is not waited)."""

    def __init__(self) -> None:
        self.value = 1_000.0

    def monotonic(self) -> float:
        return self.value


async def test_the_worker_applies_its_retention_every_period_and_reports_it(
    private_dir: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    ticks = _Monotonic()
    monkeypatch.setattr("touba.memory._worker.time", ticks)
    clock = FakeClock()
    reports: list[RetentionReport] = []
    async with SqliteMemoryStore(private_dir / "memory.db", clock=clock) as store:
        await _old_turn(store, clock, "s1")
        worker = ExtractionWorker(
            Program(),
            store,
            retention=Retention(turns_days=2),
            retention_every=60,
            on_retention=reports.append,
        )
        with caplog.at_level(logging.INFO, logger="touba.memory"):
            assert await worker.run_due() == []  # no job; the retention ran first
        assert [r.counts for r in reports] == [
            {"memory": {"turns": 1, "sessions": 0, "extraction_jobs": 0}}
        ]
        assert reports[0].at == clock.now
        assert worker.last_retention is reports[0]
        logged = [r.getMessage() for r in caplog.records if "retention" in r.getMessage()]
        assert logged == [
            "retention applied: 1 removed "
            '{"memory": {"extraction_jobs": 0, "sessions": 0, "turns": 1}}'
        ]
        assert SECRET not in caplog.text
        # not due again yet: nothing applied, even with a new old turn
        await _old_turn(store, clock, "s2")
        ticks.value += 59.9
        await worker.run_job()
        assert len(reports) == 1
        ticks.value += 0.1
        await worker.run_job()
        assert [r.counts["memory"]["turns"] for r in reports] == [1, 1]
        assert await store.recent_turns("s2", 10) == ()


async def test_the_worker_applies_checkpoints_days_to_its_runtimes_store(
    private_dir: Path,
) -> None:
    clock = FakeClock()
    checkpoints = MemoryCheckpointStore()
    await checkpoints.save("waiting", {})
    runtime = Runtime(Program(), checkpoints=checkpoints)
    async with SqliteMemoryStore(private_dir / "memory.db", clock=clock) as store:
        worker = ExtractionWorker(runtime, store, retention=Retention(checkpoints_days=1))
        assert worker.checkpoints is checkpoints
        clock.now = clock.now.replace(year=2999)  # the ages are measured from the store's clock
        report = await worker.apply_retention()
        assert report is not None
        assert report.counts == {"checkpoints": {"checkpoints": 1}}
        assert len(checkpoints) == 0
        assert await worker.apply_retention() is None  # not due again for an hour
        forced = await worker.apply_retention(force=True)
        assert forced is not None
        assert forced.total == 0


async def test_a_failed_application_is_logged_and_extraction_goes_on(
    private_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock = FakeClock()
    async with SqliteMemoryStore(private_dir / "memory.db", clock=clock) as store:
        worker = ExtractionWorker(Program(), store, retention=Retention(turns_days=1))
        clock.now = clock.now.replace(tzinfo=None)  # a naive clock: the purge is refused
        with caplog.at_level(logging.WARNING, logger="touba.memory"):
            assert await worker.apply_retention() is None
        assert "retention failed (ConfigurationError)" in caplog.text
        clock.now = clock.now.replace(tzinfo=FakeClock().now.tzinfo) + timedelta(days=2)
        assert await worker.run_due() == []


async def test_worker_retention_arguments_are_checked(private_dir: Path) -> None:
    async with SqliteMemoryStore(private_dir / "memory.db") as store:
        with pytest.raises(ConfigurationError, match="checkpoint store"):
            ExtractionWorker(Program(), store, retention=Retention(checkpoints_days=1))
        with pytest.raises(ConfigurationError, match="retention must be"):
            ExtractionWorker(Program(), store, retention={"turns_days": 1})  # type: ignore[arg-type]
        for every in (0, -1.0, float("nan"), True):
            with pytest.raises(ConfigurationError, match="retention_every"):
                ExtractionWorker(Program(), store, retention_every=every)
        with pytest.raises(ConfigurationError, match="on_retention"):
            ExtractionWorker(Program(), store, on_retention=3)  # type: ignore[arg-type]
        plain = ExtractionWorker(Program(), store)
        assert await plain.apply_retention(force=True) is None  # none set: nothing runs

"""Disk faults in the SQLite history store are typed errors, the previous state kept.

Real system calls fail under libfiu (``tests/_fault_worker.py``, run by
``fiu-run``): a full disk (``pwrite`` ENOSPC), an I/O error (EIO), a failed
``fdatasync`` during commit, a read-only file system (EROFS on ``pwrite``, or on
``open`` when the store is made), and random faults over many decisions.
Each surfaces as ``DecisionHistoryStoreUnavailable`` chained to SQLite's own
error, the stored conversation unchanged. After a fault the live worker's key
is free again when its release can be written; when it cannot, the error
says that ``recover`` is needed, and ``recover`` then frees it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests._disk_faults import run_faulted


@pytest.mark.parametrize(
    ("scenario", "code"),
    [
        ("history-save-full-once", "SQLITE_FULL"),
        ("history-save-sync-once", "SQLITE_IOERR_FSYNC"),
        ("history-reserve-readonly", "SQLITE_IOERR_WRITE"),
    ],
)
def test_a_failed_write_is_typed_and_leaves_the_key_free(
    tmp_path: Path, scenario: str, code: str
) -> None:
    seen = run_faulted(scenario, tmp_path)
    error = seen["error"]
    assert error["type"] == "DecisionHistoryStoreUnavailable"
    assert (error["cause"], error["cause_code"]) == ("OperationalError", code)
    assert "the previous state is kept" in error["message"]
    assert "recover" not in error["message"]  # the key was given back
    assert seen["kept"] is True
    assert seen["read_before_recover"] is None  # not busy: the live worker can retry
    assert seen["retry"] is None
    assert seen["saved"] is True


def test_a_release_that_cannot_be_written_says_recover_is_needed(tmp_path: Path) -> None:
    seen = run_faulted("history-save-stuck", tmp_path)
    error = seen["error"]
    assert error["type"] == "DecisionHistoryStoreUnavailable"
    assert error["cause_code"] == "SQLITE_IOERR_WRITE"
    assert "could not be released either" in error["message"]
    assert "store.recover(key, worker_stopped=True)" in error["message"]
    assert "touba history recover" in error["message"]
    assert seen["read_before_recover"]["type"] == "DecisionHistoryBusy"
    assert seen["recovered"] is True
    assert seen["kept"] is True  # recover freed the key; the record is as it was
    assert seen["retry"] is None
    assert seen["saved"] is True


def test_a_live_worker_whose_release_failed_decides_again_without_recover(
    tmp_path: Path,
) -> None:
    seen = run_faulted("history-save-stuck-live", tmp_path)
    error = seen["error"]
    assert error["type"] == "DecisionHistoryStoreUnavailable"
    assert "could not be released either" in error["message"]
    assert "releases it before its next operation" in error["message"]
    assert seen["held_for_others"]["type"] == "DecisionHistoryBusy"
    assert seen["kept"] is True
    assert seen["retry"] is None  # its own reservation was released first
    assert seen["free"] is True
    assert seen["saved"] is True


def test_random_faults_never_leave_a_live_worker_busy_on_its_own_conversation(
    tmp_path: Path,
) -> None:
    seen = run_faulted("history-random-live", tmp_path, timeout=300)
    assert seen["busy"] == []
    assert seen["last"] is None  # once the disk works, the decision goes through
    assert seen["untyped"] == []
    assert seen["failures"] > 5
    assert seen["exchanges"] == seen["stats"] == seen["successes"]


def test_a_read_only_file_system_at_open_is_typed(tmp_path: Path) -> None:
    error = run_faulted("history-open-readonly", tmp_path)["error"]
    assert error["type"] == "DecisionHistoryStoreUnavailable"
    assert error["cause"] == "OSError"
    assert "EROFS" in error["message"]


def test_random_faults_over_many_decisions_are_all_typed_and_corrupt_nothing(
    tmp_path: Path,
) -> None:
    seen = run_faulted("history-random", tmp_path, timeout=300)
    assert seen["untyped"] == []
    assert seen["unsaid"] == []
    assert seen["failures"] > 10
    assert seen["successes"] > 10
    # Every decision that returned is stored, none that failed: nothing lost, no ghost.
    assert seen["exchanges"] == seen["stats"] == seen["successes"]

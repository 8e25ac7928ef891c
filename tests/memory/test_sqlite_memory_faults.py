"""Disk faults in the SQLite memory store are typed errors, the previous state kept.

Real system calls fail under libfiu (``tests/_fault_worker.py``): a full disk
and a failed ``fdatasync`` while a turn is appended, a persistent I/O error
while a key event is created, a read-only file system when the store opens.
Each is ``MemoryStoreUnavailable`` chained to SQLite's (or the OS's) error;
the failed write left nothing behind and the store keeps working.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests._disk_faults import run_faulted


@pytest.mark.parametrize(
    ("scenario", "code"),
    [("memory-append-full", "SQLITE_FULL"), ("memory-append-sync", "SQLITE_IOERR_FSYNC")],
)
def test_a_failed_write_is_typed_and_the_store_goes_on(
    tmp_path: Path, scenario: str, code: str
) -> None:
    seen = run_faulted(scenario, tmp_path)
    assert seen["error"]["type"] == "MemoryStoreUnavailable"
    assert seen["error"]["cause_code"] == code
    assert seen["kept"] == ["hello"]  # the failed turn was not written
    assert seen["retry"] is None
    assert seen["turns"] == ["hello", "again"]
    assert seen["persistent"]["type"] == "MemoryStoreUnavailable"
    assert seen["events"] == 0


def test_a_read_only_file_system_at_open_is_typed(tmp_path: Path) -> None:
    error = run_faulted("memory-open-readonly", tmp_path)["error"]
    assert error["type"] == "MemoryStoreUnavailable"
    assert error["cause"] == "OSError"
    assert "EROFS" in error["message"]

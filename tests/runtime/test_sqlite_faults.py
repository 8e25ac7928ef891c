"""The runtime's SQLite stores turn every failure of the file into their typed error.

Disk faults come from libfiu (``tests/_fault_worker.py`` under ``fiu-run``): an
I/O error, a full disk and a read-only file system on every ``pwrite`` while
checkpoints are saved, taken and replaced and while resources are written, and
a read-only file system when the stores open. A file that another connection
keeps locked past ``timeout`` is a real second connection here. Each failure
is ``CheckpointStoreUnavailable`` or ``ResourceBindingUnavailable``
(retryable), chained to SQLite's error, with nothing changed.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from tests._disk_faults import run_faulted
from touba.errors import CheckpointStoreUnavailable, ResourceBindingUnavailable
from touba.runtime import SqliteCheckpointStore, SqliteResourceBinding
from touba.runtime._resources import ResourceAddress


@pytest.mark.parametrize(
    ("scenario", "code"),
    [("checkpoints-eio", "SQLITE_IOERR_WRITE"), ("checkpoints-full", "SQLITE_FULL")],
)
def test_checkpoint_writes_that_fail_are_typed_and_change_nothing(
    tmp_path: Path, scenario: str, code: str
) -> None:
    seen = run_faulted(scenario, tmp_path)
    for operation in ("save", "take", "replace"):
        error = seen[operation]
        assert error["type"] == "CheckpointStoreUnavailable", operation
        assert (error["cause"], error["cause_code"]) == ("OperationalError", code)
    assert seen["a"] == {"step": 1, "revision": 0}  # neither taken nor replaced
    assert seen["b"] is None  # not saved
    assert seen["retry"] is None  # the store works again once the disk does


@pytest.mark.parametrize("scenario", ["resources-eio", "resources-readonly"])
def test_resource_writes_that_fail_are_typed_and_keep_the_old_value(
    tmp_path: Path, scenario: str
) -> None:
    seen = run_faulted(scenario, tmp_path)
    for operation in ("put", "delete"):
        assert seen[operation]["type"] == "ResourceBindingUnavailable", operation
        assert seen[operation]["cause"] == "OperationalError"
    assert seen["value"] == {"v": 1}
    assert seen["retry"] is None


def test_a_read_only_file_system_at_open_is_typed(tmp_path: Path) -> None:
    seen = run_faulted("runtime-open-readonly", tmp_path)
    assert seen["checkpoints"]["type"] == "CheckpointStoreUnavailable"
    assert seen["resources"]["type"] == "ResourceBindingUnavailable"
    assert all(seen[k]["cause"] == "OSError" for k in ("checkpoints", "resources"))


def _locked(path: Path) -> sqlite3.Connection:
    """Another connection holding the file's write lock."""
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    return other


async def test_a_checkpoint_file_locked_past_the_timeout_is_typed(tmp_path: Path) -> None:
    path = tmp_path / "checkpoints.sqlite"
    async with SqliteCheckpointStore(path, timeout=0.2) as store:
        await store.save("a", {"revision": 0})
        other = _locked(path)
        try:
            for attempt in (
                store.save("b", {}),
                store.take("a"),
                store.replace("a", None, revision=0),
            ):
                with pytest.raises(CheckpointStoreUnavailable, match="stayed locked") as caught:
                    await attempt
                assert isinstance(caught.value.__cause__, sqlite3.OperationalError)
                assert caught.value.retryable
        finally:
            other.execute("ROLLBACK")
            other.close()
        assert await store.get("a") == {"revision": 0}
        assert await store.take("a") == {"revision": 0}  # usable again


async def test_a_resource_file_locked_past_the_timeout_is_typed(tmp_path: Path) -> None:
    path = tmp_path / "resources.sqlite"
    address = ResourceAddress("notes", "user", "u1")
    async with SqliteResourceBinding(path, timeout=0.2) as binding:
        await binding.put(address, "k", 1)
        other = _locked(path)
        try:
            with pytest.raises(ResourceBindingUnavailable, match="stayed locked") as caught:
                await binding.put(address, "k", 2)
            assert caught.value.retryable
        finally:
            other.execute("ROLLBACK")
            other.close()
        item = await binding.get(address, "k")
        assert item is not None
        assert item.value == 1
        await binding.put(address, "k", 3)

"""Export then import: equal on each store pair, idempotent, refusals that write nothing.

Real stores only: SQLite files in private tmp dirs, the PostgreSQL and Redis servers
of ``TOUBA_POSTGRES_DSN`` / ``TOUBA_REDIS_URL`` (skipped without them, failed under
``CI=true``).
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import stat
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

import touba
from tests.data._export_data import (
    Deployment,
    conversation,
    export_bytes,
    populate,
    records_of,
    save,
)
from touba.data import (
    ExportFileInvalid,
    ImportConflict,
    ImportLimitExceeded,
    ImportReport,
    Stores,
    export_records,
    import_records,
    write_export,
)
from touba.errors import ConfigurationError
from touba.history import HistoryConfig

PG = pytest.mark.postgres
REDIS = pytest.mark.redis
KINDS_OF_RECORDS = {
    "session": 1,
    "turn": 3,
    "key_event": 2,
    "key_event_change": 2,
    "extraction_job": 1,
    "conversation": 2,
    "checkpoint": 1,
    "resource": 3,
}


@pytest.fixture
async def deployments(tmp_path: Path) -> AsyncIterator[Callable[..., Deployment]]:
    made: list[Deployment] = []

    def make(memory: str = "sqlite", history: str = "sqlite", **limits: Any) -> Deployment:
        made.append(Deployment(memory, history, tmp_path, limits=limits))
        return made[-1]

    yield make
    for deployment in made:
        await deployment.close()


async def nothing_in(deployment: Deployment) -> None:
    """The deployment holds no record at all."""
    assert await deployment.memory.list_sessions() == []
    assert await deployment.memory.query_all_events(include_closed=True) == []
    assert await deployment.memory.list_jobs() == []
    assert await deployment.history.list(purge=False) == []
    assert await deployment.stores.checkpoints.list() == []  # type: ignore[union-attr]
    resources: Any = deployment.stores.resources
    assert await resources.scope_items("session", "s1") == []


PAIRS = [
    pytest.param(("sqlite", "sqlite"), ("sqlite", "sqlite"), id="sqlite->sqlite"),
    pytest.param(("sqlite", "sqlite"), ("postgres", "postgres"), id="sqlite->pg", marks=PG),
    pytest.param(("postgres", "postgres"), ("sqlite", "sqlite"), id="pg->sqlite", marks=PG),
    pytest.param(("sqlite", "sqlite"), ("sqlite", "redis"), id="sqlite->redis", marks=REDIS),
    pytest.param(
        ("postgres", "redis"), ("postgres", "sqlite"), id="redis->sqlite", marks=[PG, REDIS]
    ),
]


@pytest.mark.parametrize(("source", "target"), PAIRS)
async def test_a_session_exported_then_imported_is_equal_on_each_store_pair(
    deployments: Callable[..., Deployment], source: tuple[str, str], target: tuple[str, str]
) -> None:
    origin, destination = deployments(*source), deployments(*target)
    await populate(origin)
    exported = await export_bytes(origin.stores, session="s1")

    report = await import_records(destination.stores, io.BytesIO(exported))

    assert report == ImportReport(added=KINDS_OF_RECORDS, present={})
    again = await export_bytes(destination.stores, session="s1")
    assert records_of(again) == records_of(exported)
    # what the stores answer is equal too, not only the file
    assert await destination.memory.get_session("s1") == await origin.memory.get_session("s1")
    events = await origin.memory.query_events("session:s1", include_closed=True)
    copied = await destination.memory.query_events("session:s1", include_closed=True)
    assert [e.id for e in copied] == [e.id for e in events]  # the order kept
    for event in events:
        assert await destination.memory.get_event(event.owner, event.id) == (
            await origin.memory.get_event(event.owner, event.id)
        )
    for n in range(2):
        key = f"app:s1:{n}"
        assert await destination.history.read(key) == await origin.history.read(key)
    # the other session was not exported
    assert await destination.memory.get_session("s2") is None


async def test_the_file_holds_the_header_every_kind_and_the_end_line(
    deployments: Callable[..., Deployment],
) -> None:
    origin = deployments()
    await populate(origin)
    lines = [
        json.loads(line) for line in (await export_bytes(origin.stores, session="s1")).splitlines()
    ]

    header, *records, end = lines
    assert header["format"] == "touba-export"
    assert header["version"] == 1
    assert header["selection"] == {"session": "s1"}

    assert header["touba"] == touba.__version__
    assert end == {"kind": "end", "records": len(records)}
    kinds: dict[str, int] = {}
    for record in records:
        kinds[record["kind"]] = kinds.get(record["kind"], 0) + 1
    assert kinds == KINDS_OF_RECORDS
    assert all("s2" not in json.dumps(r) for r in records)  # nothing of the other session


async def test_importing_twice_changes_nothing(deployments: Callable[..., Deployment]) -> None:
    origin, target = deployments(), deployments()
    await populate(origin)
    exported = await export_bytes(origin.stores, session="s1")
    await import_records(target.stores, exported.splitlines(keepends=True))
    before = await export_bytes(target.stores, session="s1")
    usage = await target.history.usage()

    report = await import_records(target.stores, exported.splitlines(keepends=True))

    assert report.added == {}
    assert report.present == KINDS_OF_RECORDS
    assert report.total_present == sum(KINDS_OF_RECORDS.values())
    assert records_of(await export_bytes(target.stores, session="s1")) == records_of(before)
    assert await target.history.usage() == usage
    # into its own source, too: everything is already there
    report = await import_records(origin.stores, exported.splitlines())
    assert report.total_added == 0


async def test_an_import_completes_what_an_earlier_one_did_not_add(
    deployments: Callable[..., Deployment],
) -> None:
    origin, target = deployments(), deployments()
    await populate(origin)
    exported = (await export_bytes(origin.stores, session="s1")).splitlines()
    without_conversations = [line for line in exported[1:-1] if b'"conversation"' not in line]
    partial = [
        exported[0],
        *without_conversations,
        json.dumps({"kind": "end", "records": len(without_conversations)}).encode(),
    ]
    first = await import_records(target.stores, partial)
    assert "conversation" not in first.added

    second = await import_records(target.stores, exported)

    assert second.added == {"conversation": 2}
    assert second.total_present == first.total_added


def damaged(lines: list[bytes], number: int, text: bytes) -> list[bytes]:
    changed = list(lines)
    changed[number - 1] = text
    return changed


@pytest.mark.parametrize(
    ("change", "line", "words"),
    [
        pytest.param(lambda ls: damaged(ls, 3, ls[2][:-5]), 3, "not JSON", id="cut-line"),
        pytest.param(
            lambda ls: damaged(ls, 4, b'{"kind": "spaceship"}'),
            4,
            "does not know",
            id="unknown-kind",
        ),
        pytest.param(
            lambda ls: damaged(ls, 1, ls[0].replace(b'"version":1', b'"version":2')),
            1,
            "version 2",
            id="newer-version",
        ),
        pytest.param(lambda ls: ls[:-1], 17, "without its end line", id="no-end-line"),
        pytest.param(lambda ls: ls[:7], 8, "without its end line", id="truncated"),
        pytest.param(lambda ls: [*ls[:5], *ls[6:]], 16, "counts 15", id="a-line-lost"),
        pytest.param(lambda ls: [*ls, ls[-1]], 18, "follows the end line", id="after-end"),
        pytest.param(
            lambda ls: damaged(ls, 2, ls[1].replace(b'"mode":"live"', b'"mode":"other"')),
            2,
            "mode",
            id="bad-field",
        ),
        pytest.param(
            lambda ls: damaged(ls, 1, b'{"hello": 1}'),
            1,
            "not a touba export header",
            id="not-export",
        ),
        pytest.param(
            lambda ls: [*ls[:6], ls[7], ls[6], *ls[8:]],
            7,
            "must follow its key_event",
            id="change-out-of-order",
        ),
    ],
)
async def test_a_damaged_file_is_refused_with_its_line_number_and_nothing_written(
    deployments: Callable[..., Deployment],
    change: Callable[[list[bytes]], list[bytes]],
    line: int,
    words: str,
) -> None:
    origin, target = deployments(), deployments()
    await populate(origin)
    lines = (await export_bytes(origin.stores, session="s1")).splitlines()
    assert len(lines) == 17  # header, 15 records, end

    with pytest.raises(ExportFileInvalid) as refused:
        await import_records(target.stores, change(lines))

    assert refused.value.line == line
    assert words in str(refused.value)
    assert "question" not in str(refused.value)  # no content echoed
    await nothing_in(target)


async def test_an_empty_file_is_refused(deployments: Callable[..., Deployment]) -> None:
    target = deployments()
    with pytest.raises(ExportFileInvalid) as refused:
        await import_records(target.stores, [])
    assert refused.value.line == 1


async def test_a_record_present_with_other_content_is_a_conflict_and_nothing_is_written(
    deployments: Callable[..., Deployment],
) -> None:
    origin, target = deployments(), deployments()
    await populate(origin)
    exported = await export_bytes(origin.stores, session="s1")
    # the target holds conversation app:s1:1 with other content, and nothing else
    await save(target.history, "app:s1:1", conversation("s1", "i1", messages=2))
    before = await target.history.read("app:s1:1")

    with pytest.raises(ImportConflict) as refused:
        await import_records(target.stores, exported.splitlines())

    assert (refused.value.kind, refused.value.record) == ("conversation", "app:s1:1")
    assert refused.value.line == 12
    assert await target.history.read("app:s1:1") == before
    assert await target.memory.list_sessions() == []
    assert [row.key for row in await target.history.list()] == ["app:s1:1"]


async def test_a_session_of_another_owner_is_a_conflict(
    deployments: Callable[..., Deployment],
) -> None:
    origin, target = deployments(), deployments()
    await populate(origin)
    await target.memory.open_session("s1", owner="someone-else", agent_ref="support", mode="live")

    with pytest.raises(ImportConflict) as refused:
        await import_records(
            target.stores, (await export_bytes(origin.stores, session="s1")).splitlines()
        )

    assert (refused.value.kind, refused.value.record, refused.value.line) == ("session", "s1", 2)
    assert await target.memory.list_turns("s1") == ()


async def test_a_conversation_over_max_retained_bytes_is_refused_not_cut(
    deployments: Callable[..., Deployment],
) -> None:
    origin, target = deployments(), deployments()
    await save(origin.history, "big", conversation("r", "i", messages=10, size=1000))
    await save(origin.history, "small", conversation("r", "j", messages=2, size=10))
    exported = await export_bytes(origin.stores, namespace="app")
    bounds = HistoryConfig(max_retained_bytes=5000)

    with pytest.raises(ImportLimitExceeded) as refused:
        await import_records(target.stores, exported.splitlines(), history_config=bounds)

    assert refused.value.limit == "max_retained_bytes"
    assert await target.history.list() == []
    # within the defaults, the same file is imported whole
    report = await import_records(target.stores, exported.splitlines())
    assert report.added == {"conversation": 2}
    assert await target.history.read("big") == await origin.history.read("big")


async def test_an_exchange_over_max_messages_is_refused(
    deployments: Callable[..., Deployment],
) -> None:
    origin, target = deployments(), deployments()
    await save(origin.history, "k", conversation("r", "i", messages=4))
    exported = await export_bytes(origin.stores, conversation="k")

    with pytest.raises(ImportLimitExceeded) as refused:
        await import_records(
            target.stores,
            exported.splitlines(),
            history_config=HistoryConfig(max_messages=1, max_bytes=100, max_retained_bytes=1000),
        )

    assert (refused.value.limit, refused.value.line) == ("max_messages", 2)
    assert await target.history.list() == []


async def test_more_conversations_than_the_store_holds_are_refused(
    deployments: Callable[..., Deployment],
) -> None:
    origin, target = deployments(), deployments(max_sessions=2)
    await save(target.history, "there", conversation("x", "x"))
    for n in range(2):
        await save(origin.history, f"k{n}", conversation("r", f"i{n}"))

    with pytest.raises(ImportLimitExceeded) as refused:
        await import_records(
            target.stores, (await export_bytes(origin.stores, namespace="app")).splitlines()
        )

    assert refused.value.limit == "max_sessions"
    assert [row.key for row in await target.history.list()] == ["there"]


async def test_a_key_event_title_over_its_limit_is_refused(
    deployments: Callable[..., Deployment],
) -> None:
    origin, target = deployments(), deployments()
    await populate(origin)
    exported = await export_bytes(origin.stores, session="s1")

    with pytest.raises(ImportLimitExceeded) as refused:
        await import_records(target.stores, exported.splitlines(), max_title_chars=3)

    assert refused.value.limit == "max_title_chars"
    await nothing_in(target)


async def test_a_record_without_its_store_is_refused(
    deployments: Callable[..., Deployment],
) -> None:
    origin, target = deployments(), deployments()
    await populate(origin)
    exported = await export_bytes(origin.stores, session="s1")

    with pytest.raises(ConfigurationError, match="give a history store"):
        await import_records(Stores(memory=target.memory), exported.splitlines())

    assert await target.memory.list_sessions() == []


async def test_conversation_and_namespace_selections(
    deployments: Callable[..., Deployment],
) -> None:
    origin = deployments()
    await populate(origin)
    await save(
        origin.history,
        "elsewhere",
        conversation("r", "i")
        | {"identity": {**conversation("r", "i")["identity"], "namespace": "other"}},
    )

    one = [
        json.loads(line)
        for line in records_of(await export_bytes(origin.stores, conversation="app:s2:1"))
    ]
    spaced = [
        json.loads(line) for line in records_of(await export_bytes(origin.stores, namespace="app"))
    ]

    assert [r.get("key") for r in one] == ["app:s2:1", None]
    assert one[0]["record"] == await origin.history.read("app:s2:1")
    assert sorted(r["key"] for r in spaced[:-1]) == ["app:s1:0", "app:s1:1", "app:s2:0", "app:s2:1"]
    missing = records_of(await export_bytes(origin.stores, conversation="nope"))
    assert [json.loads(line) for line in missing] == [{"kind": "end", "records": 0}]


@pytest.mark.parametrize(
    "selection",
    [{}, {"session": "a", "namespace": "b"}, {"session": ""}, {"user": ""}],
)
async def test_one_selection_is_required(
    deployments: Callable[..., Deployment], selection: dict[str, str]
) -> None:
    origin = deployments()
    with pytest.raises(ConfigurationError):
        async for _ in export_records(origin.stores, **selection):
            pass


async def test_an_export_file_is_created_private(
    deployments: Callable[..., Deployment], tmp_path: Path
) -> None:
    origin = deployments()
    await populate(origin)
    path = tmp_path / "out.jsonl"

    count = await write_export(origin.stores, path, session="s1")

    assert count == sum(KINDS_OF_RECORDS.values())
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    with path.open("rb") as file:
        target = deployments()
        assert (await import_records(target.stores, file)).total_added == count


async def test_async_lines_are_imported(deployments: Callable[..., Deployment]) -> None:
    origin, target = deployments(), deployments()
    await populate(origin)
    exported = (await export_bytes(origin.stores, session="s1")).decode()

    async def lines() -> AsyncIterator[str]:
        for line in exported.splitlines():
            yield line

    assert (await import_records(target.stores, lines())).added == KINDS_OF_RECORDS


@pytest.mark.parametrize(
    "target_kinds",
    [
        pytest.param(("sqlite", "sqlite"), id="sqlite"),
        pytest.param(("postgres", "postgres"), id="pg", marks=PG),
    ],
)
async def test_a_user_is_exported_with_what_erase_would_find(
    deployments: Callable[..., Deployment], target_kinds: tuple[str, str]
) -> None:
    origin, target = deployments(), deployments(*target_kinds)
    memory = origin.memory
    for user, sid in (("u1", "a"), ("u1", "b"), ("u2", "c")):
        owner = f"user:{user}"
        await memory.open_session(sid, owner=owner, agent_ref="support", mode="live")
        await memory.append_turn(sid, user=f"hello from {user}", replies=["hi"])
        event = await memory.create_event(
            owner=owner, type="task", title=f"T {sid}", details="", session_id=sid
        )
        await memory.update_event(owner, event.id, {"status": "closed"}, session_id=sid)
        await save(origin.history, f"app:{sid}", conversation(sid, "i"))
        await origin.stores.checkpoints.save(f"cp-{sid}", {"run_id": sid})  # type: ignore[union-attr]

    exported = await export_bytes(origin.stores, user="u1")
    records = [json.loads(line) for line in records_of(exported)]

    assert json.loads(exported.splitlines()[0])["selection"] == {"user": "u1"}
    assert "u2" not in exported.decode()
    assert sorted(r["session_id"] for r in records if r["kind"] == "session") == ["a", "b"]
    assert sorted(r["key"] for r in records if r["kind"] == "conversation") == ["app:a", "app:b"]
    assert sorted(r["id"] for r in records if r["kind"] == "checkpoint") == ["cp-a", "cp-b"]
    report = await import_records(target.stores, exported.splitlines())
    assert report.added == {
        "session": 2,
        "turn": 2,
        "key_event": 2,
        "key_event_change": 2,
        "conversation": 2,
        "checkpoint": 2,
    }
    assert records_of(await export_bytes(target.stores, user="u1")) == records_of(exported)


async def test_a_key_event_id_of_another_owner_is_a_conflict_found_before_writing(
    deployments: Callable[..., Deployment],
) -> None:
    origin, target = deployments(), deployments()
    await populate(origin)
    exported = await export_bytes(origin.stores, session="s1")
    first = json.loads(exported.splitlines()[5])
    assert first["kind"] == "key_event"
    taken = dataclasses.replace(
        await origin.memory.get_event(first["owner"], first["id"]), owner="user:else", history=None
    )
    await target.memory.import_event(taken)

    with pytest.raises(ImportConflict) as refused:
        await import_records(target.stores, exported.splitlines())

    assert (refused.value.kind, refused.value.record, refused.value.line) == (
        "key_event",
        first["id"],
        6,
    )
    assert await target.memory.list_sessions() == []


async def test_a_wrong_selection_makes_no_file(
    deployments: Callable[..., Deployment], tmp_path: Path
) -> None:
    with pytest.raises(ConfigurationError):
        await write_export(deployments().stores, tmp_path / "x.jsonl", user="u", session="s")
    assert not (tmp_path / "x.jsonl").exists()

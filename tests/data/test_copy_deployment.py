"""copy_stores over a whole deployment: histories, memory store and checkpoints together."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from tests.data._export_data import Deployment, populate
from touba.data import CopyIssue, Stores, copy_stores, verify_copy
from touba.errors import ConfigurationError
from touba.runtime import MemoryResourceBinding

PG = pytest.mark.postgres
REDIS = pytest.mark.redis
EVERY_KIND = {
    "conversation": 4,
    "session": 2,
    "turn": 6,
    "key_event": 4,
    "key_event_change": 4,
    "extraction_job": 2,
    "checkpoint": 2,
}
PAIRS = [
    pytest.param(("sqlite", "sqlite"), ("sqlite", "sqlite"), id="sqlite->sqlite"),
    pytest.param(("sqlite", "sqlite"), ("postgres", "postgres"), id="sqlite->pg", marks=PG),
    pytest.param(("postgres", "postgres"), ("sqlite", "redis"), id="pg->redis", marks=[PG, REDIS]),
    pytest.param(("sqlite", "redis"), ("sqlite", "sqlite"), id="redis->sqlite", marks=REDIS),
]


@pytest.fixture
async def deployments(tmp_path: Path) -> AsyncIterator[Callable[..., Deployment]]:
    made: list[Deployment] = []

    def make(memory: str = "sqlite", history: str = "sqlite") -> Deployment:
        made.append(Deployment(memory, history, tmp_path))
        return made[-1]

    yield make
    for deployment in made:
        await deployment.close()


def copied(deployment: Deployment) -> Stores:
    """The deployment's stores a copy takes: all but its resource binding (not copied)."""
    return dataclasses.replace(deployment.stores, resources=None)


async def everything(deployment: Deployment) -> dict[str, Any]:
    """What the deployment answers, content included, for a comparison."""
    memory = deployment.memory
    sessions = await memory.list_sessions()
    events = await memory.query_all_events(include_closed=True)
    return {
        "sessions": sessions,
        "turns": [await memory.list_turns(s.session_id) for s in sessions],
        "events": [await memory.get_event(e.owner, e.id) for e in events],
        "jobs": await memory.list_jobs(),
        "histories": {
            row.key: await deployment.history.read(row.key)
            for row in await deployment.history.list()
        },
        "checkpoints": {
            info.checkpoint_id: await deployment.stores.checkpoints.get(info.checkpoint_id)  # type: ignore[union-attr]
            for info in await deployment.stores.checkpoints.list()  # type: ignore[union-attr]
        },
    }


@pytest.mark.parametrize(("source", "target"), PAIRS)
async def test_a_deployment_is_copied_whole_and_a_rerun_adds_nothing(
    deployments: Callable[..., Deployment], source: tuple[str, str], target: tuple[str, str]
) -> None:
    origin, destination = deployments(*source), deployments(*target)
    await populate(origin)

    report = await copy_stores(copied(origin), copied(destination))
    assert report.copied == EVERY_KIND
    assert report.issues == ()
    assert await everything(destination) == await everything(origin)
    verified = await verify_copy(copied(origin), copied(destination))
    assert verified.clean
    assert verified.counts == {kind: (n, n) for kind, n in EVERY_KIND.items()}
    assert verified.matched == sum(EVERY_KIND.values())

    again = await copy_stores(copied(origin), copied(destination))
    assert again.already == EVERY_KIND
    assert sum(again.copied.values()) == 0
    assert await everything(destination) == await everything(origin)


async def test_a_memory_conflict_is_reported_and_nothing_of_memory_written(
    deployments: Callable[..., Deployment],
) -> None:
    origin, destination = deployments(), deployments()
    await populate(origin)
    await destination.memory.open_session("s1", owner="someone-else", agent_ref="x", mode="live")

    report = await copy_stores(copied(origin), copied(destination))
    assert report.issues == (CopyIssue(0, "s1", "conflict", kind="session"),)
    assert report.copied == {"conversation": 4}  # the histories went first
    assert [s.owner for s in await destination.memory.list_sessions()] == ["someone-else"]
    assert await destination.memory.list_jobs() == []
    verified = await verify_copy(copied(origin), copied(destination))
    reasons = {(m.kind, m.key): m.reason for m in verified.mismatches}
    assert reasons[("session", "s1")] == "different"
    assert reasons[("session", "s2")] == "missing"
    assert ("conversation", "app:s1:0") not in reasons


async def test_a_record_missing_from_the_target_is_found_by_verify(
    deployments: Callable[..., Deployment],
) -> None:
    origin, destination = deployments(), deployments()
    await populate(origin)
    await copy_stores(copied(origin), copied(destination))
    await destination.memory.delete_session("s2")
    verified = await verify_copy(copied(origin), copied(destination))
    assert {(m.kind, m.key, m.reason) for m in verified.mismatches} == {
        ("session", "s2", "missing"),
        *(("turn", f"s2#{n}", "missing") for n in range(3)),
    }
    # and a rerun puts them back
    again = await copy_stores(copied(origin), copied(destination))
    assert again.copied["session"] == 1
    assert again.copied["turn"] == 3
    assert (await verify_copy(copied(origin), copied(destination))).clean


async def test_resources_and_half_given_stores_are_refused(
    deployments: Callable[..., Deployment],
) -> None:
    origin, destination = deployments(), deployments()
    with_resources = dataclasses.replace(copied(origin), resources=MemoryResourceBinding())
    with pytest.raises(ConfigurationError, match="resource values are not copied"):
        await copy_stores(with_resources, copied(destination))
    without_memory = dataclasses.replace(copied(destination), memory=None)
    with pytest.raises(ConfigurationError, match="memory store on both sides"):
        await copy_stores(copied(origin), without_memory)
    assert await destination.memory.list_sessions() == []
    empty = Stores(histories=destination.stores.histories)
    assert (await copy_stores(Stores(histories=origin.stores.histories), empty)).complete

"""Durable key-event extraction for kind="agent"/"flow" (SPEC section 9), on both stores."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import jsonschema
import pytest

from tests.memory.conftest import FakeClock, MakeStore
from touba.errors import (
    AgentDecisionProviderSchemaViolation,
    ConfigurationError,
    ExtractionLeaseLost,
    KeyEventInvalid,
)
from touba.memory import (
    CreateEventOp,
    ExtractionJob,
    ExtractionQueue,
    KeyEventsConfig,
    KeyEventService,
    UpdateEventOp,
    owner_for,
    parse_ops,
)
from touba.memory._extraction import Extractor, extraction_schema
from touba.memory._model import ExtractedOp
from touba.memory._sql import SqlMemoryStore

OWNER = owner_for("u-42", "s-1")
CONFIG = KeyEventsConfig(enabled=True, types=("refund", "account issue"))
OPS: tuple[ExtractedOp, ...] = (
    CreateEventOp("refund", "Refund order A1", "asked on the phone"),
    CreateEventOp("account issue", "Password reset", ""),
)


def queue_of(store: SqlMemoryStore, **options: Any) -> ExtractionQueue:
    return ExtractionQueue(store, **options)


async def enqueue(queue: ExtractionQueue, session_id: str = "s-1") -> ExtractionJob:
    return await queue.enqueue(session_id, OWNER, "support", f"{session_id}@turns:4")


def extractor(ops: Sequence[ExtractedOp], calls: list[str] | None = None) -> Extractor:
    async def extract(job: ExtractionJob) -> Sequence[ExtractedOp]:
        if calls is not None:
            calls.append(job.id)
        return ops

    return extract


async def test_enqueue_is_idempotent_per_session_end(store: SqlMemoryStore) -> None:
    queue = queue_of(store)
    first = await enqueue(queue)
    assert (await enqueue(queue)).id == first.id
    later_end = await queue.enqueue("s-1", OWNER, "support", "s-1@turns:9")
    assert later_end.id != first.id
    assert first.status == "pending"
    assert first.attempts == 0
    assert len(await queue.list()) == 2


async def test_a_queued_job_survives_a_store_reopen(make_store: MakeStore) -> None:
    first = make_store()
    job = await enqueue(queue_of(first))
    await first.close()
    reopened = queue_of(make_store())
    claimed = await reopened.claim("worker-b")
    assert claimed is not None
    assert claimed.id == job.id
    assert claimed.attempts == 1


async def test_a_crashed_workers_job_is_claimed_again_once_its_lease_expires(
    store: SqlMemoryStore, clock: FakeClock
) -> None:
    queue = queue_of(store, lease_seconds=60)
    job = await enqueue(queue)
    crashed = await queue.claim("worker-a")
    assert crashed is not None
    assert crashed.lease_owner == "worker-a"
    assert await queue.claim("worker-b") is None  # leased
    clock.advance(61)
    retried = await queue.claim("worker-b")
    assert retried is not None
    assert (retried.id, retried.attempts, retried.lease_owner) == (job.id, 2, "worker-b")
    assert crashed.lease_token is not None
    with pytest.raises(ExtractionLeaseLost) as lost:
        await queue.complete(job.id, {"created": []}, lease_token=crashed.lease_token)
    assert lost.value.job_id == job.id
    assert (await queue.get(job.id)).status == "running"  # type: ignore[union-attr]


async def test_failures_back_off_exponentially_then_end_failed_and_visible(
    store: SqlMemoryStore, clock: FakeClock
) -> None:
    queue = queue_of(store, max_attempts=3, base_delay_seconds=10)
    job = await enqueue(queue)
    service = KeyEventService(store, CONFIG)

    async def broken(job: ExtractionJob) -> Sequence[ExtractedOp]:
        raise TimeoutError("the model did not answer")

    for attempt, delay in ((1, 10), (2, 20)):
        claimed = await queue.claim("worker-a")
        assert claimed is not None
        assert claimed.attempts == attempt
        after = await queue.process(claimed, broken, service)
        assert after.status == "pending"
        assert after.next_attempt_at == clock.now + timedelta(seconds=delay)
        assert after.last_error == "TimeoutError"  # not its text: it is not touba's
        clock.advance(delay - 1)
        assert await queue.claim("worker-a") is None  # not due yet
        clock.advance(1)
    last = await queue.claim("worker-a")
    assert last is not None
    failed = await queue.process(last, broken, service)
    assert failed.status == "failed"
    assert failed.attempts == 3
    clock.advance(10_000)
    assert await queue.claim("worker-a") is None  # never retried silently...
    assert [j.id for j in await queue.list("failed")] == [job.id]  # ...and never lost
    again = await queue.requeue(job.id)
    assert (again.status, again.attempts) == ("pending", 0)
    with pytest.raises(ConfigurationError, match="only a failed job"):
        await queue.requeue(job.id)


async def test_a_worker_crashing_on_the_last_attempt_leaves_the_job_failed(
    store: SqlMemoryStore, clock: FakeClock
) -> None:
    queue = queue_of(store, max_attempts=1, lease_seconds=30)
    job = await enqueue(queue)
    assert await queue.claim("worker-a") is not None
    clock.advance(31)
    assert await queue.claim("worker-b") is None
    failed = await queue.get(job.id)
    assert failed is not None
    assert failed.status == "failed"
    assert failed.last_error is not None
    assert "lease expired" in failed.last_error


def test_the_backoff_doubles_and_is_capped(store: SqlMemoryStore) -> None:
    queue = ExtractionQueue(store, base_delay_seconds=30, max_delay_seconds=3600)
    assert [queue.backoff(n) for n in (1, 2, 3, 8, 500)] == [30, 60, 120, 3600, 3600]


async def test_processing_applies_the_ops_and_completes(store: SqlMemoryStore) -> None:
    queue = queue_of(store)
    service = KeyEventService(store, CONFIG)
    job = await enqueue(queue)
    claimed = await queue.claim("worker-a")
    assert claimed is not None
    bad = CreateEventOp("Refund", "wrong type", "")
    done = await queue.process(claimed, extractor((*OPS, bad)), service)
    assert done.status == "done"
    assert done.result["rejected"][0]["op"] == 2
    assert "did you mean 'refund'" in done.result["rejected"][0]["error"]
    events = await service.query(OWNER)
    assert sorted(e.title for e in events) == ["Password reset", "Refund order A1"]
    assert sorted(done.result["created"]) == sorted(e.id for e in events)
    assert all(e.session_id == job.session_id for e in events)


async def test_a_rerun_of_the_same_job_never_duplicates_an_event(
    store: SqlMemoryStore, clock: FakeClock
) -> None:
    """A worker applied the ops then crashed before completing: the job runs again."""
    queue = queue_of(store, lease_seconds=60)
    service = KeyEventService(store, CONFIG)
    existing = await service.create(OWNER, "refund", "Old refund", "", "s-0")
    await enqueue(queue)
    first = await queue.claim("worker-a")
    assert first is not None
    ops = (*OPS, UpdateEventOp(existing.id, status="in_progress"))
    await queue.apply(first, ops, service)  # ...and the worker dies here
    clock.advance(61)
    second = await queue.claim("worker-b")
    assert second is not None
    assert second.ops == ops  # recorded: the model is not asked again
    calls: list[str] = []
    other = (CreateEventOp("refund", "A different reading", ""),)
    done = await queue.process(second, extractor(other, calls), service)
    assert calls == []
    assert done.status == "done"
    titles = sorted(e.title for e in await service.query(OWNER))
    assert titles == ["Old refund", "Password reset", "Refund order A1"]
    history = (await service.get(OWNER, existing.id)).history
    assert history is not None
    assert len(history) == 1  # the update applied once
    assert history[0].session_id == "s-1"
    assert history[0].op_id == f"{second.id}:2"


async def test_applying_the_same_job_twice_returns_the_same_events(store: SqlMemoryStore) -> None:
    queue = queue_of(store)
    service = KeyEventService(store, CONFIG)
    await enqueue(queue)
    job = await queue.claim("worker-a")
    assert job is not None
    first = await queue.apply(job, OPS, service)
    second = await queue.apply(job, OPS[:1], service)  # the first recorded ops win
    assert first == second
    assert len(await service.query(OWNER)) == 2


async def test_too_many_ops_fail_the_attempt_instead_of_being_cut(store: SqlMemoryStore) -> None:
    queue = queue_of(store)
    await enqueue(queue)
    job = await queue.claim("worker-a")
    assert job is not None
    many = [CreateEventOp("refund", f"case {i}", "") for i in range(51)]
    after = await queue.process(job, extractor(many), KeyEventService(store, CONFIG))
    assert after.status == "pending"
    assert after.last_error is not None
    assert "at most 50" in after.last_error
    assert after.ops is None
    assert await KeyEventService(store, CONFIG).query(OWNER) == []


async def test_process_refuses_a_job_not_claimed(store: SqlMemoryStore) -> None:
    queue = queue_of(store)
    job = await enqueue(queue)
    with pytest.raises(ConfigurationError, match="claim"):
        await queue.process(job, extractor(OPS), KeyEventService(store, CONFIG))


def test_parse_ops_takes_the_models_plain_json() -> None:
    data = {
        "ops": [
            {"kind": "create", "type": "refund", "title": "Refund A1", "details": "x"},
            {"kind": "update", "event_id": "ke_1", "status": "closed", "title": None},
        ]
    }
    jsonschema.validate(data | {"ops": [data["ops"][0]]}, extraction_schema(["refund"]))
    assert parse_ops(data) == (
        CreateEventOp("refund", "Refund A1", "x"),
        UpdateEventOp("ke_1", status="closed"),
    )
    assert parse_ops([]) == ()
    for bad in ({"ops": "x"}, [{"kind": "delete"}], [{"kind": "create", "type": "refund"}], [3]):
        with pytest.raises(KeyEventInvalid):
            parse_ops(bad)
    with pytest.raises(KeyEventInvalid, match="at most 50"):
        parse_ops([{"kind": "update", "event_id": "x", "status": "open"}] * 51)


def test_queue_settings_are_checked(store: SqlMemoryStore) -> None:
    with pytest.raises(ConfigurationError):
        ExtractionQueue(store, max_attempts=0)
    with pytest.raises(ConfigurationError):
        ExtractionQueue(store, lease_seconds=-1)
    with pytest.raises(ConfigurationError):
        ExtractionQueue(object())  # type: ignore[arg-type]


def raising(error: Exception) -> Callable[[], Any]:
    def fail() -> Any:
        raise error

    return fail


@pytest.mark.parametrize(
    ("failure", "kept"),
    [
        (
            lambda: parse_ops([{"kind": "create", "titel": "SECRET model text"}]),
            "KeyEventInvalid: op 0 is not a create (kind, type, title, details) or an update "
            "(kind, event_id and any of status, title, details); its kind is create; its known "
            "fields: kind (string); and 1 other field",
        ),
        (
            lambda: parse_ops(["SECRET model text"]),
            "KeyEventInvalid: op 0 is not a create (kind, type, title, details) or an update "
            "(kind, event_id and any of status, title, details); it is a JSON string, not an "
            "object",
        ),
        (
            raising(
                AgentDecisionProviderSchemaViolation(
                    "SECRET model text", provider_error_code="output_schema_mismatch"
                )
            ),
            "AgentDecisionProviderSchemaViolation: provider_error_code=output_schema_mismatch",
        ),
        (raising(RuntimeError("SECRET server text")), "RuntimeError"),
    ],
    ids=["bad_op", "not_an_object", "schema_violation", "other"],
)
async def test_last_error_keeps_diagnostic_codes_and_field_names_only(
    store: SqlMemoryStore, failure: Any, kept: str
) -> None:
    queue = queue_of(store)
    await enqueue(queue)
    job = await queue.claim("worker-a")
    assert job is not None

    async def extract(job: ExtractionJob) -> Sequence[ExtractedOp]:
        return tuple(failure())

    after = await queue.process(job, extract, KeyEventService(store, CONFIG))
    assert after.status == "pending"
    assert after.last_error == kept
    assert "SECRET" not in (after.last_error or "")


async def test_a_job_done_after_a_failed_attempt_no_longer_shows_its_error(
    store: SqlMemoryStore, clock: FakeClock
) -> None:
    queue = queue_of(store, base_delay_seconds=1)
    job = await enqueue(queue)

    async def broken(job: ExtractionJob) -> Sequence[ExtractedOp]:
        raise TimeoutError

    first = await queue.claim("worker-a")
    assert first is not None
    failed = await queue.process(first, broken, KeyEventService(store, CONFIG))
    assert failed.last_error == "TimeoutError"
    clock.advance(1)
    second = await queue.claim("worker-a")
    assert second is not None
    done = await queue.process(second, extractor(OPS), KeyEventService(store, CONFIG))
    assert (done.status, done.last_error) == ("done", None)
    assert (await queue.get(job.id)).last_error is None  # type: ignore[union-attr]


HOSTILE = "SECRET-sk-live-4242"  # a name or value a model chose: content


@pytest.mark.parametrize(
    "answer",
    [
        {"ops": [{"kind": "create", HOSTILE: "x", "type": "refund"}]},  # a made-up field
        {"ops": [{HOSTILE: "create"}]},
        {"ops": [{"kind": HOSTILE}]},
        {"ops": [{"kind": "create", "type": 3, "title": [HOSTILE], "details": {HOSTILE: 1}}]},
        {"ops": [HOSTILE]},
    ],
    ids=["unknown_field", "only_unknown", "kind_value", "wrong_types", "not_an_object"],
)
async def test_last_error_never_names_a_field_or_value_the_model_chose(
    store: SqlMemoryStore, answer: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("DEBUG")
    queue = queue_of(store)
    await enqueue(queue)
    job = await queue.claim("worker-a")
    assert job is not None

    async def extract(job: ExtractionJob) -> Sequence[ExtractedOp]:
        return parse_ops(answer)

    after = await queue.process(job, extract, KeyEventService(store, CONFIG))
    assert after.status == "pending"
    assert after.last_error is not None
    assert after.last_error.startswith("KeyEventInvalid: op 0 is not a create")
    assert HOSTILE not in after.last_error
    assert HOSTILE not in repr(await queue.get(job.id))
    assert HOSTILE not in caplog.text


async def test_a_rejected_op_is_described_without_the_models_values(store: SqlMemoryStore) -> None:
    queue = queue_of(store)
    await enqueue(queue)
    job = await queue.claim("worker-a")
    assert job is not None
    ops = (
        CreateEventOp(HOSTILE, "Refund order A1", "asked"),  # a type nobody configured
        UpdateEventOp(HOSTILE, status="closed"),  # an id that does not exist
    )
    after = await queue.process(job, extractor(ops), KeyEventService(store, CONFIG))
    assert after.status == "done"
    assert after.result is not None
    rejected = after.result["rejected"]
    assert [r["op"] for r in rejected] == [0, 1]
    text = json.dumps(after.result)
    assert "is not a configured key-event type" in text
    assert "no key event with the event_id given" in text
    assert HOSTILE not in text

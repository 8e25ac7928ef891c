"""Durable background extraction of key events (SPEC section 9, ``kind="agent"``/``"flow"``).

When a session of an Agent or FlowAgent ends, :meth:`ExtractionQueue.enqueue`
records a job (once per session end). A worker claims it with a lease, asks
the model for key-event operations (not here: ``extract`` is given), and
applies them. Nothing is lost on a crash:

- a worker that dies holding a lease leaves the job ``running``; once the
  lease expires another worker claims it again;
- a failure is retried with exponential backoff, up to ``max_attempts``; the
  job then ends ``failed``, listed with its last error until requeued. The
  error is kept as diagnostic codes and field names (:func:`describe_error`),
  never the model's output; a job that ends ``done`` keeps no error;
- the extracted ops are recorded on the job before they are applied, and each
  one is applied under the op id ``<job id>:<index>`` stored with the event or
  update it made: a rerun applies the same ops and never duplicates an event.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any, Final

from touba.errors import ConfigurationError, ExtractionLeaseLost, KeyEventInvalid, ToubaError
from touba.history._model import JSON
from touba.memory._key_events import KeyEventService
from touba.memory._model import (
    KEY_EVENT_STATUSES,
    CreateEventOp,
    ExtractedOp,
    ExtractionJob,
    JobStatus,
    UpdateEventOp,
    op_from_dict,
)
from touba.memory._store import MemoryStore

__all__ = [
    "MAX_OPS",
    "ExtractionQueue",
    "Extractor",
    "describe_error",
    "extraction_schema",
    "op_id",
    "parse_ops",
]

logger = logging.getLogger("touba.memory")

MAX_OPS: Final = 50
Extractor = Callable[[ExtractionJob], Awaitable[Sequence[ExtractedOp]]]


def op_id(job_id: str, index: int) -> str:
    """The deterministic id of a job's ``index``-th op, stored with what it wrote."""
    return f"{job_id}:{index}"


def parse_ops(data: Any) -> tuple[ExtractedOp, ...]:
    """Ops from the model's plain JSON: ``{"ops": [...]}`` or a list of
    ``{"kind": "create", "type", "title", "details"}`` and
    ``{"kind": "update", "event_id", "status"?, "title"?, "details"?}``.

    Only the shape is checked here; types, statuses and lengths are checked by
    ``KeyEventService`` when each op is applied. Raises ``KeyEventInvalid``.
    """
    items = data.get("ops") if isinstance(data, Mapping) else data
    if not isinstance(items, list):
        raise KeyEventInvalid('the extraction result must be {"ops": [...]}', parameter="ops")
    if len(items) > MAX_OPS:
        raise KeyEventInvalid(f"at most {MAX_OPS} ops per session, got {len(items)}")
    ops: list[ExtractedOp] = []
    for index, item in enumerate(items):
        if isinstance(item, Mapping):
            item = {k: v for k, v in item.items() if v is not None}
            try:
                ops.append(op_from_dict(item))
                continue
            except (ValueError, TypeError):
                pass
        raise KeyEventInvalid(
            f"op {index} is not a create (kind, type, title, details) or an update (kind, "
            f"event_id and any of status, title, details); {_fields(item)}",
            parameter="ops",
        )
    return tuple(ops)


_KNOWN_FIELDS: Final = ("kind", "type", "title", "details", "event_id", "status")


def _fields(item: object) -> str:
    """What an op held, by touba's own field names and the JSON types of their values
    only: never a value, nor the name of a field touba does not know (a name the model
    chose is content, as its values are)."""
    if not isinstance(item, Mapping):
        return f"it is a JSON {_json_kind(item)}, not an object"
    kind = item.get("kind")
    if "kind" not in item:
        said = "it has no kind"
    elif kind in ("create", "update"):
        said = f"its kind is {kind}"
    else:
        said = f"its kind is a {_json_kind(kind)} other than create or update"
    known = [f"{name} ({_json_kind(item[name])})" for name in _KNOWN_FIELDS if name in item]
    unknown = sum(1 for name in item if name not in _KNOWN_FIELDS)
    held = f"; its known fields: {', '.join(known) if known else 'none'}"
    others = f"; and {unknown} other field{'s' if unknown != 1 else ''}" if unknown else ""
    return said + held + others


def _json_kind(value: object) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    return {str: "string", list: "array", type(None): "null"}.get(type(value), "value")


def describe_error(error: BaseException) -> str:
    """A failed attempt as ``last_error``: diagnostic codes, touba's own field names,
    positions and JSON types only.

    A touba error gives its code, its ``provider_error_code`` or its
    parameter, and its message (touba's own words, which never quote the
    model's output); any other exception only its type, since its text is not
    touba's and may quote anything (a server's answer, the model's output).
    """
    if not isinstance(error, ToubaError):
        return type(error).__name__
    code = getattr(error, "provider_error_code", None)
    if code:
        return f"{error.code}: provider_error_code={code}"
    return f"{error.code}: {error.message}"


def extraction_schema(types: Sequence[str]) -> dict[str, Any]:
    """A JSON Schema for the model's extraction output, accepted by :func:`parse_ops`."""
    text = {"type": "string"}
    create = {
        "type": "object",
        "properties": {
            "kind": {"const": "create"},
            "type": {"type": "string", "enum": list(types)},
            "title": text,
            "details": text,
        },
        "required": ["kind", "type", "title", "details"],
    }
    update = {
        "type": "object",
        "properties": {
            "kind": {"const": "update"},
            "event_id": text,
            "status": {"type": "string", "enum": list(KEY_EVENT_STATUSES)},
            "title": text,
            "details": text,
        },
        "required": ["kind", "event_id"],
    }
    items = {"anyOf": [create, update]}
    return {
        "type": "object",
        "properties": {"ops": {"type": "array", "items": items, "maxItems": MAX_OPS}},
        "required": ["ops"],
    }


def _positive(name: str, value: object, *, integer: bool = False) -> None:
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not value > 0:
        raise ConfigurationError(f"{name} must be a positive number, got {value!r}")


class ExtractionQueue:
    """The durable queue of extraction jobs in a ``MemoryStore``.

    Retries wait ``base_delay_seconds * 2 ** (attempts - 1)``, at most
    ``max_delay_seconds``; after ``max_attempts`` attempts a job is ``failed``.
    """

    def __init__(
        self,
        store: MemoryStore,
        *,
        max_attempts: int = 5,
        base_delay_seconds: float = 30.0,
        max_delay_seconds: float = 3600.0,
        lease_seconds: float = 300.0,
    ) -> None:
        if not isinstance(store, MemoryStore):
            raise ConfigurationError("store must be a touba.memory MemoryStore")
        _positive("max_attempts", max_attempts, integer=True)
        _positive("base_delay_seconds", base_delay_seconds)
        _positive("max_delay_seconds", max_delay_seconds)
        _positive("lease_seconds", lease_seconds)
        self.store = store
        self.max_attempts = max_attempts
        self.base_delay_seconds = float(base_delay_seconds)
        self.max_delay_seconds = float(max_delay_seconds)
        self.lease_seconds = float(lease_seconds)

    def backoff(self, attempts: int) -> float:
        """Seconds to wait after the ``attempts``-th failed attempt."""
        exponent = min(max(attempts - 1, 0), 62)
        return min(self.base_delay_seconds * 2.0**exponent, self.max_delay_seconds)

    async def enqueue(
        self, session_id: str, owner: str, agent_ref: str, transcript_ref: str
    ) -> ExtractionJob:
        """Queue the extraction of one ended session; the same end queued again is the
        same job (``transcript_ref`` names what ended, e.g. ``"<session_id>@<turns>"``)."""
        for name, value in (
            ("session_id", session_id),
            ("owner", owner),
            ("agent_ref", agent_ref),
            ("transcript_ref", transcript_ref),
        ):
            if not isinstance(value, str) or not value:
                raise ConfigurationError(f"{name} must be a non-empty str, got {value!r}")
        job, _created = await self.store.enqueue_job(
            session_id=session_id,
            owner=owner,
            agent_ref=agent_ref,
            transcript_ref=transcript_ref,
            max_attempts=self.max_attempts,
        )
        return job

    async def claim(
        self, worker_id: str, lease_seconds: float | None = None, *, job_id: str | None = None
    ) -> ExtractionJob | None:
        """Lease the next due job (or one whose worker's lease expired), or None.

        ``job_id`` claims that job only (a session running its own extraction).
        """
        if not isinstance(worker_id, str) or not worker_id:
            raise ConfigurationError(f"worker_id must be a non-empty str, got {worker_id!r}")
        if job_id is not None and (not isinstance(job_id, str) or not job_id):
            raise ConfigurationError(f"job_id must be a non-empty str or None, got {job_id!r}")
        lease = self.lease_seconds if lease_seconds is None else lease_seconds
        _positive("lease_seconds", lease)
        return await self.store.claim_job(worker_id, lease, job_id=job_id)

    async def apply(
        self, job: ExtractionJob, ops: Sequence[ExtractedOp], service: KeyEventService
    ) -> dict[str, JSON]:
        """Record ``ops`` on the job (the first recorded ops win), then apply them, each
        under its op id; an op the service rejects is reported, not retried."""
        token = _lease(job)
        if len(ops) > MAX_OPS:
            raise KeyEventInvalid(f"at most {MAX_OPS} ops per session, got {len(ops)}")
        recorded = await self.store.record_job_ops(job.id, token, tuple(ops))
        created: list[str] = []
        updated: list[str] = []
        rejected: list[dict[str, JSON]] = []
        for index, op in enumerate(recorded):
            oid = op_id(job.id, index)
            try:
                if isinstance(op, CreateEventOp):
                    event = await service.create(
                        job.owner, op.type, op.title, op.details, job.session_id, op_id=oid
                    )
                    created.append(event.id)
                else:
                    assert isinstance(op, UpdateEventOp)
                    event = await service.update(
                        job.owner,
                        op.event_id,
                        status=op.status,
                        title=op.title,
                        details=op.details,
                        session_id=job.session_id,
                        op_id=oid,
                    )
                    updated.append(event.id)
            except KeyEventInvalid as e:
                rejected.append({"op": index, "error": e.message})
        return {"created": created, "updated": updated, "rejected": rejected}

    async def complete(self, job_id: str, result: JSON, *, lease_token: str) -> ExtractionJob:
        """Mark a leased job done; ``ExtractionLeaseLost`` if the lease was taken over."""
        return await self.store.complete_job(job_id, lease_token, result)

    async def fail(
        self,
        job_id: str,
        error: str,
        retry_at: datetime | None = None,
        *,
        lease_token: str,
    ) -> ExtractionJob:
        """Record a failed attempt: retried at ``retry_at`` (default: the backoff), or
        ``failed`` for good once ``max_attempts`` attempts were made.
        ``ExtractionLeaseLost`` if the lease was taken over; ``ConfigurationError`` for a
        naive ``retry_at``."""
        if retry_at is None:
            job = await self.store.get_job(job_id)
            attempts = job.attempts if job is not None else 1
            retry_at = self.store.now() + timedelta(seconds=self.backoff(attempts))
        elif retry_at.tzinfo is None:
            raise ConfigurationError("retry_at must be a timezone-aware datetime")
        failed = await self.store.fail_job(job_id, lease_token, str(error), retry_at)
        if failed.status == "failed":  # the error text stays in the job: it may quote content
            logger.warning(
                "extraction job %s failed for good after %d attempt(s)", job_id, failed.attempts
            )
        else:
            logger.info(
                "extraction job %s: attempt %d failed, retried later", job_id, failed.attempts
            )
        return failed

    async def process(
        self, job: ExtractionJob, extract: Extractor, service: KeyEventService
    ) -> ExtractionJob:
        """Run one claimed job to its next state: done, pending again, or failed.

        ``extract(job)`` asks the model for the ops; it is skipped when an earlier
        attempt already recorded them. ``ExtractionLeaseLost`` propagates (another
        worker owns the job now); any other error is a failed attempt.
        """
        token = _lease(job)
        try:
            ops = job.ops if job.ops is not None else tuple(await extract(job))
            result = await self.apply(job, ops, service)
        except ExtractionLeaseLost:
            raise
        except Exception as e:
            return await self.fail(job.id, describe_error(e), lease_token=token)
        return await self.complete(job.id, result, lease_token=token)

    async def requeue(self, job_id: str) -> ExtractionJob:
        """Give a ``failed`` job a fresh set of attempts (after fixing its cause);
        ``ConfigurationError`` for an unknown job or one that is not ``failed``."""
        return await self.store.requeue_job(job_id)

    async def get(self, job_id: str) -> ExtractionJob | None:
        """The job as stored, or None when there is none of that id (``MemoryStore.get_job``)."""
        return await self.store.get_job(job_id)

    async def list(self, status: JobStatus | None = None, limit: int = 100) -> list[ExtractionJob]:
        """At most ``limit`` jobs, most recently changed first, of ``status`` when given
        (``MemoryStore.list_jobs``)."""
        return await self.store.list_jobs(status=status, limit=limit)


def _lease(job: ExtractionJob) -> str:
    if job.status != "running" or job.lease_token is None:
        raise ConfigurationError(f"job {job.id} is {job.status}: process only a job from claim()")
    return job.lease_token

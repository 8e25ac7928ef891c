"""A repair written under the reservation protocol of the durable stores.

:func:`write_repair` is what ``repair(plan)`` of the SQLite, PostgreSQL and Redis
stores runs over their backend's primitives: reserve the conversation (an
actively reserved one is refused with ``DecisionHistoryBusy``, nothing read
with the reservation), read it again as stored (the store's ``read_raw``,
which nothing can change while it is reserved), refuse with
``DecisionHistoryBusy`` when it is not exactly what the plan was computed from
(a decision ran since the check: check again), then save the repaired record
whole (``Write.rewrite``: the rows are replaced in the save's one transaction or
script) and release. Any failure releases the reservation and keeps the stored
conversation as it was, as ``transact`` does.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from touba.errors import DecisionHistoryBusy
from touba.history._backend import Read
from touba.history._common import Reservation
from touba.history._repair import RawConversation, RepairPlan
from touba.history._reservations import Reservations
from touba.history._write_plan import whole

__all__ = ["changed_since", "write_repair"]

ReadRaw = Callable[[str], Awaitable[RawConversation | None]]


def changed_since(key: str) -> DecisionHistoryBusy:
    """The conversation is no longer what the plan was computed from."""
    return DecisionHistoryBusy(
        f"conversation {key} changed since it was checked (a decision ran, or it expired); "
        f"nothing was written. Run `touba history check {key}` again and repair what it finds",
        session_key=key,
    )


async def write_repair(reservations: Reservations, read_raw: ReadRaw, plan: RepairPlan) -> bool:
    """Write ``plan`` (see the module docstring); False when it changes nothing."""
    if plan.record is None:
        return False
    key = plan.key
    backend = reservations.backend
    reservation = Reservation.new(reservations.worker_id)
    token = reservation.token
    reservations.cache.drop(key)
    reserved = await backend.reserve(key, reservation, Read())
    try:
        current = await read_raw(key)
        if reserved.head is None or current is None or not current.same_as(plan.original):
            raise changed_since(key)
        await backend.save(key, token, whole(plan.record, reserved))
    except BaseException as e:
        replacement = await reservations._fail(e, key, token)
        if replacement is None:
            raise
        raise replacement from e.__cause__
    reservations.cache.drop(key)
    return True

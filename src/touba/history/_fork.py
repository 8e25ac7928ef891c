"""What a fork of a decision history keeps, as pure functions over a stored record.

:meth:`touba.history.DecisionHistory.fork` reads the original conversation whole
(one consistent read, never a reservation, so nothing is written to it), hands
it to :func:`plan_fork`, and saves the plan as a new conversation. The rules:

- **Whole exchanges only.** An exchange is a decision and the result of every
  call it made (or a data message alone). The copy holds exchanges ``0 .. k-1``
  and never ends between a call and its result: ``k`` must be an int from 1 to
  the number of complete exchanges; the last stored exchange, while its calls
  await results (the head's ``pending``), is not complete. Anything else is a
  ``ConfigurationError`` naming the exchanges a fork may end on.
- **Checked as the pre-send check does.** The kept exchanges go through
  :func:`~touba.history._integrity.check_window`, the check each decision runs
  before a provider request: a damaged original (a result without its call, a
  missing result) is refused with ``DecisionHistoryRecordInvalid``, never copied.
- **A new head.** The copy's head is a fresh one for the new identity (created
  now, no plot: the original's figures describe its own decisions), with the
  kept exchanges' stats and no pending call. The original's summary is kept only
  when its fingerprint covers kept exchanges alone (``through <= k``); a summary
  of exchanges the copy does not hold is dropped.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from touba.errors import ConfigurationError, DecisionHistoryRecordInvalid
from touba.history._identity import IDENTITY_FIELDS, ConversationIdentity
from touba.history._integrity import check_window
from touba.history._model import canonical_json, message_from_dict
from touba.history._record import RECORD_KIND, check_head, new_head, split_record

__all__ = ["ForkPlan", "check_original", "fork_appends", "plan_fork"]

Record = dict[str, Any]


@dataclass(frozen=True, slots=True)
class ForkPlan:
    """The new conversation: its head, its exchanges and each message's compact JSON
    (as stores keep it), in order."""

    head: Record
    exchanges: list[list[Record]]
    bodies: list[str]

    @property
    def retained_bytes(self) -> int:
        """What the copy retains, by SPEC section 3's measure (its messages' bytes)."""
        stats: Mapping[str, int] = self.head["stats"]
        return stats["bytes"]


def check_original(key: str, record: Mapping[str, Any]) -> ConversationIdentity:
    """The identity of a stored decision history record, checked as a decision checks
    its head (:func:`~touba.history._record.check_head`); ``DecisionHistoryRecordInvalid``
    for anything else (another kind of record, a damaged head)."""
    exchanges = record.get("exchanges")
    if record.get("kind") != RECORD_KIND or not isinstance(exchanges, list):
        raise DecisionHistoryRecordInvalid(
            f"the stored value of conversation {key} is not a touba decision history "
            "record; nothing was copied"
        )
    head, _ = split_record(record)
    identity = _stored_identity(key, head)
    check_head(head, identity, exchange_count=len(exchanges))
    return identity


def _stored_identity(key: str, head: Mapping[str, Any]) -> ConversationIdentity:
    """The identity a stored head names; ``DecisionHistoryRecordInvalid`` when it
    names none."""
    stored = head.get("identity")
    try:
        if not isinstance(stored, Mapping) or set(stored) != set(IDENTITY_FIELDS):
            raise ConfigurationError("identity fields missing")
        return ConversationIdentity(**{name: stored[name] for name in IDENTITY_FIELDS})
    except ConfigurationError as e:
        raise DecisionHistoryRecordInvalid(
            f"the stored record of conversation {key} names no valid identity; it was not "
            f"modified. Inspect it with `touba history show {key}`"
        ) from e


def plan_fork(
    key: str,
    record: Mapping[str, Any],
    identity: ConversationIdentity,
    at_exchange: object,
) -> ForkPlan:
    """The first ``at_exchange`` exchanges of ``record`` (the conversation ``key``) as
    a new conversation of ``identity`` (see the module docstring).

    Raises ``ConfigurationError`` for an ``at_exchange`` that is not an int from 1
    to the number of complete exchanges, ``DecisionHistoryRecordInvalid`` for a
    record that is not a readable touba decision history or whose kept exchanges
    are damaged.
    """
    check_original(key, record)
    head, exchanges = split_record(record)
    complete = len(exchanges) - (1 if head["pending"] else 0)
    if isinstance(at_exchange, bool) or not isinstance(at_exchange, int):
        raise ConfigurationError(
            f"at_exchange must be an int (the number of exchanges to keep), got "
            f"{type(at_exchange).__name__}"
        )
    if not 1 <= at_exchange <= complete:
        awaiting = (
            f"; exchange {len(exchanges)} awaits the results of its calls, so a fork cannot "
            "end on it yet"
            if head["pending"]
            else ""
        )
        raise ConfigurationError(
            f"at_exchange={at_exchange} is out of range: conversation {key} holds "
            f"{complete} complete exchange(s), so a fork keeps 1 to {complete} of them"
            f"{awaiting}. Nothing was copied"
        )
    kept = [list(exchange) for exchange in exchanges[:at_exchange]]
    try:
        messages = [tuple(message_from_dict(m) for m in exchange) for exchange in kept]
    except (DecisionHistoryRecordInvalid, TypeError, ValueError, KeyError) as e:
        raise DecisionHistoryRecordInvalid(
            f"conversation {key} holds a message this touba cannot read in its first "
            f"{at_exchange} exchange(s); nothing was copied. Inspect it with "
            f"`touba history show {key}`"
        ) from e
    check_window(key, 0, messages)
    bodies = [canonical_json(m) for exchange in kept for m in exchange]
    size = sum(len(body.encode("utf-8", "surrogatepass")) for body in bodies)
    new = new_head(identity)
    new["stats"] = {"exchanges": at_exchange, "messages": len(bodies), "bytes": size}
    new["summary"] = _kept_summary(head.get("summary"), at_exchange)
    return ForkPlan(new, kept, bodies)


def _kept_summary(summary: object, kept: int) -> Record | None:
    """The original's summary when it covers only exchanges the copy keeps."""
    if not isinstance(summary, Mapping):
        return None
    through = summary.get("through")
    if isinstance(through, bool) or not isinstance(through, int) or not 0 < through <= kept:
        return None
    return dict(summary)


def fork_appends(plan: ForkPlan) -> Sequence[tuple[int, Record]]:
    """The plan's messages as a log write appends them: (exchange, message), in order."""
    return [
        (index, message) for index, exchange in enumerate(plan.exchanges) for message in exchange
    ]

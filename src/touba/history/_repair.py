"""Checking a stored conversation for damage, and the smallest repair, as pure functions.

A store hands over a conversation as it is stored (:class:`RawConversation`: the
head's text, each message row's text, the store's own totals), read without
refusing anything; :func:`check_record` names what the pre-send window check
(:mod:`touba.history._integrity`) or the head check (:func:`~touba.history._record.check_head`)
would refuse, and :func:`plan_repair` computes the record that fixes it. The
decisions:

- **Kinds of damage.** ``unreadable_row`` (a row that is not a message touba
  reads: not JSON, not an object, an unknown kind, a bad field; a summary never
  lives in a row either), ``result_without_call`` (a result whose call, with its
  id and name, is not in its exchange's decision), ``duplicate_id`` (a decision
  repeating a call id, or a second result for one call), ``orphan_call`` (a call
  without its result, except the calls of the last exchange that the head lists
  as ``pending``: those await the runtime's observations, which is healthy),
  ``out_of_order`` (results not in their calls' order), ``split_exchange`` (one
  stored exchange holding two decisions, or a data message sharing an exchange)
  and ``head_mismatch`` (the head's stats, pending calls or exchange numbering, or
  the store's own totals, disagree with the rows).
- **The smallest fix.** An unreadable row is dropped; a result without its call
  is dropped; of duplicated ids the first copy is kept and later copies dropped
  (a decision's repeated call, a second result); an orphan call is answered with
  an ``error`` result ``"not run: repaired"`` (the call is kept: the model sees
  it was not run, rather than forgetting it asked); results are put in their
  calls' order; an exchange holding two decisions is split where the second
  starts; the head is rebuilt from the rows (stats counted, ``pending`` = the last
  exchange's calls only when none has a result and the head listed exactly
  them, exchanges numbered without gaps). A summary whose covered exchanges the
  repair changed is dropped (its fingerprint no longer covers them; the next
  decision summarises again). Everything else (identity, plot, timestamps but
  ``updated_at``) is kept as stored.
- **Sealed values.** A store encrypted at rest hands over its values opened
  (``read_raw``); a value still sealed did not open (the store was opened without
  its ``encryption=`` or with other keys, or the value was altered or moved): a
  row is ``unreadable_row``, a head makes the conversation unrepairable with
  advice to open the store with its keys rather than to delete it. Values sealed
  with a key the store was not given (``missing_keys``: a key removed before a
  rotation finished) make it unrepairable: they are not damaged, nothing is dropped.
- **What cannot be repaired.** A head that is not a JSON object, not a touba
  decision history record of this version, or without a readable identity: the
  conversation's identity is unknown, so nothing is rebuilt (``plan.record`` is
  None and ``plan.unrepairable`` says why); delete it instead. Records of other
  kinds (an integration's) are checked for unreadable rows only.
- **Proof.** :func:`plan_repair` runs the window check over every exchange of the
  repaired record and the head check on its head before returning it: a plan
  that would still be refused is a bug, raised as ``DecisionHistoryRecordInvalid``.
- **No content leaves.** Problems name positions (row, exchange, call index) and
  kinds, never a message's text, arguments or ids. The originals are kept by the
  caller in the export format (:func:`export_lines`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal, Protocol

from touba._encryption import Encryption
from touba.errors import DecisionHistoryRecordInvalid, ToubaError
from touba.history._config import HistoryEvent
from touba.history._identity import IDENTITY_FIELDS, ConversationIdentity
from touba.history._integrity import check_window
from touba.history._model import (
    DataMessage,
    DecisionMessage,
    Message,
    ResultMessage,
    SummaryMessage,
    canonical_json,
    message_from_dict,
    message_to_dict,
    parse_json,
)
from touba.history._record import RECORD_KIND, RECORD_VERSION, check_head, join_record, now_iso

__all__ = [
    "REPAIRED_ERROR",
    "ProblemKind",
    "RawConversation",
    "RawRow",
    "RecordProblem",
    "RepairPlan",
    "RepairableStore",
    "check_record",
    "export_lines",
    "plan_repair",
    "raw_int",
    "raw_of_record",
    "raw_text",
]

ProblemKind = Literal[
    "orphan_call",
    "result_without_call",
    "duplicate_id",
    "unreadable_row",
    "out_of_order",
    "split_exchange",
    "head_mismatch",
]
REPAIRED_ERROR: Final = "not run: repaired"
EXPORT_FORMAT: Final = "touba-export"
_SEALED: Final = (
    "a sealed value that did not open (a store opened without encryption=, or with "
    "other keys; or the value was altered or moved)"
)
EXPORT_VERSION: Final = 1


@dataclass(frozen=True, slots=True)
class RawRow:
    """One stored message row as text: ``exchange`` and ``bytes`` as the store keeps
    them (None when the store's own framing of the row is unreadable)."""

    exchange: int | None
    bytes: int | None
    body: str


@dataclass(frozen=True, slots=True)
class RawConversation:
    """A conversation as stored, read without refusing anything (``read_raw``).

    ``head`` is the stored head text (the whole record when ``split`` is False);
    ``rows`` every message row in stored order; ``exchanges``, ``messages`` and
    ``bytes`` the store's own totals; ``active`` whether it is reserved now;
    ``missing_keys`` the key ids of sealed values the store was not given the keys
    of (an encrypted store's ``read_raw``): such a conversation is not repaired.
    """

    key: str
    head: str
    split: bool
    rows: tuple[RawRow, ...]
    exchanges: int
    messages: int
    bytes: int
    active: bool = False
    missing_keys: tuple[str, ...] = ()

    def same_as(self, other: RawConversation) -> bool:
        """Whether ``other`` holds the same stored text (head, rows and totals)."""
        return (self.head, self.split, self.rows, self.exchanges, self.messages, self.bytes) == (
            other.head,
            other.split,
            other.rows,
            other.exchanges,
            other.messages,
            other.bytes,
        )


@dataclass(frozen=True, slots=True)
class RecordProblem:
    """One thing the window or head check would refuse: ``kind``, ``where`` (a
    position: row, exchange, call index) and ``why`` (what is wrong and what the
    repair does), never content."""

    kind: ProblemKind
    where: str
    why: str


@dataclass(frozen=True, slots=True)
class RepairPlan:
    """The smallest fix of one conversation (see the module docstring).

    ``record`` is the repaired record to store (None when there is nothing to
    change or it cannot be repaired: see ``changes`` and ``unrepairable``);
    ``original`` what it was computed from (a store writes the plan only while
    the conversation is still stored exactly so); ``removed_rows`` the stored
    texts of the rows dropped or changed; ``added`` how many results were added.
    """

    key: str
    original: RawConversation
    problems: tuple[RecordProblem, ...]
    record: dict[str, Any] | None
    removed_rows: tuple[str, ...] = ()
    added: int = 0
    unrepairable: str | None = None

    @property
    def changes(self) -> bool:
        """Whether applying the plan changes the stored conversation."""
        return self.record is not None

    @property
    def kinds(self) -> tuple[str, ...]:
        """The kinds of problems found, each once, sorted."""
        return tuple(sorted({p.kind for p in self.problems}))

    def event(self) -> HistoryEvent:
        """The ``history_repaired`` event of this plan once applied: counts and kinds,
        no content."""
        messages = 0
        size = 0
        if self.record is not None:
            for exchange in self.record.get("exchanges", []):
                for message in exchange:
                    messages += 1
                    size += len(canonical_json(message).encode("utf-8"))
        return HistoryEvent(
            kind="history_repaired",
            session_key=self.key,
            message_count=messages,
            bytes=size,
            count=len(self.problems),
            removed_messages=len(self.removed_rows),
            added_messages=self.added,
            repaired_kinds=",".join(self.kinds),
        )


class RepairableStore(Protocol):
    """What every built-in store offers for checking and repairing (``read_raw``,
    ``repair``: see :class:`~touba.history.sqlite.SqliteHistoryStore`)."""

    async def read_raw(self, key: str) -> RawConversation | None: ...

    async def repair(self, plan: RepairPlan) -> bool: ...


def raw_text(value: object) -> str:
    """A stored column as text, whatever someone wrote there (bytes decoded with
    replacement characters, anything else as its ``str``)."""
    if isinstance(value, str):
        return value
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).decode("utf-8", "replace")
    return str(value)


def raw_int(value: object) -> int | None:
    """A stored integer column, or None when it holds anything else."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def raw_of_record(key: str, record: Mapping[str, Any], *, active: bool = False) -> RawConversation:
    """A whole record (as ``transact`` sees it, or a RAM store keeps it) as stored text."""
    if not isinstance(record.get("exchanges"), list):
        text = canonical_json(dict(record))
        return RawConversation(key, text, False, (), 0, 0, len(text.encode()), active)
    head = canonical_json({k: v for k, v in record.items() if k != "exchanges"})
    rows = []
    for index, exchange in enumerate(record["exchanges"]):
        for message in exchange if isinstance(exchange, list) else [exchange]:
            body = canonical_json(message)
            rows.append(RawRow(index, len(body.encode()), body))
    size = len(head.encode()) + sum(r.bytes or 0 for r in rows)
    return RawConversation(
        key, head, True, tuple(rows), len(record["exchanges"]), len(rows), size, active
    )


def check_record(raw: RawConversation) -> list[RecordProblem]:
    """Every problem of a stored conversation that a check before sending, or the
    head check, would refuse (see the module docstring); empty when healthy.
    Never raises for damage: damage is what it reports."""
    return list(_Analysis(raw).problems)


def plan_repair(raw: RawConversation) -> RepairPlan:
    """The smallest fix of ``raw`` (see the module docstring). The repaired record
    passes the window check over all its exchanges and the head check; a healthy
    conversation gives a plan that changes nothing (``plan.changes`` False).
    ``DecisionHistoryRecordInvalid`` only if the repair itself would still be
    refused (a bug)."""
    analysis = _Analysis(raw)
    problems = tuple(analysis.problems)
    if analysis.unrepairable is not None:
        return RepairPlan(raw.key, raw, problems, None, unrepairable=analysis.unrepairable)
    if not problems:
        return RepairPlan(raw.key, raw, (), None)
    record = analysis.repaired()
    _prove(raw.key, record)
    return RepairPlan(
        raw.key,
        raw,
        problems,
        record,
        removed_rows=tuple(analysis.removed),
        added=analysis.added,
    )


def export_lines(plan: RepairPlan, *, touba_version: str, created_at: str) -> list[str]:
    """The original conversation in touba's export format (JSON Lines): a header,
    one ``conversation`` line (the original record; the texts of rows that could
    not be read in ``raw_rows``), an ``end`` line. Each line without its newline."""
    raw = plan.original
    header = {
        "format": EXPORT_FORMAT,
        "version": EXPORT_VERSION,
        "touba": touba_version,
        "created_at": created_at,
        "selection": {"conversation": raw.key},
    }
    record, unreadable, identity = _original(raw)
    line: dict[str, Any] = {
        "kind": "conversation",
        "key": raw.key,
        "identity": identity,
        "record": record,
    }
    if unreadable:
        line["raw_rows"] = unreadable
    return [_line(header), _line(line), _line({"kind": "end", "records": 1})]


# -- the analysis -------------------------------------------------------------------------


def _line(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def _original(raw: RawConversation) -> tuple[Any, list[str], dict[str, Any] | None]:
    """The stored record as far as it reads, the rows that do not, and the identity."""
    try:
        head: Any = parse_json(raw.head)
    except ValueError:
        return None, [raw.head, *(r.body for r in raw.rows)], None
    identity = head.get("identity") if isinstance(head, dict) else None
    identity = identity if isinstance(identity, dict) else None
    if not raw.split or not isinstance(head, dict):
        return head, [], identity
    exchanges: list[list[Any]] = []
    unreadable: list[str] = []
    for row in raw.rows:
        body = _object(row.body)
        if body is None or row.exchange is None or row.exchange < 0:
            unreadable.append(row.body)
            continue
        while len(exchanges) <= row.exchange:
            exchanges.append([])
        exchanges[row.exchange].append(body)
    return join_record(head, exchanges), unreadable, identity


def _object(text: str) -> dict[str, Any] | None:
    try:
        value = parse_json(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _message(row: RawRow) -> tuple[Message | None, dict[str, Any], str]:
    """The message of a row and its stored dict, or None and why it cannot be read."""
    if row.exchange is None or row.exchange < 0:
        return None, {}, "the store's framing of the row (its exchange number) is unreadable"
    body = _object(row.body)
    if body is None and Encryption.is_sealed(row.body):
        return None, {}, f"it is {_SEALED}"
    if body is None:
        return None, {}, "its text is not a JSON object"
    try:
        message = message_from_dict(body)
    except DecisionHistoryRecordInvalid:
        return None, {}, "it is not a message touba reads (unknown kind or a bad field)"
    if isinstance(message, SummaryMessage):
        return None, {}, "a summary is never stored as a row"
    return message, body, ""


@dataclass(slots=True)
class _Exchange:
    """One exchange being rebuilt: its first message, the results found for its
    calls (by call index), and whether anything in it changed."""

    first: DecisionMessage | DataMessage
    body: dict[str, Any]  # the first message as stored (kept as is unless changed)
    calls: list[Any] = field(default_factory=list)  # the decision's calls, deduplicated
    results: dict[int, dict[str, Any]] = field(default_factory=dict)  # stored dicts
    order: list[int] = field(default_factory=list)  # call indexes in the order results came
    changed: bool = False
    stored: int = 0  # the stored exchange it comes from


class _Analysis:
    """The problems of a stored conversation and, unless unrepairable, its repair."""

    def __init__(self, raw: RawConversation) -> None:
        self.raw = raw
        self.problems: list[RecordProblem] = []
        self.removed: list[str] = []
        self.added = 0
        self.unrepairable: str | None = None
        self.head: dict[str, Any] = {}
        self.exchanges: list[_Exchange] = []
        self.first_changed: int | None = None  # the oldest repaired exchange changed
        self._run()

    def note(self, kind: ProblemKind, where: str, why: str) -> None:
        self.problems.append(RecordProblem(kind, where, why))

    def _run(self) -> None:
        raw = self.raw
        if raw.missing_keys:
            ids = ", ".join(repr(k) for k in raw.missing_keys)
            self.note("unreadable_row", "sealed values", f"sealed with key(s) {ids} not given")
            self.unrepairable = (
                f"values are sealed with key(s) {ids} that the store was not given; open it "
                "with those keys (finish `touba rekey` before removing a key): nothing is dropped"
            )
            return
        head = _object(raw.head)
        if head is None and Encryption.is_sealed(raw.head):
            self.note("head_mismatch", "head", f"the stored head is {_SEALED}")
            self.unrepairable = (
                f"its head is {_SEALED}; check it with the store opened with its "
                "encryption=touba.Encryption(...) (the right keys) before deleting anything"
            )
            return
        if head is None:
            self.note("head_mismatch", "head", "the stored head is not a JSON object")
            self.unrepairable = (
                "its head is not a JSON object, so its identity is unknown; delete it"
            )
            return
        self.head = head
        if not raw.split:
            return  # a record kept whole: not a touba record with rows
        if head.get("kind") != RECORD_KIND:
            self._rows_only()
            return
        identity = head.get("identity")
        if head.get("version") != RECORD_VERSION or not _identity_ok(identity):
            self.note(
                "head_mismatch",
                "head",
                "the head is not a readable decision history record of this version "
                "(version or identity)",
            )
            self.unrepairable = (
                "its head names no readable identity of this version; delete it or upgrade touba"
            )
            return
        self._rebuild()
        self._check_head()

    def _rows_only(self) -> None:
        """Another touba kind (an integration's record): rows must be JSON objects."""
        for index, row in enumerate(self.raw.rows):
            if row.exchange is None or _object(row.body) is None:
                self.note(
                    "unreadable_row", f"row {index}", "its text is not a JSON object: dropped"
                )
                self.removed.append(row.body)

    def _rebuild(self) -> None:
        """Walk the rows in stored order and rebuild well-formed exchanges."""
        current: _Exchange | None = None
        stored_index: int | None = None
        for index, row in enumerate(self.raw.rows):
            where = f"row {index} (exchange {row.exchange})"
            message, body, why = _message(row)
            if message is None:
                self.note("unreadable_row", where, f"{why}: dropped")
                self.removed.append(row.body)
                self._changed(current, row.exchange)
                continue
            starts = row.exchange != stored_index
            stored_index = row.exchange
            if isinstance(message, DecisionMessage | DataMessage):
                if not starts and current is not None:
                    self.note(
                        "split_exchange",
                        where,
                        f"a {message.kind} message follows others in its exchange: it starts "
                        "an exchange of its own",
                    )
                    self._changed(current, row.exchange)
                current = self._open(message, body, row, where)
                if not starts:
                    current.changed = True
                continue
            assert isinstance(message, ResultMessage)
            if starts or current is None or isinstance(current.first, DataMessage):
                self.note(
                    "result_without_call",
                    where,
                    "a result opens an exchange, or follows a data message: dropped",
                )
                self.removed.append(row.body)
                self._changed(current if not starts else None, row.exchange)
                continue
            self._answer(current, message, body, row, where)
        self._close_all()

    def _open(
        self, message: DecisionMessage | DataMessage, body: dict[str, Any], row: RawRow, where: str
    ) -> _Exchange:
        exchange = _Exchange(message, body, stored=row.exchange or 0)
        if isinstance(message, DecisionMessage):
            seen: set[str] = set()
            for position, call in enumerate(message.calls):
                if call.call_id in seen:
                    self.note(
                        "duplicate_id",
                        f"{where}, call {position}",
                        "the decision repeats a call id: the later copy is dropped",
                    )
                    exchange.changed = True
                    continue
                seen.add(call.call_id)
                exchange.calls.append(call)
            if exchange.changed:
                self.removed.append(row.body)
        self.exchanges.append(exchange)
        return exchange

    def _answer(
        self,
        exchange: _Exchange,
        result: ResultMessage,
        body: dict[str, Any],
        row: RawRow,
        where: str,
    ) -> None:
        for position, call in enumerate(exchange.calls):
            if (call.call_id, call.name) != (result.call_id, result.name):
                continue
            if position in exchange.results:
                self.note(
                    "duplicate_id",
                    where,
                    "a second result for one call: the first is kept, this one dropped",
                )
                break
            exchange.results[position] = body
            exchange.order.append(position)
            return
        else:
            self.note(
                "result_without_call",
                where,
                "it answers no call of its exchange's decision (id and name): dropped",
            )
        self.removed.append(row.body)
        exchange.changed = True

    def _changed(self, exchange: _Exchange | None, stored: int | None) -> None:
        if exchange is not None:
            exchange.changed = True
        elif stored is not None:
            self._mark(stored)

    def _mark(self, stored: int) -> None:
        """Something in stored exchange ``stored`` changed (for the summary)."""
        self.first_changed = (
            stored if self.first_changed is None else min(self.first_changed, stored)
        )

    def _close_all(self) -> None:
        """Answer orphan calls, order results, find the calls still awaited."""
        pending = self.head.get("pending")
        listed = (
            [(p.get("call_id"), p.get("name")) for p in pending if isinstance(p, Mapping)]
            if isinstance(pending, list)
            else None
        )
        self.awaited: list[dict[str, str]] = []
        for number, exchange in enumerate(self.exchanges):
            if not isinstance(exchange.first, DecisionMessage):
                continue
            calls = exchange.calls
            last = number == len(self.exchanges) - 1
            if (
                last
                and calls
                and not exchange.results
                and listed == [(c.call_id, c.name) for c in calls]
            ):
                self.awaited = [{"call_id": c.call_id, "name": c.name} for c in calls]
                continue
            for position, call in enumerate(calls):
                if position in exchange.results:
                    continue
                self.note(
                    "orphan_call",
                    f"exchange {exchange.stored}, call {position}",
                    f"the call has no result: answered with an error result {REPAIRED_ERROR!r}",
                )
                exchange.results[position] = message_to_dict(
                    ResultMessage(
                        call_id=call.call_id,
                        name=call.name,
                        arguments=dict(call.arguments),
                        status="error",
                        error=REPAIRED_ERROR,
                    )
                )
                self.added += 1
                exchange.changed = True
            if exchange.order != sorted(exchange.order):
                self.note(
                    "out_of_order",
                    f"exchange {exchange.stored}",
                    "its results are not in their calls' order: put in order",
                )
                exchange.changed = True
        for exchange in self.exchanges:
            if exchange.changed:
                self._mark(exchange.stored)

    def messages(self, exchange: _Exchange) -> list[dict[str, Any]]:
        first = exchange.body
        if isinstance(exchange.first, DecisionMessage) and len(exchange.calls) != len(
            exchange.first.calls
        ):  # the later copies of a repeated call id go, the rest stays as stored
            kept: set[str] = set()
            calls = []
            for call in first["calls"]:
                if call["call_id"] not in kept:
                    kept.add(call["call_id"])
                    calls.append(call)
            first = {**first, "calls": calls}
        return [first, *(exchange.results[p] for p in sorted(exchange.results))]

    def _check_head(self) -> None:
        """Compare the head and the store's totals with what the rows hold."""
        raw, head = self.raw, self.head
        bodies = [[canonical_json(m) for m in self.messages(ex)] for ex in self.exchanges]
        self.stats = {  # the repaired record's
            "exchanges": len(bodies),
            "messages": sum(len(ex) for ex in bodies),
            "bytes": sum(len(b.encode("utf-8")) for ex in bodies for b in ex),
        }
        stored = {  # what the stored rows hold
            "exchanges": len({r.exchange for r in raw.rows if r.exchange is not None}),
            "messages": len(raw.rows),
            "bytes": sum(len(r.body.encode("utf-8", "surrogatepass")) for r in raw.rows),
        }
        if head.get("stats") != stored:
            self.note(
                "head_mismatch", "head.stats", "the head's counts differ from the rows: recounted"
            )
        pending = head.get("pending")
        if pending != self.awaited:
            self.note(
                "head_mismatch",
                "head.pending",
                "the head's pending calls are not the last exchange's unanswered calls: rebuilt",
            )
        if "exchanges" in head:
            self.note("head_mismatch", "head", "the head holds its own exchanges: removed")
        numbers = [r.exchange for r in raw.rows if r.exchange is not None]
        distinct = sorted(set(numbers))
        if distinct != list(range(len(distinct))) or raw.exchanges != len(distinct):
            self.note(
                "head_mismatch",
                "exchanges",
                "the stored exchanges are not numbered 0, 1, ... without gaps: renumbered",
            )
        head_bytes = len(raw.head.encode("utf-8"))
        row_bytes = [len(r.body.encode("utf-8", "surrogatepass")) for r in raw.rows]
        if raw.messages != len(raw.rows) or raw.bytes != head_bytes + sum(row_bytes):
            self.note(
                "head_mismatch", "totals", "the store's totals differ from its rows: recounted"
            )
        for index, (row, size) in enumerate(zip(raw.rows, row_bytes, strict=True)):
            if row.bytes is not None and row.bytes != size:
                self.note("head_mismatch", f"row {index}", "its size column is wrong: recounted")
        summary = head.get("summary")
        if summary is not None and not (
            isinstance(summary, Mapping)
            and isinstance(summary.get("through"), int)
            and 0 <= summary["through"] <= len(bodies)
        ):
            self.note(
                "head_mismatch", "head.summary", "the summary covers exchanges not held: dropped"
            )

    def repaired(self) -> dict[str, Any]:
        """The repaired record (only when there are problems and it is repairable)."""
        head = {k: v for k, v in self.head.items() if k != "exchanges"}
        head["stats"] = self.stats
        head["pending"] = self.awaited
        summary = head.get("summary")
        if summary is not None:
            through = summary.get("through") if isinstance(summary, Mapping) else None
            if (
                not isinstance(through, int)
                or not 0 <= through <= len(self.exchanges)
                or (self.first_changed is not None and self.first_changed < through)
                or _renumbered_before(self.exchanges, through)
            ):
                head["summary"] = None
        head["updated_at"] = now_iso()
        return join_record(head, [self.messages(ex) for ex in self.exchanges])


def _renumbered_before(exchanges: Sequence[_Exchange], through: int) -> bool:
    """Whether an exchange the summary covers now sits at another index."""
    return any(ex.stored != i for i, ex in enumerate(exchanges[:through]))


def _identity_ok(identity: object) -> bool:
    if not isinstance(identity, Mapping):
        return False
    try:
        fields: dict[str, Any] = {f: identity.get(f) for f in IDENTITY_FIELDS}
        ConversationIdentity(**fields)
    except (ToubaError, TypeError, ValueError):
        return False
    return True


def _prove(key: str, record: dict[str, Any]) -> None:
    """Refuse a repaired record the window or head check would still refuse."""
    head = {k: v for k, v in record.items() if k != "exchanges"}
    identity = ConversationIdentity(**{f: head["identity"][f] for f in IDENTITY_FIELDS})
    exchanges = record["exchanges"]
    check_head(head, identity, exchange_count=len(exchanges))
    parsed = [[message_from_dict(m) for m in ex] for ex in exchanges]
    if head["pending"]:  # its results come with the next decision, which checks them then
        parsed = parsed[:-1]
    check_window(key, 0, parsed)

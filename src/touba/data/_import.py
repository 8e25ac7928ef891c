"""Import: the records of an export file written into a deployment's stores.

Decisions:

- **The whole file is checked before anything is written**, in three passes over a
  private temporary copy of the lines (so any iterable works and memory stays
  constant): (1) every line parsed and validated (header first, an ``end`` line last
  with the right count, known kinds, each kind's fields, every bound), (2) every
  record looked up in the target stores, read-only: absent (to add), present and
  equal (skipped) or present and different (:class:`ImportConflict`, naming the
  record), and the history store's capacity checked for what will be added, (3) the
  absent records written, in the file's order. A refusal in (1) or (2) leaves every
  store untouched.
- **Idempotent.** Importing the same file twice adds nothing the second time: every
  record is then present and equal.
- **Bounds are kept, never cut.** A conversation larger than ``max_retained_bytes``,
  or with an exchange of more than ``max_messages`` messages (it could never be
  sent), a key event's title or details over their limits, more conversations or
  bytes than the history store's ``max_sessions`` / ``max_store_bytes`` leave: refused
  (:class:`ImportLimitExceeded`).
- **Where records go.** Memory records into ``stores.memory``, conversations into the
  first history store (``stores.histories[0]``), checkpoints into
  ``stores.checkpoints`` (``save``), resources into ``stores.resources``
  (``import_item``, which keeps ``updated_at``; a binding without it gets ``put``, and
  the time of the import). A present resource value is compared by value alone. A
  record whose store is missing is refused in pass (1).
- **Races.** A record written by someone else between pass (2) and its write is
  compared again: equal, it counts as present; different, ``ImportConflict`` (the
  records written before it stay: rerun the import after resolving it).
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Mapping
from dataclasses import dataclass, field
from typing import IO, Any, Final

from touba.data._format import (
    CheckpointLine,
    ConversationLine,
    EndLine,
    ExportFileInvalid,
    ExtractionJobLine,
    ImportConflict,
    ImportLimitExceeded,
    KeyEventChangeLine,
    KeyEventLine,
    RecordLine,
    ResourceLine,
    SessionLine,
    TurnLine,
    parse_header,
    parse_line,
)
from touba.data._stores import Stores
from touba.errors import ConfigurationError
from touba.history._config import HistoryConfig
from touba.history._model import canonical_json, message_bytes
from touba.history._record import RECORD_KIND, RECORD_VERSION
from touba.memory._model import (
    CreateEventOp,
    ExtractedOp,
    ExtractionJob,
    FieldChange,
    KeyEvent,
    KeyEventUpdate,
    SessionMeta,
    StoredTurn,
    UpdateEventOp,
)
from touba.providers._types import TraceCall
from touba.runtime._resources import ResourceAddress

__all__ = ["ImportReport", "import_records"]

_MAX_TITLE_CHARS: Final = 200
_MAX_DETAILS_CHARS: Final = 4000


@dataclass(frozen=True, slots=True)
class ImportReport:
    """What an import did, per record kind: ``added`` (written now) and ``present``
    (already in the store, equal: skipped). A kind with none is left out."""

    added: Mapping[str, int] = field(default_factory=dict)
    present: Mapping[str, int] = field(default_factory=dict)

    @property
    def total_added(self) -> int:
        """How many records were written."""
        return sum(self.added.values())

    @property
    def total_present(self) -> int:
        """How many records were already there."""
        return sum(self.present.values())


async def import_records(
    stores: Stores,
    lines: AsyncIterable[str | bytes] | Iterable[str | bytes],
    *,
    history_config: HistoryConfig | None = None,
    max_title_chars: int = _MAX_TITLE_CHARS,
    max_details_chars: int = _MAX_DETAILS_CHARS,
) -> ImportReport:
    """Import an export file (its lines, e.g. an open binary file) into ``stores``.

    The whole file is checked, and every record looked up, before anything is written
    (module docstring). ``history_config``: the bounds conversations must keep
    (``HistoryConfig()``'s when None); ``max_title_chars`` / ``max_details_chars``: the
    key-event limits (``KeyEventService``'s defaults). Raises ``ExportFileInvalid``
    (a damaged line, an unknown kind, a newer format version, a missing end line:
    ``line`` names it), ``ImportConflict`` (a record present with other content),
    ``ImportLimitExceeded`` (a bound), ``ConfigurationError`` (a record whose store
    is not in ``stores``), each with nothing written; and the stores' own errors.
    """
    bounds = history_config or HistoryConfig()
    with tempfile.TemporaryFile("w+b") as spool:  # created 0600, removed on close
        total = 0
        async for number, line in _numbered(lines):
            data = line if isinstance(line, bytes) else line.encode("utf-8", "surrogatepass")
            spool.write(data if data.endswith(b"\n") else data + b"\n")
            total = number
        _check_file(spool, total, stores, bounds, max_title_chars, max_details_chars)
        importer = _Importer(stores)
        await importer.plan(_records(spool))
        return await importer.write(_records(spool))


async def _numbered(
    lines: AsyncIterable[str | bytes] | Iterable[str | bytes],
) -> AsyncIterator[tuple[int, str | bytes]]:
    number = 0
    if isinstance(lines, AsyncIterable):
        async for line in lines:
            number += 1
            yield number, line
    else:
        for line in lines:
            number += 1
            yield number, line


def _records(spool: IO[bytes]) -> Iterable[tuple[int, RecordLine]]:
    """The records of a checked spool (header and end line left out), numbered."""
    spool.seek(0)
    for number, line in enumerate(spool, start=1):
        if number == 1:
            continue
        record = parse_line(line, number)
        if isinstance(record, EndLine):
            return
        yield number, record


def _check_file(
    spool: IO[bytes],
    total: int,
    stores: Stores,
    bounds: HistoryConfig,
    max_title_chars: int,
    max_details_chars: int,
) -> None:
    """Pass 1: every line valid, the end line there with the right count, every bound."""
    spool.seek(0)
    count = 0
    ended = 0
    event: str | None = None  # the key event whose changes may follow
    next_change = 0
    for number, line in enumerate(spool, start=1):
        if number == 1:
            parse_header(line)
            continue
        if ended:
            raise ExportFileInvalid(
                f"line {number} follows the end line (line {ended}); the file is damaged. "
                "Nothing was imported",
                line=number,
            )
        record = parse_line(line, number)
        if isinstance(record, EndLine):
            if record.records != count:
                raise ExportFileInvalid(
                    f"line {number}: the end line counts {record.records} records, the file "
                    f"holds {count}; the file is damaged. Nothing was imported",
                    line=number,
                )
            ended = number
            continue
        count += 1
        _check_store(stores, record, number)
        if isinstance(record, KeyEventLine):
            event, next_change = record.id, 0
            _check_event(record, number, max_title_chars, max_details_chars)
        elif isinstance(record, KeyEventChangeLine):
            if record.event_id != event or record.index != next_change:
                raise ExportFileInvalid(
                    f"line {number}: a key_event_change must follow its key_event line and "
                    "the changes before it, in order; the file is damaged. Nothing was "
                    "imported",
                    line=number,
                )
            next_change += 1
        else:
            event = None
            if isinstance(record, ConversationLine):
                _check_conversation(record, number, bounds)
    if total == 0:
        raise ExportFileInvalid("the export file is empty; nothing was imported", line=1)
    if not ended:
        raise ExportFileInvalid(
            f"the export file ends at line {total} without its end line (it was cut short "
            "or damaged); export it again. Nothing was imported",
            line=total + 1,
        )


def _check_store(stores: Stores, record: RecordLine, number: int) -> None:
    kind = record.kind
    if isinstance(record, ConversationLine):
        missing = not stores.histories and "a history store (histories=)"
    elif isinstance(record, CheckpointLine):
        missing = stores.checkpoints is None and "a checkpoint store (checkpoints=)"
    elif isinstance(record, ResourceLine):
        missing = stores.resources is None and "a resource binding (resources=)"
    else:
        missing = stores.memory is None and "a memory store (memory=)"
        if not missing and not callable(getattr(stores.memory, "import_session", None)):
            raise ConfigurationError(
                f"line {number}: the memory store cannot import records as exported (it has "
                "no import_session); import into a built-in store (SqliteMemoryStore, "
                "PostgresMemoryStore). Nothing was imported"
            )
    if missing:
        raise ConfigurationError(
            f"line {number} holds a {kind} record and the stores given have no place for it: "
            f"give {missing}. Nothing was imported"
        )


def _check_event(record: KeyEventLine, number: int, max_title: int, max_details: int) -> None:
    for name, text, limit in (
        ("title", record.title, max_title),
        ("details", record.details, max_details),
    ):
        if len(text) > limit:
            raise ImportLimitExceeded(
                f"line {number}: key event {record.id!r} has a {name} of {len(text)} "
                f"characters, over max_{name}_chars={limit}; it is refused, not cut. "
                "Nothing was imported",
                line=number,
                limit=f"max_{name}_chars",
            )


def _check_conversation(record: ConversationLine, number: int, bounds: HistoryConfig) -> None:
    body: dict[str, Any] = record.record
    exchanges: Any = body.get("exchanges")
    if (
        body.get("kind") != RECORD_KIND
        or not isinstance(body.get("version"), int)
        or not isinstance(exchanges, list)
        or not all(
            isinstance(ex, list) and all(isinstance(m, dict) for m in ex) for ex in exchanges
        )
        or body.get("identity") != record.identity
    ):
        raise ExportFileInvalid(
            f"line {number}: conversation {record.key!r} does not hold a touba decision "
            "history record (kind, version, identity and exchanges); nothing was imported",
            line=number,
        )
    version = body["version"]
    if version > RECORD_VERSION:
        raise ExportFileInvalid(
            f"line {number}: conversation {record.key!r} is a record of version {version}, "
            f"and this touba reads versions up to {RECORD_VERSION}; upgrade touba. Nothing "
            "was imported",
            line=number,
        )
    size = 0
    for exchange in exchanges:
        if len(exchange) > bounds.max_messages:
            raise ImportLimitExceeded(
                f"line {number}: conversation {record.key!r} has an exchange of "
                f"{len(exchange)} messages, over max_messages={bounds.max_messages} (it could "
                "never be sent); it is refused, not cut. Nothing was imported",
                line=number,
                limit="max_messages",
            )
        size += sum(message_bytes(message) for message in exchange)
    if size > bounds.max_retained_bytes:
        raise ImportLimitExceeded(
            f"line {number}: conversation {record.key!r} retains {size} bytes, over "
            f"max_retained_bytes={bounds.max_retained_bytes}; it is refused, not cut. "
            "Nothing was imported",
            line=number,
            limit="max_retained_bytes",
        )


# -- from lines to the stores' records ----------------------------------------------------


def _session(record: SessionLine) -> SessionMeta:
    return SessionMeta(
        record.session_id,
        record.owner,
        record.agent_ref,
        record.mode,
        record.created_at,
        record.ended_at,
        record.turns,
    )


def _turn(record: TurnLine) -> StoredTurn:
    trace = tuple(tuple(TraceCall(**call.model_dump()) for call in group) for group in record.trace)
    return StoredTurn(
        record.session_id,
        record.index,
        record.user,
        tuple(record.replies),
        trace,
        record.invocation_id,
        record.created_at,
        record.context,
    )


def _event(record: KeyEventLine) -> KeyEvent:
    return KeyEvent(
        record.id,
        record.owner,
        record.type,
        record.title,
        record.status,
        record.details,
        record.created_at,
        record.updated_at,
        record.session_id,
    )


def _update(record: KeyEventChangeLine) -> KeyEventUpdate:
    return KeyEventUpdate(
        record.at,
        record.session_id,
        tuple(FieldChange(c.field, c.old, c.new) for c in record.changes),
        record.op_id,
        record.actor,
    )


def _job(record: ExtractionJobLine) -> ExtractionJob:
    ops: tuple[ExtractedOp, ...] | None = None
    if record.ops is not None:
        ops = tuple(
            CreateEventOp(op.type, op.title, op.details)
            if op.kind == "create"
            else UpdateEventOp(op.event_id, op.status, op.title, op.details)
            for op in record.ops
        )
    return ExtractionJob(
        id=record.id,
        session_id=record.session_id,
        owner=record.owner,
        agent_ref=record.agent_ref,
        transcript_ref=record.transcript_ref,
        status=record.status,
        attempts=record.attempts,
        max_attempts=record.max_attempts,
        next_attempt_at=record.next_attempt_at,
        created_at=record.created_at,
        updated_at=record.updated_at,
        lease_owner=record.lease_owner,
        lease_token=record.lease_token,
        lease_expires_at=record.lease_expires_at,
        last_error=record.last_error,
        ops=ops,
        result=record.result,
    )


def _address(record: ResourceLine) -> ResourceAddress:
    a = record.address
    return ResourceAddress(a.resource, a.scope, a.scope_key)


def _same_json(a: object, b: object) -> bool:
    return canonical_json(a) == canonical_json(b)


def _name(record: RecordLine) -> str:
    """The id that names a record in a conflict (an id, never content)."""
    if isinstance(record, SessionLine):
        return record.session_id
    if isinstance(record, TurnLine):
        return f"{record.session_id}#{record.index}"
    if isinstance(record, KeyEventChangeLine):
        return f"{record.event_id}#{record.index}"
    if isinstance(record, ConversationLine):
        return record.key
    if isinstance(record, ResourceLine):
        a = record.address
        return f"{a.resource}/{a.scope}/{a.scope_key}/{record.key}"
    assert isinstance(record, KeyEventLine | ExtractionJobLine | CheckpointLine)
    return record.id


def _conflict(number: int, record: RecordLine, written: bool = False) -> ImportConflict:
    after = (
        "the records before it were written; resolve it and import again"
        if written
        else "nothing was imported"
    )
    return ImportConflict(
        f"line {number}: the {record.kind} {_name(record)!r} is already in the target store "
        f"with other content; delete it there or import into another store ({after})",
        line=number,
        kind=record.kind,
        record=_name(record),
    )


class _Importer:
    """Pass 2 (:meth:`plan`: look every record up) and pass 3 (:meth:`write`)."""

    def __init__(self, stores: Stores) -> None:
        self._stores = stores
        self._memory: Any = stores.memory
        self._history: Any = stores.histories[0] if stores.histories else None
        self._event: KeyEvent | None = None  # the current key event, as the store holds it
        self._event_owner = ""
        self._present: dict[str, int] = {}
        self._added: dict[str, int] = {}

    async def _found(self, record: RecordLine) -> bool | None:
        """True: present and equal; False: absent; None: present and different."""
        memory = self._memory
        if isinstance(record, SessionLine):
            session = await memory.get_session(record.session_id)
            return _compare(session, _session(record))
        if isinstance(record, TurnLine):
            turns = await memory.list_turns(record.session_id, limit=1, offset=record.index)
            turn = turns[0] if turns and turns[0].index == record.index else None
            return _compare(turn, _turn(record))
        if isinstance(record, KeyEventLine):
            stored = await memory.get_event(record.owner, record.id)
            self._event, self._event_owner = stored, record.owner
            if stored is None:
                owner = await memory.event_owner(record.id)
                return None if owner is not None else False  # another owner's id: a conflict
            return _compare(dataclasses.replace(stored, history=None), _event(record))
        if isinstance(record, KeyEventChangeLine):
            history = () if self._event is None else self._event.history or ()
            if record.index >= len(history):
                return False
            return _compare(history[record.index], _update(record))
        if isinstance(record, ExtractionJobLine):
            return _compare(await memory.get_job(record.id), _job(record))
        if isinstance(record, ConversationLine):
            stored_record = await self._history.read(record.key, purge=False)
            if stored_record is None:
                return False
            return _same_json(stored_record, record.record) or None
        if isinstance(record, CheckpointLine):
            assert self._stores.checkpoints is not None
            body = await self._stores.checkpoints.get(record.id)
            if body is None:
                return False
            return _same_json(body, record.body) or None
        assert isinstance(record, ResourceLine)
        assert self._stores.resources is not None
        item = await self._stores.resources.get(_address(record), record.key)
        if item is None:
            return False
        return _same_json(item.value, record.value) or None

    async def plan(self, records: Iterable[tuple[int, RecordLine]]) -> None:
        """Pass 2, read-only: a conflict raises; the history store's room is checked."""
        conversations = 0
        size = 0
        for number, record in records:
            found = await self._found(record)
            if found is None:
                raise _conflict(number, record)
            if not found and isinstance(record, ConversationLine):
                conversations += 1
                size += len(canonical_json(record.record).encode("utf-8"))
        if conversations:
            usage = await self._history.usage(purge=False)
            if usage.sessions + conversations > usage.max_sessions:
                raise ImportLimitExceeded(
                    f"the history store holds {usage.sessions} conversations of "
                    f"max_sessions={usage.max_sessions}; the {conversations} to import do not "
                    "fit. Nothing was imported",
                    line=0,
                    limit="max_sessions",
                )
            if usage.bytes + size > usage.max_store_bytes:
                raise ImportLimitExceeded(
                    f"the history store holds {usage.bytes} bytes of "
                    f"max_store_bytes={usage.max_store_bytes}; the {size} bytes to import do "
                    "not fit. Nothing was imported",
                    line=0,
                    limit="max_store_bytes",
                )

    async def write(self, records: Iterable[tuple[int, RecordLine]]) -> ImportReport:
        """Pass 3: every absent record written, in the file's order."""
        for number, record in records:
            found = await self._found(record)
            if not found:
                if found is False and await self._add(record):
                    self._added[record.kind] = self._added.get(record.kind, 0) + 1
                    continue
                if await self._found(record) is not True:  # written meanwhile, differently
                    raise _conflict(number, record, written=True)
            self._present[record.kind] = self._present.get(record.kind, 0) + 1
        return ImportReport(dict(self._added), dict(self._present))

    async def _add(self, record: RecordLine) -> bool:
        """Write one absent record; False when it was there after all."""
        memory = self._memory
        if isinstance(record, SessionLine):
            return bool(await memory.import_session(_session(record)))
        if isinstance(record, TurnLine):
            return bool(await memory.import_turn(_turn(record)))
        if isinstance(record, KeyEventLine):
            added = bool(await memory.import_event(_event(record)))
            self._event = await memory.get_event(record.owner, record.id)
            return added
        if isinstance(record, KeyEventChangeLine):
            added = bool(
                await memory.import_event_change(record.event_id, record.index, _update(record))
            )
            self._event = await memory.get_event(self._event_owner, record.event_id)
            return added
        if isinstance(record, ExtractionJobLine):
            return bool(await memory.import_job(_job(record)))
        if isinstance(record, ConversationLine):
            return await self._add_conversation(record)
        if isinstance(record, CheckpointLine):
            assert self._stores.checkpoints is not None
            try:
                await self._stores.checkpoints.save(record.id, dict(record.body))
            except ConfigurationError:
                if await self._stores.checkpoints.get(record.id) is None:
                    raise
                return False  # saved meanwhile
            return True
        assert isinstance(record, ResourceLine)
        binding: Any = self._stores.resources
        importer = getattr(binding, "import_item", None)
        if importer is not None:
            return bool(
                await importer(_address(record), record.key, record.value, record.updated_at)
            )
        await binding.put(_address(record), record.key, record.value)
        return True

    async def _add_conversation(self, record: ConversationLine) -> bool:
        body = dict(record.record)

        async def save(current: dict[str, Any] | None) -> tuple[dict[str, Any] | None, bool]:
            if current is not None:
                return current, False
            return body, True

        added: bool = await self._history.transact(record.key, save)
        return added


def _compare(stored: object, imported: object) -> bool | None:
    if stored is None:
        return False
    return True if stored == imported else None

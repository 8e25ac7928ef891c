"""The export format: JSON Lines, one object per line, versioned (docs/data/export.md).

Decisions:

- **Shape.** Line 1 is the header (``format``, ``version``, the ``touba`` version that
  wrote it, ``created_at`` in ISO UTC, the ``selection``); then one record per line,
  each with a ``kind``; the last line is ``{"kind": "end", "records": N}`` (N the
  records between header and end), so a file cut short is refused, never half read.
- **Validation.** Every line is checked by a pydantic v2 model (unknown fields and
  kinds refused); a problem is an :class:`ExportFileInvalid` naming the line number,
  never the line's content. A file of a newer ``version`` is refused whole.
- **Text.** UTF-8, JSON without NaN or Infinity, keys in the order the models give.
  The records hold the user's content as the stores returned it: the file is as
  sensitive as the stores (the CLI creates it 0600).
- **Reused.** ``header``, ``conversation`` and ``end`` keep these exact shapes: the
  repair keeps the originals of a repaired conversation in this format, and the copy
  between stores may reuse these functions.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from importlib.metadata import version as _distribution_version
from typing import Annotated, Any, Final, Literal, TypeAlias

from pydantic import (
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    TypeAdapter,
    ValidationError,
)

from touba.errors import ConfigurationError
from touba.history._model import canonical_json, parse_json

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "CheckpointLine",
    "ConversationLine",
    "EndLine",
    "ExportFileInvalid",
    "ExportHeader",
    "ExtractionJobLine",
    "ImportConflict",
    "ImportLimitExceeded",
    "KeyEventChangeLine",
    "KeyEventLine",
    "RecordLine",
    "ResourceLine",
    "SessionLine",
    "TurnLine",
    "dump_line",
    "end_line",
    "header_line",
    "parse_header",
    "parse_line",
]

FORMAT_NAME: Final = "touba-export"
FORMAT_VERSION: Final = 1


class ExportFileInvalid(ConfigurationError):
    """An export file that cannot be imported: a damaged line, an unknown kind, a newer
    format version, a missing end line. ``line`` is the 1-based line number at fault
    (the line after the last one for a file cut short). Nothing was written."""

    def __init__(self, message: str, *, line: int) -> None:
        super().__init__(message)
        self.line = line


class ImportConflict(ConfigurationError):
    """A record of the file is already in the target store with other content.

    ``kind`` and ``record`` (its id: a session id, a conversation key, a checkpoint
    id...) name it, ``line`` is its line in the file. Nothing was written: delete the
    stored record or import into another store."""

    def __init__(self, message: str, *, line: int, kind: str, record: str) -> None:
        super().__init__(message)
        self.line = line
        self.kind = kind
        self.record = record


class ImportLimitExceeded(ConfigurationError):
    """A record (or the whole file) would exceed a bound of the target store: it is
    refused, never cut. ``limit`` names the bound (``max_retained_bytes``,
    ``max_messages``, ``max_sessions``, ``max_store_bytes``, ``max_title_chars``,
    ``max_details_chars``), ``line`` the record's line (0 for the whole file).
    Nothing was written."""

    def __init__(self, message: str, *, line: int, limit: str) -> None:
        super().__init__(message)
        self.line = line
        self.limit = limit


class _Line(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=False)


class ExportHeader(_Line):
    """Line 1: which format and version, which touba wrote it, when, and what it holds."""

    format: Literal["touba-export"]
    version: int = Field(ge=1)
    touba: str
    created_at: AwareDatetime
    selection: dict[str, str]


class SessionLine(_Line):
    """A chat session (``SessionMeta``): ``turns`` is its turn count."""

    kind: Literal["session"]
    session_id: str = Field(min_length=1)
    owner: str
    agent_ref: str
    mode: Literal["live", "preview"]
    created_at: AwareDatetime
    ended_at: AwareDatetime | None
    turns: int = Field(ge=0)


class TraceCallData(_Line):
    """One tool call of a turn's trace (``TraceCall``)."""

    call_id: str
    name: str
    arguments: dict[str, JsonValue]
    status: Literal["ok", "error", "denied"]
    result: JsonValue = None
    error: str | None = None


class TurnLine(_Line):
    """A chat turn (``StoredTurn``) with its ``context``; ``index`` from 0."""

    kind: Literal["turn"]
    session_id: str = Field(min_length=1)
    index: int = Field(ge=0)
    user: str
    replies: list[str]
    trace: list[list[TraceCallData]]
    invocation_id: str | None
    created_at: AwareDatetime
    context: dict[str, JsonValue] | None


class KeyEventLine(_Line):
    """A key event (``KeyEvent``) without its history, which follows it as
    ``key_event_change`` lines."""

    kind: Literal["key_event"]
    id: str = Field(min_length=1)
    owner: str = Field(min_length=1)
    type: str
    title: str
    status: Literal["open", "in_progress", "closed"]
    details: str
    created_at: AwareDatetime
    updated_at: AwareDatetime
    session_id: str


class FieldChangeData(_Line):
    field: Literal["status", "title", "details"]
    old: str
    new: str


class KeyEventChangeLine(_Line):
    """Entry ``index`` (from 0, oldest first) of a key event's update history; it
    follows its event's ``key_event`` line (or the change before it)."""

    kind: Literal["key_event_change"]
    event_id: str = Field(min_length=1)
    index: int = Field(ge=0)
    at: AwareDatetime
    session_id: str
    changes: list[FieldChangeData]
    op_id: str | None
    actor: Literal["model", "operator"]


class CreateOpData(_Line):
    kind: Literal["create"]
    type: str
    title: str
    details: str = ""


class UpdateOpData(_Line):
    kind: Literal["update"]
    event_id: str
    status: Literal["open", "in_progress", "closed"] | None = None
    title: str | None = None
    details: str | None = None


class ExtractionJobLine(_Line):
    """An extraction job (``ExtractionJob``), its lease and recorded ops included."""

    kind: Literal["extraction_job"]
    id: str = Field(min_length=1)
    session_id: str
    owner: str
    agent_ref: str
    transcript_ref: str
    status: Literal["pending", "running", "done", "failed"]
    attempts: int = Field(ge=0)
    max_attempts: int = Field(ge=0)
    next_attempt_at: AwareDatetime
    created_at: AwareDatetime
    updated_at: AwareDatetime
    lease_owner: str | None
    lease_token: str | None
    lease_expires_at: AwareDatetime | None
    last_error: str | None
    ops: list[Annotated[CreateOpData | UpdateOpData, Field(discriminator="kind")]] | None
    result: JsonValue


class ConversationLine(_Line):
    """A decision history: its store ``key``, its ``identity`` (None for a key reserved
    before its first save) and ``record``, the store's record as ``read()`` returns it."""

    kind: Literal["conversation"]
    key: str = Field(min_length=1)
    identity: dict[str, str] | None
    record: dict[str, JsonValue]


class CheckpointLine(_Line):
    """A checkpoint of the runtime: its ``id`` and its ``body`` (the JSON object saved)."""

    kind: Literal["checkpoint"]
    id: str = Field(min_length=1)
    body: dict[str, JsonValue]


class ResourceAddressData(_Line):
    resource: str = Field(min_length=1)
    scope: Literal["run", "session", "user", "agent"]
    scope_key: str = Field(min_length=1)


class ResourceLine(_Line):
    """A resource value: where (``address``), its ``key``, ``value`` and ``updated_at``."""

    kind: Literal["resource"]
    address: ResourceAddressData
    key: str = Field(min_length=1)
    value: JsonValue
    updated_at: AwareDatetime


class EndLine(_Line):
    """The last line: how many records the file holds between header and end."""

    kind: Literal["end"]
    records: int = Field(ge=0)


RecordLine: TypeAlias = (
    SessionLine
    | TurnLine
    | KeyEventLine
    | KeyEventChangeLine
    | ExtractionJobLine
    | ConversationLine
    | CheckpointLine
    | ResourceLine
    | EndLine
)
_RECORD: Final[TypeAdapter[RecordLine]] = TypeAdapter(
    Annotated[RecordLine, Field(discriminator="kind")]
)
KINDS: Final = (
    "session",
    "turn",
    "key_event",
    "key_event_change",
    "extraction_job",
    "conversation",
    "checkpoint",
    "resource",
)


def dump_line(data: Mapping[str, Any] | BaseModel) -> bytes:
    """One line of the file (UTF-8, newline-terminated) from a record's dict or model."""
    if isinstance(data, BaseModel):
        data = data.model_dump(mode="json")
    return canonical_json(data).encode("utf-8") + b"\n"


def header_line(
    selection: Mapping[str, str], *, created_at: datetime | None = None
) -> dict[str, Any]:
    """The header of a file holding ``selection`` (e.g. ``{"session": "s-1"}``)."""
    moment = created_at or datetime.now(UTC)
    return {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "touba": _distribution_version("touba"),  # touba.__version__, read below its layer
        "created_at": moment.astimezone(UTC).isoformat(),
        "selection": dict(selection),
    }


def end_line(records: int) -> dict[str, Any]:
    """The last line of a file of ``records`` records."""
    return {"kind": "end", "records": records}


def _json(line: str | bytes, number: int) -> Any:
    try:
        return parse_json(line)
    except (ValueError, UnicodeDecodeError) as e:
        raise ExportFileInvalid(
            f"line {number} of the export file is not JSON (the file is damaged); "
            "export it again. Nothing was imported",
            line=number,
        ) from e


def _problem(error: ValidationError) -> str:
    """Where a line is wrong, by field path and error type: never the values it holds."""
    first = error.errors(include_input=False, include_url=False)[0]
    where = ".".join(str(part) for part in first["loc"]) or "the line"
    return f"{where}: {first['type']}"


def parse_header(line: str | bytes, number: int = 1) -> ExportHeader:
    """The header line, checked; ``ExportFileInvalid`` when it is not a touba export
    header, or one of a format version newer than this touba reads."""
    data = _json(line, number)
    if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
        raise ExportFileInvalid(
            f"line {number} is not a touba export header (a touba export file starts with "
            '{"format": "touba-export", ...}); nothing was imported',
            line=number,
        )
    version = data.get("version")
    if isinstance(version, int) and not isinstance(version, bool) and version > FORMAT_VERSION:
        raise ExportFileInvalid(
            f"line {number}: the file is in export format version {version}, and this touba "
            f"reads versions up to {FORMAT_VERSION}; upgrade touba to import it. Nothing was "
            "imported",
            line=number,
        )
    try:
        return ExportHeader.model_validate(data)
    except ValidationError as e:
        raise ExportFileInvalid(
            f"line {number}: the export header is invalid ({_problem(e)}); nothing was imported",
            line=number,
        ) from e


def parse_line(line: str | bytes, number: int) -> RecordLine:
    """One record line, checked; ``ExportFileInvalid`` naming ``number`` when it is
    not JSON, of an unknown kind, or does not have that kind's fields."""
    data = _json(line, number)
    if not isinstance(data, dict):
        raise ExportFileInvalid(
            f"line {number} is not a JSON object; nothing was imported", line=number
        )
    kind = data.get("kind")
    if kind not in (*KINDS, "end"):
        shown = repr(kind) if isinstance(kind, str) and kind.isidentifier() else "unknown"
        raise ExportFileInvalid(
            f"line {number} has kind {shown:.40}, which this touba does not know (it reads "
            f"{', '.join(KINDS)}); nothing was imported",
            line=number,
        )
    try:
        return _RECORD.validate_python(data)
    except ValidationError as e:
        raise ExportFileInvalid(
            f"line {number}: the {kind} record is invalid ({_problem(e)}); nothing was imported",
            line=number,
        ) from e

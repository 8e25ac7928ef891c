"""ADK events to and from their stored JSON.

:func:`encode` writes an event as ADK's own services do
(``model_dump_json(exclude_none=True)``) and refuses, naming the field, an event
that does not read back equal: what the store keeps is exactly what a later read
gives. :func:`decode_all` reads a session's events back.

**Reading what was validated on the way in.** About two thirds of what ADK's
own ``Event.model_validate_json`` costs is not pydantic's validation but Python
hooks (measured, collector aside: 21 us for a ~1 KB event, 7.5 us without the
hooks; 10 us with the checks below) that do nothing to JSON this module wrote:
google-genai's ``_check_field_type_mismatches`` (a ``mode="before"`` validator
on each of its models that only warns when it is handed a *model instance* of
the wrong class, never the case for parsed JSON),
ADK's ``Event._accept_convenience_kwargs`` (routes the construction keywords
``message``, ``state``, ``route`` and ``node_path``, which are not fields, so
never in an event's JSON) and ``Part.__init__`` (drops keyword arguments that
are None before validating them again, and ``exclude_none`` JSON holds none).
:func:`decode_all` therefore validates with a copy of ``Event``'s own pydantic
core schema with exactly those hooks taken out (every other validator,
default, alias and ``model_post_init`` kept), built once per process, which
gives instances of ADK's real classes. It reads only JSON on which those hooks
provably do nothing: JSON containing ``null`` or any of the keys the convenience
hook acts on (``"message"``, ``"state"``, ``"route"``, ``"node_path"``, even
nested) goes to ADK's own validator, as does JSON the copy refuses (ADK's
decides whether it is damaged). So any JSON, written by :func:`encode` or not,
reads as ADK's own validator reads it. :func:`encode` checks both readers give
the event back. When the schema cannot be copied (another pydantic), ADK's own
validator reads everything; a hook this module does not know stays in the copy.
(pydantic-core would reuse each nested model class's own validator, hooks
included, for a class marked complete: the copy is built with those marks taken
off for the ~3 ms it takes and put back, as pydantic's ``model_rebuild`` does.)

**Garbage collection.** A whole-session read of N events makes about 14 N
container objects that live on, and making them is what triggers the host's
full collections: measured at 5,000 ~1 KB events, one full collection per
whole read, about 110 ms of the ~190 ms the read takes, ADK's own services
paying the same. Pausing the collector during the read only moves that pass
into whatever runs next, so it is not done.

**No cache by default.** A deep copy of an ADK event (what a cache would have to
hand out, each read detached from the others) costs about what decoding its JSON
does (measured: 2,000 ~1 KB events, 82 ms copied against 75 ms decoded) and
makes as many objects for the collector. :class:`SharedEvents` is the opt-in
(``ToubaSessionService(..., share_events=True)``): whole-session reads hand out
the Event objects an earlier read decoded, as ADK's own
``InMemorySessionService`` does under its ``IN_MEMORY_SESSION_SERVICE_LIGHT_COPY``
flag. An event is reused only when the store returns the same id with the same
JSON text, character for character, so a reused event is exactly what decoding
would give, whatever was written, deleted or recreated meanwhile.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import Any

from google.adk.events.event import Event
from pydantic import BaseModel, ValidationError
from pydantic_core import PydanticSerializationError, SchemaValidator

from touba.errors import ConfigurationError, DecisionHistoryRecordInvalid

__all__ = ["SHARED_EVENT_CHARS", "SharedEvents", "decode", "decode_all", "encode"]

SHARED_EVENT_CHARS = 32 * 1024 * 1024

# (module, qualified name) of the hooks that leave JSON written by encode() as it is
# (see the module docstring); any other validator stays in the schema.
_NO_OP_BEFORE = frozenset(
    {
        ("google.genai._common", "BaseModel._check_field_type_mismatches"),
        ("google.adk.events.event", "Event._accept_convenience_kwargs"),
    }
)
_NO_OP_INIT = frozenset({("google.genai.types", "Part")})
# what those hooks can act on: JSON holding any of these is read by ADK's validator
_HOOKED = ("null", '"message"', '"state"', '"route"', '"node_path"')


def _name(obj: Any) -> tuple[str, str]:
    return getattr(obj, "__module__", ""), getattr(obj, "__qualname__", "")


def _strip(node: Any, models: set[type[BaseModel]]) -> Any:
    """A copy of core schema ``node`` without the no-op hooks; collects its model classes."""
    if isinstance(node, dict):
        if node.get("type") == "function-before":
            function = node.get("function")
            if isinstance(function, dict) and _name(function.get("function")) in _NO_OP_BEFORE:
                return _strip(node["schema"], models)
        copied = {k: _strip(v, models) for k, v in node.items()}
        if copied.get("type") == "model":
            cls = copied["cls"]
            models.add(cls)
            if copied.get("custom_init") and _name(cls) in _NO_OP_INIT:
                copied["custom_init"] = False
        return copied
    if isinstance(node, list):
        return [_strip(v, models) for v in node]
    if isinstance(node, tuple):
        return tuple(_strip(v, models) for v in node)
    return node


def _build() -> SchemaValidator | None:
    """``Event``'s validator without the no-op hooks, or None when it cannot be built."""
    models: set[type[BaseModel]] = set()
    try:
        schema = _strip(Event.__pydantic_core_schema__, models)
        # pydantic-core reuses a complete model class's own validator for its nested
        # models (hooks included); it builds from the schema for a class not marked
        # complete. pydantic's model_rebuild() unmarks a class the same way while it
        # rebuilds; the marks are put back at once.
        marks = {cls: cls.__dict__.get("__pydantic_complete__") for cls in models}
        try:
            for cls in models:
                if marks[cls]:
                    type.__setattr__(cls, "__pydantic_complete__", False)
            return SchemaValidator(schema)
        finally:
            for cls, mark in marks.items():
                if mark:
                    type.__setattr__(cls, "__pydantic_complete__", mark)
    except Exception:  # another pydantic or ADK: ADK's own validator reads as before
        return None


_lock = threading.Lock()
_built = False
_fast: SchemaValidator | None = None


def _validator() -> SchemaValidator | None:
    global _built, _fast
    if not _built:
        with _lock:
            if not _built:
                _fast = _build()
                _built = True
    return _fast


def _read(data: str) -> Event:
    """The event ``data`` holds, as ADK's validator gives it; ValidationError if unreadable."""
    fast = _validator()
    if fast is not None and not any(word in data for word in _HOOKED):
        try:
            event = fast.validate_json(data)
        except ValidationError:
            pass  # ADK's own validator decides: it may accept what the copy refuses
        else:
            if type(event) is Event:
                return event
    return Event.model_validate_json(data)


def _unserializable_field(event: Event) -> str:
    for name in Event.model_fields:
        try:
            event.model_dump_json(include={name})
        except PydanticSerializationError:
            return f"event.{name}"
    return "the event"


def _same(back: Event, event: Event) -> bool:
    """Whether ``back`` holds what ``event`` holds, by value.

    Not by class: ADK's streaming gives an event a ``types.ModelContent`` (a subclass of
    ``types.Content``), which JSON reads back as the ``Content`` it is; pydantic's ``==``
    tells the two classes apart. A tuple or a set still differs from the list JSON gives.
    """
    return back == event or back.model_dump() == event.model_dump()


def _differing(back: Event, event: Event) -> str:
    return next(
        (
            name
            for name in Event.model_fields
            if back.model_dump(include={name}) != event.model_dump(include={name})
        ),
        "an unknown field",
    )


def encode(event: Event) -> str:
    """The event's JSON, which decodes back to an event equal to ``event``.

    Raises ``ConfigurationError`` naming the field when the event cannot be
    written as JSON or does not read back equal (by ADK's validator and by
    :func:`decode_all`'s).
    """
    try:
        data = event.model_dump_json(exclude_none=True)
    except PydanticSerializationError as e:
        raise ConfigurationError(
            f"{_unserializable_field(event)} cannot be written as JSON ({e}); nothing was written"
        ) from e
    for back in (Event.model_validate_json(data), _read(data)):
        if not _same(back, event):
            raise ConfigurationError(
                f"event.{_differing(back, event)} does not read back equal from ADK's JSON form "
                "(a tuple, a set or another non-JSON value in it?); nothing was written"
            )
    return data


def decode_all(datas: Sequence[str], session_id: str) -> list[Event]:
    """The Events ``datas`` hold, in order; ``DecisionHistoryRecordInvalid`` for an unreadable one.

    Each is validated by the copy of ADK's schema described in the module docstring.
    """
    try:
        return [_read(data) for data in datas]
    except ValidationError as e:
        raise DecisionHistoryRecordInvalid(
            f"a stored event of session {session_id!r} is not an ADK Event this ADK can "
            "read (written by another version, or damaged); it was left as it is"
        ) from e


def decode(data: str, session_id: str) -> Event:
    """The Event ``data`` holds; ``DecisionHistoryRecordInvalid`` when it is unreadable."""
    return decode_all([data], session_id)[0]


class SharedEvents:
    """Decoded events of recently read sessions, reused while their stored JSON is unchanged.

    Keeps the events of the sessions whose last whole read was most recent, up to
    ``max_chars`` characters of their JSON in all (decoded events take a few times
    that in memory); a session over it is not kept. Not thread-safe: one service
    on one event loop, used between two awaits.
    """

    def __init__(self, max_chars: int = SHARED_EVENT_CHARS) -> None:
        """Keep up to ``max_chars`` characters of event JSON."""
        self._max = max_chars
        self._chars = 0
        self._sessions: OrderedDict[Hashable, tuple[dict[str, tuple[str, Event]], int]] = (
            OrderedDict()
        )

    def events(
        self,
        key: Hashable,
        stored: Sequence[tuple[str, str]],
        session_id: str,
        *,
        whole: bool,
    ) -> list[Event]:
        """The Events of ``stored`` (``(event_id, data)`` pairs, in order).

        An event kept with the same id and the same JSON text is reused (the same
        object); the others are decoded (``DecisionHistoryRecordInvalid`` as
        :func:`decode_all`). A ``whole`` read (every event of the session) then
        replaces what is kept for ``key``.
        """
        kept = self._sessions.get(key)
        known = kept[0] if kept is not None else {}
        events: list[Event | None] = []
        missing: list[int] = []
        for event_id, data in stored:
            hit = known.get(event_id)
            if hit is not None and hit[0] == data:
                events.append(hit[1])
            else:
                missing.append(len(events))
                events.append(None)
        if missing:
            for i, event in zip(
                missing, decode_all([stored[i][1] for i in missing], session_id), strict=True
            ):
                events[i] = event
        decoded = [e for e in events if e is not None]
        if whole:
            self._keep(
                key, {eid: (data, e) for (eid, data), e in zip(stored, decoded, strict=True)}
            )
        elif kept is not None:
            self._sessions.move_to_end(key)
        return decoded

    def forget(self, key: Hashable) -> None:
        """Drop what is kept for ``key`` (a deleted session)."""
        kept = self._sessions.pop(key, None)
        if kept is not None:
            self._chars -= kept[1]

    def _keep(self, key: Hashable, events: dict[str, tuple[str, Event]]) -> None:
        self.forget(key)
        chars = sum(len(data) for data, _ in events.values())
        if chars > self._max:
            return
        self._sessions[key] = (events, chars)
        self._chars += chars
        while self._chars > self._max:
            _, (_, dropped) = self._sessions.popitem(last=False)
            self._chars -= dropped

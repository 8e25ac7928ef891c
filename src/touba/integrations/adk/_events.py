"""ADK events to and from their stored JSON, with a cache of decoded events.

- :func:`encode` writes an event as ADK's own services do
  (``model_dump_json(exclude_none=True)``) and refuses, naming the field, an
  event that does not read back equal: what the store keeps is exactly what a
  later read gives.
- :class:`EventCache` keeps decoded events keyed by their stored JSON text, so
  an entry can never be stale: the same text always decodes to an equal event.
  Decoding an ADK event (pydantic plus google-genai's own field checks) costs
  about three times a deep copy, so a whole-session read of events this
  process has written or read before returns deep copies of cached events
  (each read is detached from every other). Bounded by the bytes of its keys
  (least recently used first out; ``event_cache_bytes`` of the service, 0:
  no cache).
"""

from __future__ import annotations

import copy
from collections import OrderedDict

from google.adk.events.event import Event
from pydantic import ValidationError
from pydantic_core import PydanticSerializationError

from touba.errors import ConfigurationError, DecisionHistoryRecordInvalid

__all__ = ["EventCache", "encode"]

# 16 MiB of event JSON: a 5,000-event session of 1 KB events fits. Each cached event is
# a dozen Python objects that every full garbage collection of the host visits: a
# bigger cache makes those pauses longer (about +30 % here at this size).
DEFAULT_CACHE_BYTES = 16 * 1024 * 1024


def _unserializable_field(event: Event) -> str:
    for name in Event.model_fields:
        try:
            event.model_dump_json(include={name})
        except PydanticSerializationError:
            return f"event.{name}"
    return "the event"


def encode(event: Event) -> tuple[str, Event]:
    """The event's JSON, and the event decoded back from it (equal to ``event``).

    Raises ``ConfigurationError`` naming the field when the event cannot be
    written as JSON or does not read back equal.
    """
    try:
        data = event.model_dump_json(exclude_none=True)
    except PydanticSerializationError as e:
        raise ConfigurationError(
            f"{_unserializable_field(event)} cannot be written as JSON ({e}); nothing was written"
        ) from e
    back = Event.model_validate_json(data)
    if back != event:
        differing = next(
            (name for name in Event.model_fields if getattr(back, name) != getattr(event, name)),
            "an unknown field",
        )
        raise ConfigurationError(
            f"event.{differing} does not read back equal from ADK's JSON form (a tuple, a "
            "set or another non-JSON value in it?); nothing was written"
        )
    return data, back


class EventCache:
    """Decoded events by their JSON text (see the module docstring)."""

    def __init__(self, max_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        self._max_bytes = max_bytes
        self._bytes = 0
        self._events: OrderedDict[str, Event] = OrderedDict()

    def put(self, data: str, event: Event) -> None:
        """Keep ``event`` (which the cache now owns: never hand it out) for ``data``."""
        size = len(data)
        if size > self._max_bytes - self._bytes and size > self._max_bytes // 2:
            return  # never evict half the cache for one event
        if data in self._events:
            return
        self._events[data] = event
        self._bytes += size
        while self._bytes > self._max_bytes:
            old, _ = self._events.popitem(last=False)
            self._bytes -= len(old)

    def decode(self, data: str, session_id: str) -> Event:
        """A new Event equal to ``data``'s; ``DecisionHistoryRecordInvalid`` when unreadable."""
        cached = self._events.get(data)
        if cached is not None:
            self._events.move_to_end(data)
            return copy.deepcopy(cached)
        try:
            event = Event.model_validate_json(data)
        except ValidationError as e:
            raise DecisionHistoryRecordInvalid(
                f"a stored event of session {session_id!r} is not an ADK Event this ADK can "
                "read (written by another version, or damaged); it was left as it is"
            ) from e
        self.put(data, copy.deepcopy(event))
        return event

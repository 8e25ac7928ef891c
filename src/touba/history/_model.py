"""The provider-neutral message model kept in decision history.

Messages are plain frozen dataclasses with a literal ``kind``; each provider
module converts them to and from its wire format at the edge. Provider data
that must round-trip untouched (reasoning items, thinking blocks, signatures)
rides along in ``DecisionMessage.opaque``, tagged with the provider that
produced it, and is only ever replayed to that same provider.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal, NoReturn, TypeAlias

from touba.errors import DecisionHistoryRecordInvalid

__all__ = [
    "CapabilityCall",
    "DataMessage",
    "DecisionMessage",
    "JSON",
    "MAX_JSON_DEPTH",
    "STORED_JSON_DEPTH",
    "Message",
    "Observation",
    "ObservationStatus",
    "ResultMessage",
    "SummaryMessage",
    "canonical_json",
    "json_problem",
    "message_bytes",
    "message_from_dict",
    "message_to_dict",
    "messages_bytes",
    "parse_json",
]

JSON: TypeAlias = Any
"""A JSON-compatible value (dict, list, str, int, float, bool or None)."""

ObservationStatus = Literal["ok", "error", "denied"]


MAX_JSON_DEPTH: Final = 256
"""How deeply a value given to touba (an observation's result, a resource value,
a checkpoint's input) may nest lists and objects. Far below Python's recursion
limit, so that encoding it, keeping it inside a record and reading it back
never meets a ``RecursionError``."""

STORED_JSON_DEPTH: Final = MAX_JSON_DEPTH + 64
"""The same bound for a whole document a store keeps (a record, a checkpoint),
which wraps such values in a few levels of its own."""

# Python's int -> str conversion limit (sys.get_int_max_str_digits, 4300 digits by
# default) makes json.dumps fail on huge ints; below this many bits it cannot.
_SAFE_INT_BITS: Final = 14_000


def canonical_json(value: JSON) -> str:
    """The one serialisation used for sizes, fingerprints and storage.

    Strict JSON: NaN and ±Infinity raise ``ValueError`` (Python would write bare
    ``NaN``, which strict parsers refuse). Check values with :func:`json_problem`
    where they enter touba, to refuse them typed and by name.
    """
    return _ENCODE(value)


# json.dumps with these arguments, without building an encoder at every call.
_ENCODE: Final = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode


def refuse_constant(name: str) -> NoReturn:
    """``parse_constant`` of touba's JSON decoders: NaN and Infinity are not JSON."""
    raise ValueError(f"{name} is not JSON")


_DECODER = json.JSONDecoder(parse_constant=refuse_constant)


def parse_json(text: str | bytes) -> JSON:
    """``json.loads`` for stored text, refusing what touba never writes.

    Python's parser accepts ``NaN`` and ``Infinity``, which JSON does not; this
    raises ``ValueError`` for them, and for nesting too deep to read back
    (``RecursionError`` becomes ``ValueError`` too), so that each store turns
    any of these into its own typed error.
    """
    try:
        if isinstance(text, str):
            return _DECODER.decode(text)
        return json.loads(text, parse_constant=refuse_constant)
    except RecursionError as e:
        raise ValueError("the JSON text nests too deeply to be read") from e


class _Member(int):
    """A dict member in a path, by its position among the keys (never the key itself,
    which may be a name a model or a user chose: content)."""


# touba's own record vocabulary (message_to_dict and the turn traces): a key among these
# is named in a path, since it says where in touba's structure the value sits; any other
# key is given by its position only.
_OWN_KEYS: Final = frozenset(
    {
        "arguments", "call_id", "calls", "covered_exchanges", "data", "decision", "error",
        "final", "fingerprint", "kind", "name", "observations", "opaque", "output",
        "provider", "result", "status", "summary", "text", "trace",
    }
)  # fmt: skip


_Path = tuple[Any, str | int]  # (parent path or None, segment): built only on failure


def _render(path: _Path) -> str:
    parts: list[str] = []
    node: _Path | None = path
    while node is not None:
        parent, segment = node
        if parent is None:
            parts.append(str(segment))
        elif isinstance(segment, _Member):
            parts.append(f"[key {int(segment)}]")
        elif isinstance(segment, str):
            parts.append(f'["{segment}"]')
        else:
            parts.append(f"[{segment}]")
        node = parent
    parts.reverse()
    if len(parts) > 16:  # a path down a deep nesting: its start and its end say enough
        parts = [*parts[:9], "...", *parts[-4:]]
    return "".join(parts)


def _not_text(value: str) -> bool:
    """True for a str holding a lone surrogate: a str, but not storable UTF-8 text."""
    if value.isascii():
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def json_problem(value: object, root: str, *, max_depth: int = MAX_JSON_DEPTH) -> str | None:
    """What makes ``value`` something touba cannot keep as JSON, or None when it can.

    The answer names the first bad value by its path from ``root``, for
    example ``observations[0]["result"][key 2][3] is a set``: list items by
    their index, touba's own record fields (``"calls"``, ``"arguments"``,
    ``"result"``...) by name, any other object member by its position among
    the keys (``[key 2]``, the third), never by the key itself, which may be a
    name a model or a user chose (content has no place in an error text, a log
    or a job's ``last_error``). JSON data is None, a
    bool, an int, a finite float, a str of valid Unicode (no lone surrogate),
    a list or tuple of JSON data, or a dict with str keys and JSON values, at
    most ``max_depth`` lists and dicts deep. Other mappings and sequences,
    sets, bytes, objects, NaN and ±Infinity are refused: none of them comes
    back from storage as it was given. Values made of exactly those types
    (no subclass), the common case, are accepted by a quick recursive check
    (:func:`_plain`); any other value, and any value it does not accept, is
    walked iteratively with paths, so any nesting is checked and named
    without recursion.
    """
    try:
        if _plain(value, max_depth):
            return None
    except RecursionError:  # called from deep in the stack: the walk needs none
        pass
    return _walk_problem(value, root, max_depth)


def _plain(value: Any, depth: int) -> bool:
    """Whether ``value`` is JSON data built of exactly dict, list, tuple, str, int,
    float, bool and None, with fewer than ``depth`` levels of lists and dicts:
    what :func:`json_problem` accepts, without building paths. False says only
    "walk it" (the walk accepts int and str subclasses too, and names the rest)."""
    kind = type(value)
    if kind is str:
        return value.isascii() or not _not_text(value)
    if kind is dict:
        if depth <= 0:
            return False
        for key in value:
            if type(key) is not str or not (key.isascii() or not _not_text(key)):
                return False
        return _all_plain(value.values(), depth - 1)
    if kind is list or kind is tuple:
        return depth > 0 and _all_plain(value, depth - 1)
    if kind is int:
        bits: int = value.bit_length()
        return bits <= _SAFE_INT_BITS
    if kind is float:
        return math.isfinite(value)
    return value is None or kind is bool


def _all_plain(items: Iterable[Any], depth: int) -> bool:
    """:func:`_plain` of every item (a str checked here: no call for each)."""
    for item in items:
        if type(item) is str:
            if not item.isascii() and _not_text(item):
                return False
        elif not _plain(item, depth):
            return False
    return True


def _walk_problem(value: object, root: str, max_depth: int) -> str | None:
    """:func:`json_problem`'s answer, by an iterative walk that names the first bad value."""
    stack: list[tuple[object, int, _Path]] = [(value, 0, (None, root))]
    while stack:
        item, depth, path = stack.pop()
        if item is None or isinstance(item, bool):
            continue
        if isinstance(item, str):
            if _not_text(item):
                return f"{_render(path)} is a str with a lone surrogate, which is not Unicode text"
            continue
        if isinstance(item, int):
            if item.bit_length() > _SAFE_INT_BITS:
                try:
                    int.__repr__(item)
                except ValueError:
                    return f"{_render(path)} is an int too large to write as JSON"
            continue
        if isinstance(item, float):
            if math.isinf(item):  # also a number beyond a double's range: 1e999 parses as inf
                return (
                    f"{_render(path)} is {item!r} (a number beyond a 64-bit float's range), "
                    "which JSON cannot represent"
                )
            if math.isnan(item):
                return f"{_render(path)} is {item!r}, which JSON cannot represent"
            continue
        if isinstance(item, dict | list | tuple):
            if depth >= max_depth:
                return f"{_render(path)} nests lists and objects more than {max_depth} levels deep"
            children: list[tuple[object, int, _Path]] = []
            if isinstance(item, dict):
                for position, (key, child) in enumerate(item.items()):
                    member = (path, _Member(position))
                    if not isinstance(key, str):
                        return (
                            f"{_render(member)} has a key of type {type(key).__name__}; "
                            "JSON object keys are str"
                        )
                    if _not_text(key):
                        return f"{_render(member)} has a key with a lone surrogate"
                    named = (path, key) if key in _OWN_KEYS else member
                    children.append((child, depth + 1, named))
            else:
                children = [(child, depth + 1, (path, i)) for i, child in enumerate(item)]
            stack.extend(reversed(children))  # report the first bad value in document order
            continue
        return (
            f"{_render(path)} is a {type(item).__name__}, which is not JSON data (use dict, "
            "list, str, int, float, bool or None)"
        )
    return None


@dataclass(frozen=True, slots=True)
class CapabilityCall:
    """A call the model proposed: ``call_id`` pairs it with its observation."""

    call_id: str
    name: str
    arguments: Mapping[str, JSON]


@dataclass(frozen=True, slots=True)
class Observation:
    """What the runtime really did with one call (SPEC section 2).

    ``arguments`` are the arguments as the runtime projects them; in
    ``opaque_refs`` continuity they replace the model's raw arguments.
    """

    call_id: str
    name: str
    arguments: Mapping[str, JSON]
    status: ObservationStatus
    result: JSON = None
    error: str | None = None


@dataclass(frozen=True, slots=True)
class DecisionMessage:
    """One model decision: optional text, calls, or a final output.

    ``opaque`` holds the provider's own items for this decision, untouched
    (``None`` when the provider exposed nothing, or in ``opaque_refs`` mode),
    and ``provider`` names who produced them.
    """

    text: str | None = None
    calls: tuple[CapabilityCall, ...] = ()
    output: JSON = None
    final: bool = False
    provider: str | None = None
    opaque: JSON = None
    kind: Literal["decision"] = field(default="decision", init=False)


@dataclass(frozen=True, slots=True)
class ResultMessage:
    """The observation answering one call of the previous decision."""

    call_id: str
    name: str
    arguments: Mapping[str, JSON]
    status: ObservationStatus
    result: JSON = None
    error: str | None = None
    kind: Literal["result"] = field(default="result", init=False)

    @classmethod
    def from_observation(
        cls, observation: Observation, *, arguments: Mapping[str, JSON] | None = None
    ) -> ResultMessage:
        """The result message of ``observation``'s call; ``arguments`` replaces the
        call's arguments when given (a redacted copy, for instance)."""
        return cls(
            call_id=observation.call_id,
            name=observation.name,
            arguments=dict(observation.arguments if arguments is None else arguments),
            status=observation.status,
            result=observation.result,
            error=observation.error,
        )


@dataclass(frozen=True, slots=True)
class SummaryMessage:
    """A host summary of older exchanges, always sent as untrusted user data."""

    text: str
    covered_exchanges: int
    fingerprint: str
    kind: Literal["summary"] = field(default="summary", init=False)


@dataclass(frozen=True, slots=True)
class DataMessage:
    """Observations delivered as plain user-role data, with no call id to pair.

    Used when the calls they answer are not in history (history lost after a
    restart, or ``history=False``): nothing is invented to look like a call.
    """

    observations: tuple[ResultMessage, ...]
    kind: Literal["data"] = field(default="data", init=False)


Message: TypeAlias = DecisionMessage | ResultMessage | SummaryMessage | DataMessage


def message_to_dict(message: Message) -> dict[str, JSON]:
    """The stored (and measured) JSON form of a message."""
    if isinstance(message, DecisionMessage):
        out: dict[str, JSON] = {"kind": "decision"}
        if message.text is not None:
            out["text"] = message.text
        if message.calls:
            out["calls"] = [
                {"call_id": c.call_id, "name": c.name, "arguments": dict(c.arguments)}
                for c in message.calls
            ]
        if message.final:
            out["final"] = True
            out["output"] = message.output
        if message.opaque is not None:
            out["provider"] = message.provider
            out["opaque"] = message.opaque
        return out
    if isinstance(message, DataMessage):
        return {"kind": "data", "observations": [message_to_dict(o) for o in message.observations]}
    if isinstance(message, ResultMessage):
        out = {
            "kind": "result",
            "call_id": message.call_id,
            "name": message.name,
            "arguments": dict(message.arguments),
            "status": message.status,
        }
        if message.result is not None:
            out["result"] = message.result
        if message.error is not None:
            out["error"] = message.error
        return out
    return {
        "kind": "summary",
        "text": message.text,
        "covered_exchanges": message.covered_exchanges,
        "fingerprint": message.fingerprint,
    }


def _str(data: Mapping[str, JSON], key: str) -> str:
    value = data.get(key)
    if not isinstance(value, str):
        raise DecisionHistoryRecordInvalid(
            f"stored message field {key!r} is not a string; the record is corrupt: "
            "inspect it with `touba history show` and delete it if it cannot be repaired"
        )
    return value


def _arguments(data: Mapping[str, JSON]) -> dict[str, JSON]:
    value = data.get("arguments", {})
    if not isinstance(value, dict):
        raise DecisionHistoryRecordInvalid("stored call arguments are not an object")
    return value


def _is_mapping(value: object) -> bool:
    # dict first: parsed JSON is one, and the ABC check costs a call through abc.
    return isinstance(value, (dict, Mapping))  # the tuple stops at dict


def message_from_dict(data: Mapping[str, JSON]) -> Message:
    """Rebuild a message from its stored form; corrupt data is a typed error."""
    if not _is_mapping(data):
        raise DecisionHistoryRecordInvalid("stored message is not an object")
    kind = data.get("kind")
    if kind == "decision":
        raw_calls = data.get("calls", [])
        if not isinstance(raw_calls, list) or not all(_is_mapping(c) for c in raw_calls):
            raise DecisionHistoryRecordInvalid("stored decision calls are not a list of objects")
        calls = tuple(
            CapabilityCall(_str(c, "call_id"), _str(c, "name"), _arguments(c)) for c in raw_calls
        )
        text = data.get("text")
        if text is not None and not isinstance(text, str):
            raise DecisionHistoryRecordInvalid("stored decision text is not a string")
        provider = data.get("provider")
        return DecisionMessage(
            text=text,
            calls=calls,
            output=data.get("output"),
            final=bool(data.get("final", False)),
            provider=provider if isinstance(provider, str) else None,
            opaque=data.get("opaque"),
        )
    if kind == "result":
        status = data.get("status")
        if status not in ("ok", "error", "denied"):
            raise DecisionHistoryRecordInvalid(f"stored result status {status!r} is unknown")
        error = data.get("error")
        return ResultMessage(
            call_id=_str(data, "call_id"),
            name=_str(data, "name"),
            arguments=_arguments(data),
            status=status,
            result=data.get("result"),
            error=error if isinstance(error, str) else None,
        )
    if kind == "data":
        raw = data.get("observations")
        if not isinstance(raw, list):
            raise DecisionHistoryRecordInvalid("stored data message has no observations list")
        observations = tuple(message_from_dict(o) for o in raw)
        if not all(isinstance(o, ResultMessage) for o in observations):
            raise DecisionHistoryRecordInvalid("stored data message holds a non-result")
        return DataMessage(observations)  # type: ignore[arg-type]
    if kind == "summary":
        covered = data.get("covered_exchanges")
        if not isinstance(covered, int):
            raise DecisionHistoryRecordInvalid("stored summary has no covered_exchanges")
        return SummaryMessage(_str(data, "text"), covered, _str(data, "fingerprint"))
    raise DecisionHistoryRecordInvalid(f"stored message kind {kind!r} is unknown")


def message_bytes(message: Message | Mapping[str, JSON]) -> int:
    """SPEC section 3's measure: UTF-8 bytes of the compact JSON of one message."""
    data = message if isinstance(message, Mapping) else message_to_dict(message)
    # surrogatepass: a lone surrogate is measured, not a crash; stores refuse it typed.
    return len(canonical_json(data).encode("utf-8", "surrogatepass"))


def messages_bytes(messages: Sequence[Message | Mapping[str, JSON]]) -> int:
    return sum(message_bytes(m) for m in messages)

"""Read-only JSON values: parsed once, shared by every reader, mutated by none.

A store that keeps parsed messages between decisions (the RAM store) hands
the same objects to every reader, so a reader must not be able to change
them. :func:`freeze` turns a parsed JSON value into one whose dicts and lists
refuse every change (``TypeError``), while still being ``dict`` and ``list``
for ``isinstance`` and for ``json.dumps``. ``copy.copy``, ``copy.deepcopy``
and ``dict(...)`` / ``list(...)`` give plain, mutable copies.
:func:`parse_frozen` parses stored JSON text straight into such values (the
parser builds each object frozen; only lists, when the text has any, are
frozen after).
"""

from __future__ import annotations

import json
from typing import Any, NoReturn

from touba.history._model import refuse_constant

__all__ = ["FrozenDict", "FrozenList", "freeze", "parse_frozen", "thaw"]


def _refuse(*_args: Any, **_kwargs: Any) -> NoReturn:
    raise TypeError(
        "this JSON value is shared, read-only stored state: copy it (copy.deepcopy, dict(...), "
        "list(...)) before changing it"
    )


class FrozenDict(dict[str, Any]):
    """A ``dict`` that refuses changes; its values are frozen too."""

    __slots__ = ()
    __setitem__ = __delitem__ = __ior__ = _refuse
    clear = pop = popitem = setdefault = update = _refuse

    def __copy__(self) -> dict[str, Any]:
        return dict(self)

    def __deepcopy__(self, memo: dict[int, Any]) -> dict[str, Any]:
        return thaw(self)  # type: ignore[no-any-return]

    def __reduce__(self) -> Any:
        return (dict, (dict(self),))

    def __hash__(self) -> int:  # type: ignore[override]  # a dict never hashes
        raise TypeError("unhashable type: 'FrozenDict'")


class FrozenList(list[Any]):
    """A ``list`` that refuses changes; its items are frozen too."""

    __slots__ = ()
    __setitem__ = __delitem__ = __iadd__ = __imul__ = _refuse
    append = clear = extend = insert = pop = remove = reverse = sort = _refuse

    def __copy__(self) -> list[Any]:
        return list(self)

    def __deepcopy__(self, memo: dict[int, Any]) -> list[Any]:
        return thaw(self)  # type: ignore[no-any-return]

    def __reduce__(self) -> Any:
        return (list, (list(self),))

    def __hash__(self) -> int:  # type: ignore[override]
        raise TypeError("unhashable type: 'FrozenList'")


def freeze(value: Any) -> Any:
    """``value`` (parsed JSON) with every dict and list made read-only.

    (The constructors fill them through ``dict``'s and ``list``'s own C code,
    which the refusing Python-level methods do not intercept.)
    """
    if isinstance(value, dict):
        return FrozenDict((key, freeze(item)) for key, item in value.items())
    if isinstance(value, list):
        return FrozenList(freeze(item) for item in value)
    return value


def thaw(value: Any) -> Any:
    """A plain, mutable deep copy of a (possibly frozen) JSON value."""
    if isinstance(value, dict):
        return {key: thaw(item) for key, item in value.items()}
    if isinstance(value, list):
        return [thaw(item) for item in value]
    return value


def _lists_frozen(value: Any) -> Any:
    """``value`` (a list, or a FrozenDict) with its lists made read-only too."""
    if type(value) is list:
        return FrozenList(
            [_lists_frozen(v) if type(v) is list or type(v) is FrozenDict else v for v in value]
        )
    changed: dict[str, Any] | None = None
    for key, item in value.items():
        if type(item) is list or type(item) is FrozenDict:
            new = _lists_frozen(item)
            if new is not item:
                changed = dict(value) if changed is None else changed
                changed[key] = new
    return value if changed is None else FrozenDict(changed)


# The parser builds every object as a FrozenDict itself (no Python call per object).
_DECODER = json.JSONDecoder(parse_constant=refuse_constant, object_pairs_hook=FrozenDict)


def parse_frozen(text: str) -> Any:
    """``freeze(parse_json(text))`` in one pass, as strict as
    :func:`touba.history._model.parse_json` (``ValueError`` for NaN, Infinity,
    nesting too deep, or text that is not JSON)."""
    try:
        value = _DECODER.decode(text)
        if "[" in text and (type(value) is list or type(value) is FrozenDict):
            return _lists_frozen(value)
    except RecursionError as e:
        raise ValueError("the JSON text nests too deeply to be read") from e
    return value  # no "[" in the text: no list anywhere

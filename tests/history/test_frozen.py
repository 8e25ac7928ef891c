"""``parse_frozen``: stored JSON text parsed straight into read-only values."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given

from tests.history._strategies import json_values
from touba.history._frozen import FrozenDict, FrozenList, freeze, parse_frozen
from touba.history._model import parse_json

JSON = json_values(leaves=30)


def read_only(value: Any) -> bool:
    if isinstance(value, dict):
        return type(value) is FrozenDict and all(read_only(v) for v in value.values())
    if isinstance(value, list):
        return type(value) is FrozenList and all(read_only(v) for v in value)
    return True


@given(JSON)
def test_parse_frozen_equals_a_frozen_parse(value: Any) -> None:
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    parsed = parse_frozen(text)
    assert parsed == parse_json(text) == freeze(parse_json(text))
    assert read_only(parsed)


def test_parse_frozen_is_as_strict_as_parse_json() -> None:
    for text in ('{"a": NaN}', "[Infinity]", "{", "[" * 100_000):
        with pytest.raises(ValueError):
            parse_json(text)
        with pytest.raises(ValueError):
            parse_frozen(text)
    with pytest.raises(TypeError):
        parse_frozen('{"a": [1, {"b": [2]}]}')["a"][1]["b"].append(3)

"""JSON Schemas of capability parameters, from their type hints (SPEC section 7).

Supported annotations: ``str``, ``int``, ``float``, ``bool``, ``None``,
unions (``X | None``, ``Optional[X]``), ``list[X]``, ``dict[str, X]``,
``Literal[...]`` of JSON scalars, ``Enum`` subclasses with JSON scalar values,
``TypedDict`` classes and pydantic ``BaseModel`` classes (their
``model_json_schema()``, with ``$defs`` hoisted to the root).
``Annotated[X, "text"]`` adds ``"text"`` as the parameter's description.
Anything else (``Any``, ``object``, bare ``list``/``dict``, callables,
arbitrary classes) is refused with :class:`ConfigurationError` when the
capability is defined, as are ``*args``, ``**kwargs``, positional-only and
unannotated parameters.

One parameter annotated :class:`~touba.runtime.Resources` is left out of the
schema: the model never sees it, and the runtime fills it with the call's
resource handle (:attr:`ParameterSchema.resources` names it).

The schema of the whole parameter list is an object with
``additionalProperties: false``; parameters with a default are not required.
A :class:`Converter` turns validated JSON arguments back into the annotated
Python values (enum members, models) before the function is called.
"""

from __future__ import annotations

import enum
import inspect
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from touba.errors import ConfigurationError
from touba.history._model import JSON, canonical_json
from touba.runtime._resources import Resources

__all__ = ["ArgumentError", "ParameterSchema", "parameters_schema"]

Converter = Callable[[Any], Any]
_SCALARS: dict[type, str] = {bool: "boolean", int: "integer", float: "number", str: "string"}
_JSON_SCALAR = (str, int, float, bool, type(None))


@dataclass(frozen=True, slots=True)
class ParameterSchema:
    """A function's parameters: the JSON Schema and how to convert arguments back."""

    schema: dict[str, JSON]
    converters: Mapping[str, Converter]
    resources: str | None = None

    def convert(self, arguments: Mapping[str, JSON]) -> dict[str, Any]:
        """Python keyword arguments from validated JSON ones (may raise ValueError)."""
        out: dict[str, Any] = {}
        for name, value in arguments.items():
            converter = self.converters.get(name)
            try:
                out[name] = value if converter is None else converter(value)
            except (ValueError, TypeError) as e:
                raise ArgumentError(name, e) from e
        return out


class ArgumentError(ValueError):
    """A JSON argument the annotated Python type refused (a model's validator, say)."""

    def __init__(self, parameter: str, cause: Exception) -> None:
        super().__init__(f"parameter {parameter!r}: {type(cause).__name__}")
        self.parameter = parameter
        self.cause = cause


class _Builder:
    def __init__(self, where: str) -> None:
        self.where = where
        self.defs: dict[str, JSON] = {}
        self._stack: list[type] = []

    def refuse(self, what: str) -> ConfigurationError:
        return ConfigurationError(
            f"{self.where}: {what}. Supported parameter types: str, int, float, bool, None, "
            "X | None, list[X], dict[str, X], Literal[...], Enum, TypedDict and pydantic "
            "BaseModel"
        )

    def schema(self, tp: Any) -> tuple[dict[str, JSON], Converter | None]:
        origin = typing.get_origin(tp)
        args = typing.get_args(tp)
        if origin is typing.Annotated:
            schema, converter = self.schema(args[0])
            notes = [m for m in tp.__metadata__ if isinstance(m, str)]
            if notes:
                schema = {**schema, "description": " ".join(notes)}
            return schema, converter
        if origin is typing.Required or origin is typing.NotRequired:
            return self.schema(args[0])  # a TypedDict key: required-ness is the dict's
        if tp is None or tp is type(None):
            return {"type": "null"}, None
        if isinstance(tp, type) and tp in _SCALARS:
            return {"type": _SCALARS[tp]}, (float if tp is float else None)
        if origin is typing.Literal:
            return self._enum([*args], f"Literal{list(args)!r}"), None
        if origin is typing.Union or origin is types.UnionType:
            return self._union(args)
        if origin is list:
            items, convert = self.schema(args[0]) if args else self._bare(tp)
            return {"type": "array", "items": items}, _each(convert)
        if origin is dict:
            if not args or args[0] is not str:
                raise self.refuse(f"{tp!r} is not supported: use dict[str, X]")
            values, convert = self.schema(args[1])
            return {"type": "object", "additionalProperties": values}, _values(convert)
        if isinstance(tp, type) and issubclass(tp, enum.Enum):
            return self._enum([m.value for m in tp], tp.__name__), tp
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            return self._model(tp), tp.model_validate
        if typing.is_typeddict(tp):
            return self._typeddict(tp)
        if tp in (list, dict):
            return self._bare(tp)
        raise self.refuse(f"{tp!r} has no JSON Schema")

    def _bare(self, tp: Any) -> tuple[dict[str, JSON], Converter | None]:
        raise self.refuse(f"{tp!r} needs its item type, e.g. list[str] or dict[str, int]")

    def _enum(self, values: list[Any], what: str) -> dict[str, JSON]:
        if not values or not all(isinstance(v, _JSON_SCALAR) for v in values):
            raise self.refuse(f"{what} must have JSON scalar values (str, int, float, bool)")
        kinds = {_SCALARS.get(type(v), "null") for v in values}
        schema: dict[str, JSON] = {"enum": values}
        if len(kinds) == 1:
            schema = {"type": kinds.pop(), **schema}
        return schema

    def _union(self, members: tuple[Any, ...]) -> tuple[dict[str, JSON], Converter | None]:
        built = [self.schema(m) for m in members]
        schema: dict[str, JSON] = {"anyOf": [s for s, _ in built]}
        converters = [c for _, c in built if c is not None]
        if not converters:
            return schema, None

        def convert(value: Any) -> Any:
            # None and plain members pass through; the first converter that
            # accepts the value wins (the value already matched the schema).
            if value is None:
                return None
            for converter in converters:
                try:
                    return converter(value)
                except (ValueError, TypeError):
                    continue
            return value

        return schema, convert

    def _model(self, model: type[BaseModel]) -> dict[str, JSON]:
        schema = dict(model.model_json_schema(ref_template="#/$defs/{model}"))
        self._hoist(schema.pop("$defs", {}))
        return schema

    def _hoist(self, defs: Mapping[str, JSON]) -> None:
        for name, definition in defs.items():
            known = self.defs.setdefault(name, definition)
            if canonical_json(known) != canonical_json(definition):
                raise self.refuse(
                    f"two different types are both named {name!r} in the parameters' "
                    "schemas; rename one of them"
                )

    def _typeddict(self, td: Any) -> tuple[dict[str, JSON], Converter | None]:
        if td in self._stack:
            raise self.refuse(f"recursive TypedDict {td.__name__} is not supported")
        self._stack.append(td)
        try:
            hints = _hints(td, self)
            properties: dict[str, JSON] = {}
            converters: dict[str, Converter] = {}
            for key, hint in hints.items():
                properties[key], converter = self.schema(hint)
                if converter is not None:
                    converters[key] = converter
        finally:
            self._stack.pop()
        schema: dict[str, JSON] = {
            "type": "object",
            "properties": properties,
            "required": [k for k in hints if _required_key(td, k, hints[k])],
            "additionalProperties": False,
        }
        if not converters:
            return schema, None
        return schema, lambda v: {k: converters.get(k, _same)(x) for k, x in v.items()}


def _required_key(td: Any, key: str, hint: Any) -> bool:
    # Explicit markers first: with postponed annotations Python 3.11 does not
    # apply them to __required_keys__.
    origin = typing.get_origin(hint)
    if origin is typing.Annotated:
        origin = typing.get_origin(typing.get_args(hint)[0])
    if origin is typing.NotRequired:
        return False
    return origin is typing.Required or key in td.__required_keys__


def _same(value: Any) -> Any:
    return value


def _each(convert: Converter | None) -> Converter | None:
    if convert is None:
        return None
    return lambda v: [convert(x) for x in v]


def _values(convert: Converter | None) -> Converter | None:
    if convert is None:
        return None
    return lambda v: {k: convert(x) for k, x in v.items()}


def _hints(target: Any, builder: _Builder) -> dict[str, Any]:
    try:
        return typing.get_type_hints(target, include_extras=True)
    except (NameError, TypeError) as e:
        raise builder.refuse(f"its type hints cannot be resolved ({e})") from e


def _default(value: Any) -> tuple[bool, JSON]:
    if isinstance(value, enum.Enum):
        value = value.value
    try:
        canonical_json(value)
    except (TypeError, ValueError):
        return False, None
    return True, value


def parameters_schema(function: Callable[..., Any], where: str) -> ParameterSchema:
    """The parameters' JSON Schema object of ``function``; ``where`` names it in errors."""
    builder = _Builder(where)
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError) as e:
        raise builder.refuse(f"its signature cannot be read ({e})") from e
    hints = _hints(function, builder)
    properties: dict[str, JSON] = {}
    required: list[str] = []
    converters: dict[str, Converter] = {}
    resources: str | None = None
    for name, parameter in signature.parameters.items():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            raise builder.refuse(f"*args and **kwargs ({name}) cannot be described to a model")
        if parameter.kind is parameter.POSITIONAL_ONLY:
            raise builder.refuse(f"parameter {name!r} is positional-only; models pass keywords")
        if name not in hints:
            raise builder.refuse(f"parameter {name!r} has no type hint")
        if hints[name] is Resources:
            if resources is not None:
                raise ConfigurationError(
                    f"{where}: parameters {resources!r} and {name!r} are both Resources; keep one"
                )
            resources = name  # filled by the runtime, never by the model
            continue
        builder.where = f"{where}, parameter {name!r}"
        schema, converter = builder.schema(hints[name])
        if parameter.default is parameter.empty:
            required.append(name)
        else:
            ok, default = _default(parameter.default)
            if ok:
                schema = {**schema, "default": default}
        properties[name] = schema
        if converter is not None:
            converters[name] = converter
    result: dict[str, JSON] = {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }
    if builder.defs:
        result["$defs"] = builder.defs
    return ParameterSchema(schema=result, converters=converters, resources=resources)

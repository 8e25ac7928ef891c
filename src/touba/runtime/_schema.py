"""Capability parameters: one pydantic type gives the JSON Schema and checks calls (SPEC section 7).

A capability's parameters become one pydantic type, a ``TypedDict`` with a
key per parameter and extra keys forbidden (a TypedDict rather than a
``create_model`` model: any parameter name works, ``json`` or ``_id`` too).
From that one type come both:

- **the JSON Schema offered to the model**: the type's own JSON Schema, so
  every ``Field`` constraint (``ge``, ``max_length``, ``pattern``, ...),
  ``Annotated`` metadata, defaults, ``Literal`` and ``Enum`` values, and the
  schemas of nested dataclasses, TypedDicts and ``BaseModel`` classes are
  kept. pydantic's automatic titles are left out (a property's name is its
  title; an explicit ``Field(title=...)`` stays) and every ``$ref`` is
  inlined, so each schema is self-contained and reads as one object; only a
  recursive type keeps its definition in a ``$defs`` at the root, which every
  provider touba speaks resolves. ``Annotated[X, "text"]`` on a parameter
  adds ``"text"`` as its description;
- **the check of a call**: the same type validates the call's JSON arguments
  in strict JSON mode (what the schema says, no coercion of ``"5"`` into
  ``5``) and converts them, so a ``date`` parameter receives a ``date``, an
  ``Enum`` a member, a model or a dataclass an instance. Only the arguments
  given are passed: the function's own defaults apply to the others (a
  ``Field(default=...)`` used as a default is resolved here instead).
  A violation is an :class:`ArgumentError` naming the fields and rules it
  broke, never the values given (a validator's own ``ValueError`` message is
  the capability author's wording, and is passed on).

Refused with :class:`ConfigurationError` when the capability is defined:
``Any``, ``object``, ``complex``, bare ``list``/``dict``/``set``/``tuple``,
``dict`` with non-``str`` keys, ``Literal`` and ``Enum`` values that are not
JSON scalars, recursive ``TypedDict`` classes, any type pydantic cannot
describe as JSON Schema (callables, arbitrary classes), and ``*args``,
``**kwargs``, positional-only and unannotated parameters. Types inside
dataclasses and ``BaseModel`` classes are the author's pydantic business and
are taken as pydantic takes them.

One parameter annotated :class:`~touba.runtime.Resources` is left out of the
schema: the model never sees it, and the runtime fills it with the call's
resource handle (:attr:`ParameterSchema.resources` names it).

Capabilities that are not Python functions (invocation tools) bring a JSON
Schema of their own: :meth:`ParameterSchema.from_json_schema` checks their
calls against it with ``jsonschema``, and passes the arguments unchanged.
"""

from __future__ import annotations

import collections.abc
import enum
import inspect
import sys
import types
import typing
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import typing_extensions
from pydantic import ConfigDict, Field, TypeAdapter, ValidationError
from pydantic.errors import PydanticUndefinedAnnotation, PydanticUserError
from pydantic.fields import FieldInfo
from pydantic.json_schema import GenerateJsonSchema, PydanticJsonSchemaWarning
from pydantic_core import PydanticUndefined

from touba.errors import ConfigurationError
from touba.history._model import JSON, canonical_json
from touba.runtime._resources import Resources

__all__ = ["ArgumentError", "ParameterSchema", "parameters_from_fields", "parameters_schema"]

_JSON_SCALAR = (str, int, float, bool, type(None))
_BARE = (list, dict, set, frozenset, tuple)
_SEQUENCES = (list, set, frozenset, tuple, collections.abc.Sequence, collections.abc.Set)
_MAPPINGS = (dict, collections.abc.Mapping)
_SUPPORTED = (
    "str, int, float, bool, None, X | None, list[X], set[X], tuple[X, ...], dict[str, X], "
    "Literal[...], Enum, date, datetime, time, timedelta, UUID, Decimal, dataclasses, "
    "TypedDict, pydantic BaseModel and pydantic's own types, with Annotated[X, Field(...)] "
    "constraints"
)
# pydantic's errors when it cannot build or describe a type (PydanticUserError is a
# RuntimeError; a forward reference it cannot resolve is a NameError).
_PYDANTIC_REFUSALS = (PydanticUserError, PydanticUndefinedAnnotation, TypeError, ValueError)
_CUSTOM_MESSAGES = ("value_error", "assertion_error")
_SCHEMA_KEYWORDS_WITH_SCHEMAS = (
    "items",
    "additionalProperties",
    "propertyNames",
    "not",
    "contains",
    "if",
    "then",
    "else",
)
_SCHEMA_KEYWORDS_WITH_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_KEYWORDS_WITH_MAPS = ("properties", "patternProperties", "$defs", "dependentSchemas")
_MAX_PROBLEMS = 3
_DEFS = "#/$defs/"
# TypedDict's functional form, called with keys known only at run time (typed Any:
# type checkers accept that form only with literal arguments).
_typeddict: Any = typing_extensions.TypedDict


class ArgumentError(ValueError):
    """Arguments the parameters refused; ``problems`` name each field and rule broken."""

    def __init__(self, problems: Sequence[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = tuple(problems)


@dataclass(frozen=True, slots=True)
class ParameterSchema:
    """A capability's parameters: the JSON Schema offered, and the check of a call.

    ``adapter`` is the pydantic type of the parameters (None for a schema
    given as JSON, checked with ``jsonschema``); ``fills`` the parameters
    whose default is a ``Field(...)``, passed explicitly when omitted.
    """

    schema: dict[str, JSON]
    adapter: TypeAdapter[Any] | None = field(default=None, repr=False, compare=False)
    resources: str | None = None
    fills: frozenset[str] = frozenset()

    @classmethod
    def from_json_schema(cls, schema: Mapping[str, JSON]) -> ParameterSchema:
        """Parameters described by a JSON Schema alone (checked, never converted)."""
        return cls(schema=dict(schema))

    def validate(self, arguments: Mapping[str, Any]) -> dict[str, Any]:
        """The Python keyword arguments of a call with these JSON ``arguments``.

        Raises :class:`ArgumentError` naming every field (up to three) that
        breaks a rule: a missing or unknown parameter, a wrong type, a
        constraint, a format, a validator of a model.
        """
        if self.adapter is None:
            return _check_json_schema(self.schema, arguments)
        try:
            text = canonical_json(dict(arguments))
        except (TypeError, ValueError) as e:
            raise ArgumentError(["(root): the arguments are not JSON data"]) from e
        try:
            value = self.adapter.validate_json(text, strict=True)
        except ValidationError as e:
            raise ArgumentError([_problem(error) for error in e.errors()[:_MAX_PROBLEMS]]) from e
        kwargs = dict(value)
        # Defaults pydantic filled in are passed only when the function's own
        # default is a Field(...), which it could not use itself.
        return {k: v for k, v in kwargs.items() if k in arguments or k in self.fills}


def _check_json_schema(schema: Mapping[str, JSON], arguments: Mapping[str, Any]) -> dict[str, Any]:
    from touba.providers._validate import schema_validator

    errors = sorted(schema_validator(schema, "parameters").iter_errors(dict(arguments)), key=str)
    problems = []
    for error in errors[:_MAX_PROBLEMS]:
        path = "/".join(str(p) for p in error.absolute_path) or "(root)"
        problems.append(f"{path}: fails {error.validator!r}")
    if problems:
        raise ArgumentError(problems)
    return dict(arguments)


def _problem(error: Any) -> str:
    """One pydantic error as ``field/path: rule``, without the value given."""
    where = "/".join(str(p) for p in error["loc"]) or "(root)"
    kind = str(error["type"])
    context = error.get("ctx") or {}
    if kind in _CUSTOM_MESSAGES and "error" in context:
        return f"{where}: {context['error']}"  # the capability author's own message
    message = str(error["msg"])
    if "error" in context:  # "Input should be a valid UUID, <what the parser found>"
        detail = f", {context['error']}"
        if not message.endswith(detail):
            return f"{where}: {kind}"
        message = message.removesuffix(detail)
    if "tag" in context:  # quotes the tag given
        return f"{where}: {kind}"
    return f"{where}: {message} ({kind})"


# -- building the type ---------------------------------------------------------------


class _Generator(GenerateJsonSchema):
    """pydantic's JSON Schema without the titles it derives from property names."""

    def field_title_should_be_set(self, schema: Any) -> bool:
        return False


class _Preparer:
    """Checks annotations touba refuses, and makes the rest pydantic-ready.

    On Python < 3.12 pydantic refuses ``typing.TypedDict`` classes: they are
    rebuilt as ``typing_extensions.TypedDict`` with the same keys. Strings in
    ``Annotated`` become the description.
    """

    def __init__(self, where: str) -> None:
        self.where = where
        self._typeddicts: dict[Any, Any] = {}
        self._stack: list[Any] = []

    def refuse(self, what: str) -> ConfigurationError:
        return ConfigurationError(f"{self.where}: {what}. Supported parameter types: {_SUPPORTED}")

    def prepare(self, tp: Any) -> Any:
        origin = typing.get_origin(tp)
        args = typing.get_args(tp)
        if origin is typing.Annotated:
            inner = self.prepare(args[0])
            notes = [m for m in tp.__metadata__ if isinstance(m, str)]
            metadata = [m for m in tp.__metadata__ if not isinstance(m, str)]
            if notes:
                metadata.append(Field(description=" ".join(notes)))
            if not metadata:
                return inner
            return typing.Annotated[(inner, *metadata)]
        if tp is typing.Any or tp is object:
            raise self.refuse(f"{tp!r} has no JSON Schema: give the parameter a type")
        if tp is complex:
            raise self.refuse("complex has no JSON type")
        if tp in _BARE:
            raise self.refuse(
                f"{tp!r} needs its item type, e.g. list[str], set[str] or dict[str, int]"
            )
        if origin is typing.Literal:
            return self._literal(tp, args)
        if origin is typing.Union or origin is types.UnionType:
            members = tuple(self.prepare(m) for m in args)
            return tp if members == args else typing.Union[members]  # noqa: UP007
        if origin in _MAPPINGS:
            if not args or args[0] is not str:
                raise self.refuse(f"{tp!r} is not supported: use dict[str, X]")
            value = self.prepare(args[1])
            return tp if value is args[1] else origin[str, value]
        if origin in _SEQUENCES:
            if not args:
                raise self.refuse(f"{tp!r} needs its item type, e.g. list[str]")
            items = tuple(a if a is Ellipsis else self.prepare(a) for a in args)
            return tp if items == args else origin[items]
        if isinstance(tp, type) and issubclass(tp, enum.Enum):
            if not all(isinstance(m.value, _JSON_SCALAR) for m in tp):
                raise self.refuse(f"{tp.__name__} must have JSON scalar values (str, int, ...)")
            return tp
        if typing_extensions.is_typeddict(tp):
            return self._typeddict(tp)
        return tp  # scalars, dataclasses, models, pydantic types: pydantic's to describe

    def _literal(self, tp: Any, values: tuple[Any, ...]) -> Any:
        for value in values:
            scalar = value.value if isinstance(value, enum.Enum) else value
            if not isinstance(scalar, _JSON_SCALAR):
                raise self.refuse(
                    f"Literal{list(values)!r} must have JSON scalar values (str, int, float, bool)"
                )
        return tp

    def _typeddict(self, td: Any) -> Any:
        if td in self._typeddicts:
            return self._typeddicts[td]
        if td in self._stack:
            raise self.refuse(f"recursive TypedDict {td.__name__} is not supported")
        self._stack.append(td)
        try:
            hints = _hints(td, self)
            keys: dict[str, Any] = {}
            changed = sys.version_info < (3, 12) and type(td).__module__ == "typing"
            for key, hint in hints.items():
                inner = _unwrap_required(hint)
                prepared = self.prepare(inner)
                changed = changed or prepared is not inner
                marker = typing.Required if _required_key(td, key, hint) else typing.NotRequired
                keys[key] = marker[prepared]
        finally:
            self._stack.pop()
        if not changed:
            built = td
        else:
            built = _typeddict(td.__name__, keys)
            built.__module__ = td.__module__
            built.__qualname__ = td.__qualname__
            built.__doc__ = td.__doc__
            config = getattr(td, "__pydantic_config__", None)
            if config is not None:
                built.__pydantic_config__ = config
        self._typeddicts[td] = built
        return built


def _unwrap_required(hint: Any) -> Any:
    """A TypedDict key's type without its ``Required``/``NotRequired`` marker."""
    if typing.get_origin(hint) is typing.Annotated:
        inner = typing.get_args(hint)[0]
        unwrapped = _unwrap_required(inner)
        if unwrapped is inner:
            return hint
        return typing.Annotated[(unwrapped, *hint.__metadata__)]
    if typing.get_origin(hint) in (typing.Required, typing.NotRequired):
        return typing.get_args(hint)[0]
    return hint


def _required_key(td: Any, key: str, hint: Any) -> bool:
    # Explicit markers first: with postponed annotations Python 3.11 does not
    # apply them to __required_keys__.
    origin = typing.get_origin(hint)
    if origin is typing.Annotated:
        origin = typing.get_origin(typing.get_args(hint)[0])
    if origin is typing.NotRequired:
        return False
    return origin is typing.Required or key in td.__required_keys__


def _hints(target: Any, preparer: _Preparer) -> dict[str, Any]:
    try:
        return typing.get_type_hints(target, include_extras=True)
    except (NameError, TypeError) as e:
        raise preparer.refuse(f"its type hints cannot be resolved ({e})") from e


# -- the JSON Schema sent ------------------------------------------------------------


def _json_schema(adapter: TypeAdapter[Any]) -> dict[str, Any]:
    with warnings.catch_warnings():
        # A default that is not JSON data is left out of the schema (the
        # function still gets it): pydantic says so with a warning.
        warnings.simplefilter("ignore", PydanticJsonSchemaWarning)
        return adapter.json_schema(schema_generator=_Generator, mode="validation")


def _self_contained(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with every ``$ref`` inlined except recursive ones, and no class titles.

    A recursive definition stays in the root ``$defs`` (its own non-recursive
    references inlined) and is referenced wherever it is used.
    ``discriminator`` (an OpenAPI keyword pointing into ``$defs``) is dropped:
    the ``oneOf`` and ``const`` it summarises stay.
    """
    definitions: dict[str, Any] = schema.pop("$defs", {})
    recursive = _recursive(definitions)

    def walk(node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        reference = node.get("$ref")
        if isinstance(reference, str) and reference.startswith(_DEFS):
            name = reference.removeprefix(_DEFS)
            siblings = {k: walk(v) for k, v in node.items() if k != "$ref"}
            if name in recursive:
                return {"$ref": reference, **siblings}
            return {**walk(_untitled(definitions[name])), **siblings}
        out: dict[str, Any] = {}
        for key, value in node.items():
            if key == "discriminator":
                continue
            if key in _SCHEMA_KEYWORDS_WITH_SCHEMAS:
                out[key] = walk(value)
            elif key in _SCHEMA_KEYWORDS_WITH_LISTS and isinstance(value, list):
                out[key] = [walk(v) for v in value]
            elif key in _SCHEMA_KEYWORDS_WITH_MAPS and isinstance(value, dict):
                out[key] = {k: walk(v) for k, v in value.items()}
            else:
                out[key] = value
        return out

    result: dict[str, Any] = walk(_untitled(schema))
    if recursive:
        result["$defs"] = {name: walk(_untitled(definitions[name])) for name in sorted(recursive)}
    return result


def _references(node: Any) -> set[str]:
    """The ``$defs`` names ``node`` refers to, at any depth."""
    if isinstance(node, dict):
        found = set().union(*(_references(v) for v in node.values())) if node else set()
        reference = node.get("$ref")
        if isinstance(reference, str) and reference.startswith(_DEFS):
            found.add(reference.removeprefix(_DEFS))
        return found
    if isinstance(node, list):
        return set().union(*(_references(v) for v in node)) if node else set()
    return set()


def _recursive(definitions: Mapping[str, Any]) -> set[str]:
    """The definitions that can reach themselves through references."""
    edges = {name: _references(definition) for name, definition in definitions.items()}
    found: set[str] = set()
    for start in edges:
        seen: set[str] = set()
        todo = list(edges[start])
        while todo:
            name = todo.pop()
            if name == start:
                found.add(start)
                break
            if name not in seen:
                seen.add(name)
                todo.extend(edges.get(name, ()))
    return found


def _untitled(definition: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in definition.items() if k != "title"}


# -- from a signature ----------------------------------------------------------------


def parameters_from_fields(
    fields: Mapping[str, tuple[Any, Any]], where: str, *, resources: str | None = None
) -> ParameterSchema:
    """Parameters from ``{name: (annotation, default)}`` (``inspect.Parameter.empty``:
    required; a ``FieldInfo`` default carries its constraints). ``where`` names
    the capability in errors."""
    preparer = _Preparer(where)
    keys: dict[str, Any] = {}
    fills: set[str] = set()
    for name, (annotation, default) in fields.items():
        preparer.where = f"{where}, parameter {name!r}"
        prepared = preparer.prepare(annotation)
        required = default is inspect.Parameter.empty
        if isinstance(default, FieldInfo):
            prepared = typing.Annotated[prepared, default]
            required = default.default is PydanticUndefined and default.default_factory is None
            fills.add(name)
        elif not required:
            prepared = typing.Annotated[prepared, Field(default=default)]
        keys[name] = (typing.Required if required else typing.NotRequired)[prepared]
    preparer.where = where
    adapter = _adapter(keys, preparer)
    schema = _self_contained(_json_schema(adapter))
    root: dict[str, JSON] = {
        "type": "object",
        "properties": schema.get("properties", {}),
        "required": schema.get("required", []),
        "additionalProperties": False,
    }
    if "$defs" in schema:
        root["$defs"] = schema["$defs"]
    return ParameterSchema(
        schema=root, adapter=adapter, resources=resources, fills=frozenset(fills)
    )


def _adapter(keys: Mapping[str, Any], preparer: _Preparer) -> TypeAdapter[Any]:
    """The TypedDict of the parameters; on a refusal, find the parameter to blame."""

    def build(members: Mapping[str, Any]) -> TypeAdapter[Any]:
        params = _typeddict("Parameters", dict(members))
        params.__pydantic_config__ = ConfigDict(extra="forbid")
        adapter: TypeAdapter[Any] = TypeAdapter(params)
        _json_schema(adapter)  # a type pydantic validates but cannot describe fails here
        return adapter

    try:
        return build(keys)
    except _PYDANTIC_REFUSALS as e:
        where = preparer.where
        for name, annotation in keys.items():
            try:
                build({name: annotation})
            except _PYDANTIC_REFUSALS as one:
                preparer.where = f"{where}, parameter {name!r}"
                raise preparer.refuse(f"its type has no JSON Schema ({_reason(one)})") from one
        raise preparer.refuse(f"its parameters have no JSON Schema ({_reason(e)})") from e


def _reason(error: Exception) -> str:
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def parameters_schema(function: Callable[..., Any], where: str) -> ParameterSchema:
    """The parameters of ``function``; ``where`` names it in errors."""
    preparer = _Preparer(where)
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError) as e:
        raise preparer.refuse(f"its signature cannot be read ({e})") from e
    hints = _hints(function, preparer)
    fields: dict[str, tuple[Any, Any]] = {}
    resources: str | None = None
    for name, parameter in signature.parameters.items():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            raise preparer.refuse(f"*args and **kwargs ({name}) cannot be described to a model")
        if parameter.kind is parameter.POSITIONAL_ONLY:
            raise preparer.refuse(f"parameter {name!r} is positional-only; models pass keywords")
        if name not in hints:
            raise preparer.refuse(f"parameter {name!r} has no type hint")
        if hints[name] is Resources:
            if resources is not None:
                raise ConfigurationError(
                    f"{where}: parameters {resources!r} and {name!r} are both Resources; keep one"
                )
            resources = name  # filled by the runtime, never by the model
            continue
        fields[name] = (hints[name], parameter.default)
    return parameters_from_fields(fields, where, resources=resources)

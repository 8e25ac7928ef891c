"""Program definitions: schemas from type hints, and every definition-time refusal."""

from __future__ import annotations

import enum
import importlib
from collections.abc import Callable
from typing import Annotated, Any, Literal, NotRequired, Optional, TypedDict

import pytest
from pydantic import BaseModel, create_model

import touba
from touba.errors import ConfigurationError
from touba.memory import KeyEventsConfig, MemoryConfig
from touba.runtime import Program, Runtime
from touba.testing import ScriptedProvider


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


class Address(TypedDict):
    street: str
    zip: NotRequired[int]


class Line(BaseModel):
    sku: str
    quantity: int = 1


class Order(BaseModel):
    order_id: str
    lines: list[Line]


class Custom:
    pass


class A(BaseModel):
    x: int


class Wrapper1(BaseModel):
    item: A


A2 = create_model("A", y=(str, ...))  # another model also named A
Wrapper2 = create_model("Wrapper2", item=(A2, ...))


def schema_of(function: Callable[..., Any]) -> dict[str, Any]:
    program = Program()
    program.capability(function)
    return dict(program.capabilities[function.__name__].parameters.schema)


def test_scalars_and_defaults() -> None:
    def f(text: str, count: int, ratio: float, flag: bool, nothing: None, limit: int = 5) -> None:
        """Scalars."""

    schema = schema_of(f)
    assert schema == {
        "type": "object",
        "properties": {
            "text": {"type": "string"},
            "count": {"type": "integer"},
            "ratio": {"type": "number"},
            "flag": {"type": "boolean"},
            "nothing": {"type": "null"},
            "limit": {"type": "integer", "default": 5},
        },
        "required": ["text", "count", "ratio", "flag", "nothing"],
        "additionalProperties": False,
    }


def test_optional_and_unions() -> None:
    def f(a: str | None, b: Optional[int] = None, c: int | str = 1) -> None:  # noqa: UP045
        pass

    properties = schema_of(f)["properties"]
    assert properties["a"] == {"anyOf": [{"type": "string"}, {"type": "null"}]}
    assert properties["b"] == {"anyOf": [{"type": "integer"}, {"type": "null"}], "default": None}
    assert properties["c"] == {"anyOf": [{"type": "integer"}, {"type": "string"}], "default": 1}
    assert schema_of(f)["required"] == ["a"]


def test_containers_literal_enum() -> None:
    def f(
        tags: list[str],
        scores: dict[str, float],
        matrix: list[list[int]],
        mode: Literal["fast", "slow"],
        color: Color = Color.RED,
    ) -> None:
        pass

    properties = schema_of(f)["properties"]
    assert properties["tags"] == {"type": "array", "items": {"type": "string"}}
    assert properties["scores"] == {"type": "object", "additionalProperties": {"type": "number"}}
    assert properties["matrix"] == {
        "type": "array",
        "items": {"type": "array", "items": {"type": "integer"}},
    }
    assert properties["mode"] == {"type": "string", "enum": ["fast", "slow"]}
    assert properties["color"] == {"type": "string", "enum": ["red", "blue"], "default": "red"}


def test_typeddict_and_annotated_description() -> None:
    def f(address: Annotated[Address, "where to ship"]) -> None:
        pass

    assert schema_of(f)["properties"]["address"] == {
        "type": "object",
        "properties": {"street": {"type": "string"}, "zip": {"type": "integer"}},
        "required": ["street"],
        "additionalProperties": False,
        "description": "where to ship",
    }


def test_pydantic_models_are_inlined_into_one_self_contained_schema() -> None:
    def f(order: Order, extra: Line | None = None) -> None:
        pass

    schema = schema_of(f)
    line = {
        "type": "object",
        "properties": {"sku": {"type": "string"}, "quantity": {"type": "integer", "default": 1}},
        "required": ["sku"],
    }
    assert "$defs" not in schema
    assert schema["properties"]["order"] == {
        "type": "object",
        "properties": {
            "order_id": {"type": "string"},
            "lines": {"type": "array", "items": line},
        },
        "required": ["order_id", "lines"],
    }
    assert schema["properties"]["extra"] == {"anyOf": [line, {"type": "null"}], "default": None}


def test_schemas_are_valid_for_the_provider_catalog() -> None:
    program = Program()

    @program.capability
    def f(order: Order, address: Address, color: Color, tags: list[str] | None = None) -> None:
        """Everything at once."""

    program.agent("a", provider=ScriptedProvider(), capabilities=("f",))
    spec = program.agents["a"].specs[0]
    from touba.providers._validate import check_catalog

    check_catalog([spec])
    assert spec.description == "Everything at once."


@pytest.mark.parametrize(
    "annotation",
    [object, Any, list, dict, set, dict[int, str], Callable[[int], int], type, complex],
    ids=str,
)
def test_unsupported_types_are_refused_at_definition(annotation: Any) -> None:
    def f(x: Any) -> None:
        pass

    f.__annotations__["x"] = annotation
    with pytest.raises(ConfigurationError, match="parameter 'x'"):
        Program().capability(f)


def test_unsupported_parameter_kinds_are_refused() -> None:
    def star(*args: int) -> None:
        pass

    def kwargs(**options: int) -> None:
        pass

    def positional(a: int, /) -> None:
        pass

    def untyped(a) -> None:
        pass

    def custom(a: Custom) -> None:
        pass

    def bad_literal(a: Literal[b"x"]) -> None:
        pass

    cases: list[tuple[Callable[..., Any], str]] = [
        (star, r"\*args"),
        (kwargs, r"\*\*kwargs"),
        (positional, "positional-only"),
        (untyped, "no type hint"),
        (custom, "no JSON Schema"),
        (bad_literal, "JSON scalar"),
    ]
    for function, message in cases:
        with pytest.raises(ConfigurationError, match=message):
            Program().capability(function)


def test_two_models_with_one_name_each_keep_their_own_schema() -> None:
    def f(one: Wrapper1, two: Wrapper2) -> None:
        pass

    properties = schema_of(f)["properties"]
    assert properties["one"]["properties"]["item"]["properties"] == {"x": {"type": "integer"}}
    assert properties["two"]["properties"]["item"]["properties"] == {"y": {"type": "string"}}


def test_description_argument_wins_over_docstring() -> None:
    program = Program()

    @program.capability(description="Look an order up.")
    async def lookup(order_id: str) -> str:
        """Docstring."""
        return order_id

    assert program.capabilities["lookup"].description == "Look an order up."
    assert program.capabilities["lookup"].is_async


def test_decorator_returns_the_function_unchanged() -> None:
    program = Program()

    def lookup(order_id: str) -> str:
        return order_id

    assert program.capability(lookup) is lookup
    assert program.capability(name="other")(lookup) is lookup
    assert not program.capabilities["lookup"].is_async


def test_capability_definition_refusals() -> None:
    program = Program()

    def lookup(order_id: str) -> str:
        return order_id

    program.capability(lookup)
    with pytest.raises(ConfigurationError, match="defined twice"):
        program.capability(lookup)
    with pytest.raises(ConfigurationError, match="tuple of strings"):
        program.capability(permissions="orders:read")
    bad_values: list[Any] = [0, -1, True, 1.5]
    for bad in bad_values:
        with pytest.raises(ConfigurationError, match="max_calls"):
            program.capability(max_calls=bad)
    yes: Any = "yes"
    with pytest.raises(ConfigurationError, match="requires_approval"):
        program.capability(requires_approval=yes)
    with pytest.raises(ConfigurationError, match="name"):
        program.capability(name="has space")(lookup)
    with pytest.raises(ConfigurationError, match="function"):
        program.capability(42)  # type: ignore[call-overload]


def test_agent_definition_refusals() -> None:
    program = Program()

    @program.capability
    def lookup(order_id: str) -> str:
        return order_id

    model = ScriptedProvider()
    program.agent("support", provider=model, capabilities=("lookup",))
    cases: list[tuple[dict[str, Any], str]] = [
        ({"name": "support"}, "defined twice"),
        ({"capabilities": ("nope",)}, "unknown capabilities"),
        ({"capabilities": ("lookup", "lookup")}, "twice"),
        ({"kind": "robot"}, "kind"),
        ({"max_decisions": 0}, "max_decisions"),
        ({"max_decisions": True}, "max_decisions"),
        ({"provider": object()}, "decision provider"),
        ({"output_schema": {"type": 12}}, "output_schema"),
        ({"memory": {"short_term_turns": 3}}, "MemoryConfig"),
        ({"grants": "orders:read"}, "tuple of strings"),
        ({"name": "bad name"}, "name"),
    ]
    for change, message in cases:
        arguments: dict[str, Any] = {"name": "other", "provider": model} | change
        name = arguments.pop("name")
        with pytest.raises(ConfigurationError, match=message):
            program.agent(name, **arguments)


def test_agent_keeps_its_settings() -> None:
    program = Program()
    memory = MemoryConfig(
        short_term_turns=3, key_events=KeyEventsConfig(enabled=True, types=("x",))
    )
    agent = program.agent(
        "support",
        provider=ScriptedProvider(),
        instructions="Be brief.",
        grants=("orders:read",),
        kind="agent",
        output_schema={"type": "string"},
        max_decisions=3,
        memory=memory,
    )
    assert agent.memory is memory
    assert agent.kind == "agent"
    assert agent.grants == frozenset({"orders:read"})
    assert program.agents["support"] is agent


def test_delegate_capability_has_one_string_input() -> None:
    program = Program()
    capability = program.delegate("billing", permissions=("billing:ask",))
    assert capability.name == "billing"
    assert capability.delegate == "billing"
    assert capability.parameters.schema == {
        "type": "object",
        "properties": {"input": {"type": "string", "description": "The task for billing."}},
        "required": ["input"],
        "additionalProperties": False,
    }
    assert "billing" in capability.description


def test_delegated_agent_must_exist_when_the_runtime_is_built() -> None:
    program = Program()
    program.delegate("billing")
    program.agent("support", provider=ScriptedProvider(), capabilities=("billing",))
    with pytest.raises(ConfigurationError, match="'billing', which is not defined"):
        Runtime(program)
    program.agent("billing", provider=ScriptedProvider())  # defined later: fine
    Runtime(program)


def test_delegation_cycles_are_refused() -> None:
    program = Program()
    program.delegate("a")
    program.delegate("b")
    program.agent("a", provider=ScriptedProvider(), capabilities=("b",))
    program.agent("b", provider=ScriptedProvider(), capabilities=("a",))
    with pytest.raises(ConfigurationError, match="cycle a -> b -> a"):
        Runtime(program)


def test_program_is_sealed_by_its_runtime() -> None:
    program = Program()
    program.agent("a", provider=ScriptedProvider())
    Runtime(program)
    with pytest.raises(ConfigurationError, match="already used by a Runtime"):
        program.agent("b", provider=ScriptedProvider())
    with pytest.raises(ConfigurationError, match="already used by a Runtime"):
        program.delegate("a")


def test_runtime_refusals() -> None:
    with pytest.raises(ConfigurationError, match="Program"):
        Runtime(object())  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="checkpoint store"):
        Runtime(Program(), checkpoints=object())  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["touba.runtime"])
def test_runtime_surface_is_sorted(name: str) -> None:
    module = importlib.import_module(name)
    assert list(module.__all__) == sorted(module.__all__)
    for symbol in module.__all__:
        assert hasattr(module, symbol)


def test_top_level_reexports() -> None:
    assert touba.Program is Program
    assert touba.Runtime is Runtime
    for symbol in (
        "InvocationResult",
        "MemoryConfig",
        "KeyEventsConfig",
        "ContextConfig",
        "HistoryConfig",
        "HistoryEvent",
        "create_function_decision_provider",
        "create_openai_decision_provider",
    ):
        assert symbol in touba.__all__

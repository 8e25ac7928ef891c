"""Capability parameters as one pydantic type: the schema keeps every constraint, and the
same type checks and converts each call (issue 10, section 3)."""

from __future__ import annotations

import dataclasses
import datetime
import decimal
import enum
import uuid
from typing import Annotated, Any, Literal, NotRequired, TypedDict

import pytest
from pydantic import BaseModel, Field

from tests.runtime._helpers import RawProvider, calls, done, final, step
from touba.errors import AgentDecisionProviderSchemaViolation
from touba.providers._validate import check_catalog
from touba.runtime import Program, Runtime
from touba.testing import ScriptedProvider


class Size(enum.Enum):
    SMALL = "S"
    LARGE = "L"


@dataclasses.dataclass
class Pickup:
    order_id: str
    day: datetime.date


class Parcel(TypedDict):  # typing.TypedDict: pydantic needs typing_extensions' on 3.11
    weight_grams: Annotated[int, Field(gt=0)]
    note: NotRequired[str]


class Node(BaseModel):
    name: str
    children: list[Node] = []


def parameters(function: Any) -> dict[str, Any]:
    program = Program()
    program.capability(function)
    return dict(program.capabilities[function.__name__].parameters.schema)


def test_field_constraints_and_descriptions_reach_the_schema() -> None:
    def search(
        query: Annotated[str, Field(min_length=2, max_length=50, description="what to find")],
        limit: Annotated[int, Field(ge=1, le=100)] = 10,
        code: Annotated[str, Field(pattern=r"^[A-Z]\d$")] = "A1",
        ratio: Annotated[float, Field(gt=0, lt=1)] = 0.5,
        tags: Annotated[list[str], Field(max_length=3)] = (),  # type: ignore[assignment]
    ) -> None:
        pass

    properties = parameters(search)["properties"]
    assert properties["query"] == {
        "type": "string",
        "minLength": 2,
        "maxLength": 50,
        "description": "what to find",
    }
    assert properties["limit"] == {"type": "integer", "minimum": 1, "maximum": 100, "default": 10}
    assert properties["code"]["pattern"] == r"^[A-Z]\d$"
    assert properties["ratio"] == {
        "type": "number",
        "exclusiveMinimum": 0,
        "exclusiveMaximum": 1,
        "default": 0.5,
    }
    assert properties["tags"]["maxItems"] == 3


def test_standard_types_dataclasses_and_typeddicts_have_schemas() -> None:
    def ship(
        day: datetime.date,
        at: datetime.datetime,
        parcel_id: uuid.UUID,
        price: decimal.Decimal,
        size: Size,
        pickup: Pickup,
        parcel: Parcel,
        labels: set[str],
        box: tuple[int, int, int],
        mode: Literal["air", "sea"] = "sea",
    ) -> None:
        pass

    schema = parameters(ship)
    properties = schema["properties"]
    assert properties["day"] == {"type": "string", "format": "date"}
    assert properties["at"] == {"type": "string", "format": "date-time"}
    assert properties["parcel_id"] == {"type": "string", "format": "uuid"}
    assert {"type": "number"} in properties["price"]["anyOf"]
    assert properties["size"] == {"type": "string", "enum": ["S", "L"]}
    assert properties["pickup"] == {
        "type": "object",
        "properties": {"order_id": {"type": "string"}, "day": {"type": "string", "format": "date"}},
        "required": ["order_id", "day"],
        "additionalProperties": False,
    }
    assert properties["parcel"]["properties"]["weight_grams"] == {
        "type": "integer",
        "exclusiveMinimum": 0,
    }
    assert properties["parcel"]["required"] == ["weight_grams"]
    assert properties["labels"] == {
        "type": "array",
        "items": {"type": "string"},
        "uniqueItems": True,
    }
    assert properties["box"]["prefixItems"] == [{"type": "integer"}] * 3
    assert properties["mode"] == {"type": "string", "enum": ["air", "sea"], "default": "sea"}
    assert schema["required"] == [
        "day",
        "at",
        "parcel_id",
        "price",
        "size",
        "pickup",
        "parcel",
        "labels",
        "box",
    ]
    assert "$defs" not in schema


def test_a_recursive_model_keeps_one_definition_at_the_root() -> None:
    def plant(tree: Node) -> None:
        pass

    program = Program()
    program.capability(plant)
    program.agent("a", provider=ScriptedProvider(), capabilities=("plant",))
    spec = program.agents["a"].specs[0]
    check_catalog([spec])  # a valid JSON Schema, its references resolvable
    schema = dict(spec.parameters)
    assert schema["properties"]["tree"] == {"$ref": "#/$defs/Node"}
    node = schema["$defs"]["Node"]
    assert node["properties"]["children"]["items"] == {"$ref": "#/$defs/Node"}
    assert "title" not in node


def test_any_parameter_name_works_and_defaults_that_are_not_json_are_left_out() -> None:
    sentinel = object()

    def odd(
        json: str,
        model_config: int = 1,
        _private: bool = False,
        x: int = sentinel,  # type: ignore[assignment]
    ) -> None:
        pass

    properties = parameters(odd)["properties"]
    assert set(properties) == {"json", "model_config", "_private", "x"}
    assert properties["x"] == {"type": "integer"}  # the default is the function's business


async def test_arguments_are_converted_to_the_annotated_types() -> None:
    program = Program()
    received: dict[str, Any] = {}

    @program.capability
    async def ship(
        day: datetime.date,
        parcel_id: uuid.UUID,
        price: decimal.Decimal,
        pickup: Pickup,
        parcel: Parcel,
        labels: set[str],
        size: Size = Size.SMALL,
        limit: int = Field(7, ge=1),  # a Field as the default
    ) -> str:
        received.update(locals())
        return "ok"

    parcel_id = uuid.uuid4()
    arguments = {
        "day": "2025-03-01",
        "parcel_id": str(parcel_id),
        "price": "12.50",
        "pickup": {"order_id": "A1", "day": "2025-03-02"},
        "parcel": {"weight_grams": 900},
        "labels": ["fragile", "up"],
    }
    model = ScriptedProvider(step(("c", "ship", arguments)), final("done"))
    program.agent("a", provider=model, capabilities=("ship",))
    result = await Runtime(program).invoke("a")

    assert result.status == "completed", result.error
    assert received["day"] == datetime.date(2025, 3, 1)
    assert received["parcel_id"] == parcel_id
    assert received["price"] == decimal.Decimal("12.50")
    assert received["pickup"] == Pickup("A1", datetime.date(2025, 3, 2))
    assert received["parcel"] == {"weight_grams": 900}
    assert received["labels"] == {"fragile", "up"}
    assert received["size"] is Size.SMALL  # omitted: the function's own default
    assert received["limit"] == 7  # a Field default is resolved, never passed as a FieldInfo


@pytest.mark.parametrize(
    ("arguments", "names"),
    [
        ({"count": 5000}, "count: Input should be less than or equal to 100"),
        ({"count": "5"}, "count: Input should be a valid integer"),  # strict: no coercion
        ({"count": 5, "color": "green"}, "color: Input should be 'red' or 'blue'"),
        ({"count": 5, "day": "2025-02-30"}, "day: Input should be a valid date in the format"),
        ({"count": 5, "extra": 1}, "extra: Extra inputs are not permitted"),
        ({}, "count: Field required"),
        ({"count": 5, "pickup": {"order_id": "A1", "day": "Sunday"}}, "pickup/day"),
    ],
)
async def test_a_violation_is_denied_naming_the_field_and_never_runs(
    arguments: dict[str, Any], names: str
) -> None:
    program = Program()
    ran: list[int] = []

    @program.capability
    async def order(
        count: Annotated[int, Field(ge=1, le=100)],
        color: Literal["red", "blue"] = "red",
        day: datetime.date | None = None,
        pickup: Pickup | None = None,
    ) -> None:
        ran.append(count)

    model = RawProvider(calls(("c", "order", arguments)), done("ok"))
    program.agent("a", provider=model, capabilities=("order",))
    result = await Runtime(program).invoke("a")

    assert ran == []
    (denial,) = result.trace.of_kind("denial")
    assert denial["reason"] == "invalid_arguments"
    (observation,) = model.requests[1].observations
    assert observation.status == "denied"
    assert names in str(observation.error)
    for value in ("5000", "green", "Sunday", "2025-02-30"):
        assert value not in str(observation.error)


async def test_a_validating_provider_refuses_what_the_schema_says_and_the_runtime_the_rest() -> (
    None
):
    """Constraints in the JSON Schema are checked by the provider (SPEC section 2: a call
    that does not match its schema is a schema violation); what JSON Schema cannot say
    (a date that does not exist, a model's validator) is the runtime's denial."""
    program = Program()
    ran: list[Any] = []

    @program.capability
    async def book(count: Annotated[int, Field(le=100)], day: datetime.date) -> None:
        ran.append((count, day))

    program.agent(
        "too_many",
        provider=ScriptedProvider(step(("c", "book", {"count": 5000, "day": "2025-03-01"}))),
        capabilities=("book",),
    )
    model = ScriptedProvider(step(("c", "book", {"count": 5, "day": "2025-02-30"})), final("ok"))
    program.agent("bad_day", provider=model, capabilities=("book",))
    runtime = Runtime(program)

    refused = await runtime.invoke("too_many")
    assert isinstance(refused.error, AgentDecisionProviderSchemaViolation)
    assert refused.error.provider_error_code == "arguments_schema_mismatch"
    denied = await runtime.invoke("bad_day")
    assert denied.status == "completed"
    assert [d["reason"] for d in denied.trace.of_kind("denial")] == ["invalid_arguments"]
    assert ran == []

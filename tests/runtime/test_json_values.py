"""NaN, ±Infinity and other non-JSON values never enter a checkpoint, a resource or history.

Python would write them as bare ``NaN`` (which ``touba history show --json``
would then print and strict parsers refuse). A capability that returns one
gets an ``error`` observation naming where it is; an input, a checkpoint or a
resource value holding one is a ``ConfigurationError`` naming its path, with
nothing written.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from touba.errors import ConfigurationError
from touba.runtime import (
    MemoryCheckpointStore,
    MemoryResourceBinding,
    Program,
    Runtime,
    SqliteCheckpointStore,
    SqliteResourceBinding,
)
from touba.runtime._resources import ResourceAddress
from touba.testing import ScriptedProvider

from ._helpers import final, step

BAD = [math.nan, math.inf, -math.inf]


@pytest.mark.parametrize("bad", BAD, ids=repr)
async def test_a_capability_returning_nan_gets_an_error_observation(bad: float) -> None:
    program = Program()

    @program.capability
    async def measure(item: str) -> dict[str, Any]:
        return {"item": item, "readings": [1.0, bad]}

    model = ScriptedProvider(step(("c1", "measure", {"item": "A1"})), final("ok"))
    program.agent("agent", provider=model, capabilities=("measure",))
    result = await Runtime(program).invoke("agent", input="measure A1")
    assert result.status == "completed"
    [observation] = model.requests[1].observations
    assert observation.status == "error"
    assert observation.result is None
    assert observation.error is not None
    assert f"result[key 1][1] is {bad!r}" in observation.error


async def test_an_input_holding_nan_is_refused_by_path() -> None:
    program = Program()
    program.agent("agent", provider=ScriptedProvider(final("never")))
    with pytest.raises(ConfigurationError, match=r"input\[key 0\] is nan"):
        await Runtime(program).invoke("agent", input={"when": math.nan})


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
async def test_checkpoint_stores_refuse_nan_by_path(kind: str, tmp_path: Path) -> None:
    store: Any = (
        MemoryCheckpointStore() if kind == "memory" else SqliteCheckpointStore(tmp_path / "c.db")
    )
    await store.save("a", {"revision": 0, "input": 1})
    for bad in BAD:
        with pytest.raises(ConfigurationError, match=r"checkpoint\[key \d\]\[key 0\]"):
            await store.save("b", {"input": {"x": bad}})
        with pytest.raises(ConfigurationError, match=r"checkpoint\[key \d\]\[key 0\]"):
            await store.replace("a", {"revision": 1, "input": {"x": bad}}, revision=0)
    assert await store.get("b") is None
    assert await store.get("a") == {"revision": 0, "input": 1}
    if kind == "sqlite":
        await store.close()


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
async def test_resource_bindings_refuse_nan_by_path(kind: str, tmp_path: Path) -> None:
    binding: Any = (
        MemoryResourceBinding() if kind == "memory" else SqliteResourceBinding(tmp_path / "r.db")
    )
    address = ResourceAddress("notes", "user", "u1")
    for bad in BAD:
        with pytest.raises(ConfigurationError, match=r"value\[key 0\] is"):
            await binding.put(address, "k", {"score": bad})
    assert await binding.get(address, "k") is None
    if kind == "sqlite":
        await binding.close()


async def test_a_bad_value_is_named_by_position_never_by_a_key_the_model_chose() -> None:
    """A key is content (a model or a user chose it): the path gives its position only."""
    program = Program()

    @program.capability
    async def measure(item: str) -> dict[str, Any]:
        return {"fine": 1, "SECRET-sk-live": {"nested-SECRET": [0, math.nan]}}

    model = ScriptedProvider(step(("c1", "measure", {"item": "A1"})), final("ok"))
    program.agent("agent", provider=model, capabilities=("measure",))
    await Runtime(program).invoke("agent", input="measure A1")
    [observation] = model.requests[1].observations
    assert observation.error is not None
    assert "result[key 1][key 0][1] is nan" in observation.error
    assert "SECRET" not in observation.error

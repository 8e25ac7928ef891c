"""InvocationContext: prior turns, extra instructions and per-invocation tools."""

from __future__ import annotations

from typing import Any

import pytest

from touba.errors import ConfigurationError
from touba.history import CapabilityCall
from touba.providers import CapabilitySpec, TraceCall, Turn
from touba.runtime import InvocationContext, InvocationTool, Program, Runtime, ToolCall
from touba.testing import ScriptedProvider

from ._helpers import RawProvider, calls, done, final, step

NOTE = CapabilitySpec(
    "note",
    "Write a note.",
    {
        "type": "object",
        "properties": {"text": {"type": "string", "maxLength": 10}},
        "required": ["text"],
        "additionalProperties": False,
    },
)
TURN = Turn("earlier?", ("earlier!",), ((TraceCall("t0", "lookup", {"q": "x"}, "ok", 1),),))


def recording_tool(seen: list[ToolCall], *, fail: Exception | None = None) -> InvocationTool:
    async def handler(call: ToolCall) -> Any:
        seen.append(call)
        if fail is not None:
            raise fail
        return {"noted": call.call.arguments["text"]}

    return InvocationTool(NOTE, handler)


def make(model: ScriptedProvider | RawProvider, *, delegate: bool = False) -> Runtime:
    program = Program()

    @program.capability
    async def lookup(q: str) -> str:
        return f"found {q}"

    catalog: tuple[str, ...] = ("lookup",)
    if delegate:
        program.delegate("helper")
        program.agent("helper", provider=model, instructions="Help.")
        catalog = ("lookup", "helper")
    program.agent("support", provider=model, instructions="Be kind.", capabilities=catalog)
    return Runtime(program)


async def test_the_context_reaches_every_decision_and_its_tools_run_checked() -> None:
    model = RawProvider(  # validates nothing: the runtime's checks must
        calls(("c1", "note", {"text": "hi"}), ("c2", "note", {"text": "far too long text"})),
        done("done"),
    )
    seen: list[ToolCall] = []
    context = InvocationContext(
        prior_turns=(TURN,), instructions="[data block]", tools=(recording_tool(seen),)
    )
    result = await make(model).invoke("support", input="go", run_id="r1", context=context)
    assert result.status == "completed"
    for request in model.requests:
        assert request.prior_turns == (TURN,)
        assert request.instructions == "Be kind.\n\n[data block]"
        assert [c.name for c in request.capabilities] == ["lookup", "note"]
    [only] = seen  # the second call was refused by the schema check, not run
    assert (only.run_id, only.invocation_id, only.decision) == ("r1", result.invocation_id, 1)
    assert only.call == CapabilityCall("c1", "note", {"text": "hi"})
    first, second = model.requests[1].observations
    assert (first.status, first.result) == ("ok", {"noted": "hi"})
    assert second.status == "denied"
    assert "maxLength" in (second.error or "")
    [started] = result.trace.of_kind("invocation_started")
    assert (started["prior_turns"], started["tools"]) == (1, ["note"])


async def test_a_tool_that_raises_is_an_error_observation() -> None:
    model = ScriptedProvider(step(("c1", "note", {"text": "hi"})), final("sorry"))
    context = InvocationContext(tools=(recording_tool([], fail=ValueError("no room left")),))
    result = await make(model).invoke("support", input="go", context=context)
    [observation] = model.requests[1].observations
    assert observation.status == "error"
    assert observation.error == "ValueError: no room left"
    assert result.status == "completed"


async def test_without_context_nothing_changes_and_tools_are_unknown() -> None:
    model = RawProvider(calls(("c1", "note", {"text": "hi"})), done("ok"))
    await make(model).invoke("support", input="go")
    assert model.requests[0].prior_turns == ()
    assert model.requests[0].instructions == "Be kind."
    [denied] = model.requests[1].observations
    assert denied.status == "denied"


async def test_a_delegated_agent_gets_none_of_the_context() -> None:
    model = ScriptedProvider(
        step(("c1", "helper", {"input": "sub task"})), final("sub done"), final("all done")
    )
    context = InvocationContext(prior_turns=(TURN,), instructions="[block]")
    await make(model, delegate=True).invoke("support", input="go", context=context)
    child = model.requests[1]
    assert child.agent_ref == "helper"
    assert (child.prior_turns, child.instructions, child.capabilities) == ((), "Help.", ())


async def test_resume_takes_the_context_again() -> None:
    program = Program()

    @program.capability(requires_approval=True)
    async def pay(invoice: str) -> str:
        return "paid"

    model = ScriptedProvider(step(("c1", "pay", {"invoice": "I-1"})), final("paid"))
    program.agent("billing", provider=model, capabilities=("pay",))
    runtime = Runtime(program)
    context = InvocationContext(prior_turns=(TURN,), instructions="[block]")
    paused = await runtime.invoke("billing", input="pay", context=context)
    assert paused.status == "awaiting_approval"
    done = await runtime.resume(paused.checkpoint_id or "", {"c1": True}, context=context)
    assert done.status == "completed"
    assert model.requests[1].prior_turns == (TURN,)
    assert model.requests[1].instructions == "[block]"


async def test_misused_contexts_are_refused_before_anything_runs() -> None:
    model = ScriptedProvider()
    runtime = make(model)
    clash = InvocationTool(
        CapabilitySpec("lookup", "", NOTE.parameters), recording_tool([]).handler
    )
    with pytest.raises(ConfigurationError, match="names of program capabilities"):
        await runtime.invoke("support", input="go", context=InvocationContext(tools=(clash,)))
    with pytest.raises(ConfigurationError, match="InvocationContext"):
        await runtime.invoke("support", input="go", context="not a context")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="offered twice"):
        InvocationContext(tools=(recording_tool([]), recording_tool([])))
    bad = InvocationTool(CapabilitySpec("bad", "", {"type": "string"}), recording_tool([]).handler)
    with pytest.raises(ConfigurationError, match="JSON Schema object"):
        InvocationContext(tools=(bad,))
    with pytest.raises(ConfigurationError, match="Turns"):
        InvocationContext(prior_turns=("hello",))  # type: ignore[arg-type]
    assert model.requests == []

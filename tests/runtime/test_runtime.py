"""The decision loop: checks on every call, concurrency, errors, budgets."""

from __future__ import annotations

import asyncio
import enum
import threading
from typing import Any

import pytest
from pydantic import BaseModel, field_validator

from touba.errors import (
    AgentBudgetExceeded,
    AgentDecisionProviderSchemaViolation,
    AgentDecisionProviderUnavailable,
    ConfigurationError,
    DecisionHistorySummaryInvalid,
)
from touba.history import HistoryConfig, SummaryRequest
from touba.providers import Decision, DecisionRequest, Observation
from touba.runtime import Program, Runtime
from touba.testing import ScriptedProvider

from ._helpers import RawProvider, calls, done, final, step


def observations(provider: ScriptedProvider | RawProvider, index: int) -> list[Observation]:
    return list(provider.requests[index].observations)


def make_program() -> tuple[Program, list[str]]:
    program = Program()
    seen: list[str] = []

    @program.capability(permissions=("orders:read",))
    async def lookup_order(order_id: str) -> dict[str, str]:
        """Find an order."""
        seen.append(order_id)
        return {"order_id": order_id, "status": "shipped"}

    @program.capability(permissions=("orders:write",))
    async def cancel_order(order_id: str) -> str:
        seen.append(f"cancel {order_id}")
        return "cancelled"

    return program, seen


async def test_a_call_runs_and_its_observation_goes_back_to_the_model() -> None:
    program, seen = make_program()
    model = ScriptedProvider(step(("c1", "lookup_order", {"order_id": "A1"})), final("shipped"))
    program.agent(
        "support", provider=model, capabilities=("lookup_order",), grants=("orders:read",)
    )
    result = await Runtime(program).invoke("support", input="Where is A1?", run_id="run-1")
    assert result.status == "completed"
    assert result.output == "shipped"
    assert result.error is None
    assert (result.run_id, result.agent_ref) == ("run-1", "support")
    assert seen == ["A1"]
    [observation] = observations(model, 1)
    assert observation.status == "ok"
    assert observation.result == {"order_id": "A1", "status": "shipped"}
    first = model.requests[0]
    assert (first.run_id, first.invocation_id, first.agent_ref) == (
        "run-1",
        result.invocation_id,
        "support",
    )
    assert first.input == "Where is A1?"
    assert [c.name for c in first.capabilities] == ["lookup_order"]


async def test_same_input_gives_distinct_invocation_ids() -> None:
    program = Program()
    model = ScriptedProvider(final("a"), final("a"))
    program.agent("a", provider=model)
    runtime = Runtime(program)
    one = await runtime.invoke("a", input="same")
    two = await runtime.invoke("a", input="same", run_id=one.run_id)
    assert one.invocation_id != two.invocation_id
    assert one.run_id == two.run_id


async def test_permission_denied_goes_back_as_a_denied_observation() -> None:
    program, seen = make_program()
    model = ScriptedProvider(step(("c1", "cancel_order", {"order_id": "A1"})), final("cannot"))
    program.agent(
        "support",
        provider=model,
        capabilities=("lookup_order", "cancel_order"),
        grants=("orders:read",),
    )
    result = await Runtime(program).invoke("support", input="cancel A1")
    assert result.status == "completed"
    assert seen == []
    [observation] = observations(model, 1)
    assert observation.status == "denied"
    assert observation.error is not None
    assert "orders:write" in observation.error
    [denial] = result.trace.of_kind("denial")
    assert denial["reason"] == "permission_denied"


async def test_unknown_capability_and_invalid_arguments_are_denied() -> None:
    # A host provider that validates nothing: the runtime's own checks refuse.
    program, seen = make_program()
    model = RawProvider(
        calls(
            ("c1", "delete_everything", {}),
            ("c2", "lookup_order", {"order_id": 42}),
            ("c3", "lookup_order", {"order_id": "A1", "extra": "x"}),
            ("c4", "lookup_order", {}),
            ("c5", "cancel_order", {"order_id": "A1"}),  # defined, not in this catalog
        ),
        done("ok"),
    )
    program.agent(
        "support", provider=model, capabilities=("lookup_order",), grants=("orders:read",)
    )
    result = await Runtime(program).invoke("support")
    assert result.status == "completed"
    assert seen == []
    answers = {o.call_id: o for o in observations(model, 1)}
    assert all(o.status == "denied" for o in answers.values())
    reasons = {d["call_id"]: d["reason"] for d in result.trace.of_kind("denial")}
    assert reasons == {
        "c1": "unknown_capability",
        "c2": "invalid_arguments",
        "c3": "invalid_arguments",
        "c4": "invalid_arguments",
        "c5": "unknown_capability",
    }
    assert "42" not in str(answers["c2"].error)  # the rule, never the value


async def test_budget_counts_calls_and_identical_calls_are_allowed_while_it_lasts() -> None:
    program = Program()
    runs: list[str] = []

    @program.capability(max_calls=2)
    async def ping(target: str) -> str:
        runs.append(target)
        return "pong"

    same = ("ping", {"target": "x"})
    model = ScriptedProvider(
        step(("c1", *same)),
        step(("c2", *same), ("c3", *same)),  # the second of these exceeds the budget
        step(("c4", *same)),
        final("done"),
    )
    program.agent("a", provider=model, capabilities=("ping",))
    result = await Runtime(program).invoke("a")
    assert result.status == "completed"
    assert runs == ["x", "x"]
    assert [o.status for o in observations(model, 2)] == ["ok", "denied"]
    assert [o.status for o in observations(model, 3)] == ["denied"]
    assert {d["reason"] for d in result.trace.of_kind("denial")} == {"budget_exhausted"}


async def test_unlimited_identical_calls_all_run() -> None:
    program = Program()
    runs: list[int] = []

    @program.capability
    def tick(n: int) -> int:
        runs.append(n)
        return n

    model = ScriptedProvider(*[step((f"c{i}", "tick", {"n": 1})) for i in range(4)], final(None))
    program.agent("a", provider=model, capabilities=("tick",))
    assert (await Runtime(program).invoke("a")).status == "completed"
    assert runs == [1, 1, 1, 1]


async def test_calls_of_one_decision_run_concurrently() -> None:
    program = Program()
    barrier = asyncio.Barrier(2)

    @program.capability
    async def meet(who: str) -> str:
        async with asyncio.timeout(5):  # sequential calls would never both arrive
            await barrier.wait()
        return who

    model = ScriptedProvider(
        step(("c1", "meet", {"who": "a"}), ("c2", "meet", {"who": "b"})), final("met")
    )
    program.agent("a", provider=model, capabilities=("meet",))
    result = await Runtime(program).invoke("a")
    assert result.status == "completed"
    assert [(o.call_id, o.result) for o in observations(model, 1)] == [("c1", "a"), ("c2", "b")]


async def test_sync_capabilities_run_in_threads_concurrently() -> None:
    program = Program()
    barrier = threading.Barrier(2, timeout=5)
    threads: list[int] = []

    @program.capability
    def meet(who: str) -> str:
        threads.append(threading.get_ident())
        barrier.wait()
        return who

    model = ScriptedProvider(
        step(("c1", "meet", {"who": "a"}), ("c2", "meet", {"who": "b"})), final("met")
    )
    program.agent("a", provider=model, capabilities=("meet",))
    result = await Runtime(program).invoke("a")
    assert result.status == "completed"
    assert threading.get_ident() not in threads
    assert len(set(threads)) == 2


class Priority(enum.Enum):
    LOW = "low"
    HIGH = "high"


class Ticket(BaseModel):
    title: str

    @field_validator("title")
    @classmethod
    def no_shouting(cls, value: str) -> str:
        if value.isupper():
            raise ValueError("no shouting")
        return value


async def test_arguments_are_converted_to_the_annotated_types() -> None:
    program = Program()
    received: list[Any] = []

    @program.capability
    async def open_ticket(
        ticket: Ticket, priority: Priority, tags: list[Priority] | None = None
    ) -> dict[str, Any]:
        received.extend([ticket, priority, tags])
        return {"ticket": ticket, "priority": priority}  # models and enums become JSON

    model = ScriptedProvider(
        step(
            (
                "c1",
                "open_ticket",
                {"ticket": {"title": "Broken"}, "priority": "high", "tags": ["low"]},
            )
        ),
        step(("c2", "open_ticket", {"ticket": {"title": "BROKEN"}, "priority": "low"})),
        final("ok"),
    )
    program.agent("a", provider=model, capabilities=("open_ticket",))
    result = await Runtime(program).invoke("a")
    assert result.status == "completed"
    assert received == [Ticket(title="Broken"), Priority.HIGH, [Priority.LOW]]
    [ok] = observations(model, 1)
    assert ok.result == {"ticket": {"title": "Broken"}, "priority": "high"}
    [refused] = observations(model, 2)
    assert refused.status == "denied"
    assert "ticket/title: no shouting" in str(refused.error)  # the validator's own words
    assert "BROKEN" not in str(refused.error)


async def test_a_raising_capability_is_an_error_observation() -> None:
    program = Program()

    @program.capability
    async def explode(size: int) -> None:
        raise RuntimeError("boom " + "x" * 2000)

    @program.capability
    def opaque() -> object:
        return object()

    model = ScriptedProvider(
        step(("c1", "explode", {"size": 1}), ("c2", "opaque", {})), final("handled")
    )
    program.agent("a", provider=model, capabilities=("explode", "opaque"))
    result = await Runtime(program).invoke("a")
    assert result.status == "completed"
    boom, weird = observations(model, 1)
    assert boom.status == "error"
    assert boom.error is not None
    assert boom.error.startswith("RuntimeError: boom x")
    assert len(boom.error) < 600
    assert weird.status == "error"
    assert "not JSON data" in str(weird.error)


async def test_max_decisions_exhausted_fails_with_a_typed_error() -> None:
    program = Program()
    runs: list[int] = []

    @program.capability
    async def again(n: int) -> int:
        runs.append(n)
        return n

    model = ScriptedProvider(*[step((f"c{i}", "again", {"n": i})) for i in range(3)])
    program.agent("a", provider=model, capabilities=("again",), max_decisions=3)
    result = await Runtime(program).invoke("a")
    assert result.status == "failed"
    assert isinstance(result.error, AgentBudgetExceeded)
    assert result.error.max_decisions == 3
    assert "max_decisions=3" in str(result.error)
    assert runs == [0, 1]  # the last decision's calls are not run: nobody would read them
    assert len(model.requests) == 3
    [failed] = result.trace.of_kind("invocation_failed")
    assert failed["error_code"] == "AgentBudgetExceeded"


async def test_provider_errors_fail_the_invocation_with_their_code() -> None:
    program = Program()
    # A call the provider's own validation refuses (not in the catalog).
    model = ScriptedProvider(step(("c1", "nope", {})))
    program.agent("a", provider=model)
    result = await Runtime(program).invoke("a")
    assert result.status == "failed"
    assert isinstance(result.error, AgentDecisionProviderSchemaViolation)
    [error] = result.trace.of_kind("provider_error")
    assert error["provider_error_code"] == "unknown_capability"
    assert error["error_code"] == "AgentDecisionProviderSchemaViolation"

    empty = Program()
    empty.agent("a", provider=ScriptedProvider())  # no step left: unavailable
    result = await Runtime(empty).invoke("a")
    assert isinstance(result.error, AgentDecisionProviderUnavailable)
    assert result.trace.of_kind("provider_error")[0]["provider_error_code"] is None


async def test_a_host_provider_that_misbehaves_fails_cleanly() -> None:
    class Broken:
        async def decide(self, request: DecisionRequest) -> Decision:
            raise KeyError("secret-ish detail")

    class Wrong:
        async def decide(self, request: DecisionRequest) -> Any:
            return {"action": "final"}

    program = Program()
    program.agent("broken", provider=Broken())
    program.agent("wrong", provider=Wrong())
    program.agent(
        "dupes", provider=RawProvider(calls(("c1", "x", {}), ("c1", "x", {}))), capabilities=()
    )
    program.agent("typed", provider=RawProvider(done(3)), output_schema={"type": "string"})
    runtime = Runtime(program)
    broken = await runtime.invoke("broken")
    assert isinstance(broken.error, AgentDecisionProviderUnavailable)
    assert "secret-ish" not in str(broken.error)
    wrong = await runtime.invoke("wrong")
    assert isinstance(wrong.error, AgentDecisionProviderSchemaViolation)
    assert wrong.error.provider_error_code == "not_a_decision"
    dupes = await runtime.invoke("dupes")
    assert isinstance(dupes.error, AgentDecisionProviderSchemaViolation)
    assert dupes.error.provider_error_code == "duplicate_call_id"
    typed = await runtime.invoke("typed")
    assert isinstance(typed.error, AgentDecisionProviderSchemaViolation)
    assert typed.error.provider_error_code == "output_schema_mismatch"


async def test_output_schema_is_passed_and_a_valid_output_completes() -> None:
    program = Program()
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}}
    model = ScriptedProvider(final({"answer": "42"}))
    program.agent("a", provider=model, output_schema=schema)
    result = await Runtime(program).invoke("a")
    assert result.output == {"answer": "42"}
    assert model.requests[0].output_schema == schema


async def test_invoke_refusals() -> None:
    program = Program()
    program.agent("a", provider=ScriptedProvider())
    runtime = Runtime(program)
    with pytest.raises(ConfigurationError, match="unknown agent"):
        await runtime.invoke("b")
    with pytest.raises(ConfigurationError, match="JSON"):
        await runtime.invoke("a", input=object())
    with pytest.raises(ConfigurationError, match="run_id"):
        await runtime.invoke("a", run_id="")


async def test_history_grants_no_permission_a_denied_call_repeated_is_denied_again() -> None:
    program, seen = make_program()

    def repeat_what_history_shows(request: DecisionRequest, sent: list[dict[str, Any]]) -> Any:
        # The model sees its earlier call and its denial in history, and insists.
        assert any(m.get("role") == "tool" and "denied" in m["content"] for m in sent)
        return step(("c2", "cancel_order", {"order_id": "A1"}))

    model = ScriptedProvider(
        step(("c1", "cancel_order", {"order_id": "A1"})),
        repeat_what_history_shows,
        final("gave up"),
    )
    program.agent(
        "support",
        provider=model,
        capabilities=("lookup_order", "cancel_order"),
        grants=("orders:read",),
    )
    result = await Runtime(program).invoke("support")
    assert result.status == "completed"
    assert seen == []
    assert [d["call_id"] for d in result.trace.of_kind("denial")] == ["c1", "c2"]


async def test_history_grants_no_permission_a_call_replayed_from_history_meets_its_budget() -> None:
    program = Program()
    runs: list[str] = []

    @program.capability(max_calls=1)
    async def pay(invoice: str) -> str:
        runs.append(invoice)
        return "paid"

    def replay(request: DecisionRequest) -> Decision:
        # A host model that re-proposes the call it saw answered, verbatim.
        [seen] = request.observations
        return calls((seen.call_id + "-again", seen.name, dict(seen.arguments)))

    model = RawProvider(calls(("c1", "pay", {"invoice": "I-1"})), replay, done("ok"))
    program.agent("a", provider=model, capabilities=("pay",))
    result = await Runtime(program).invoke("a")
    assert runs == ["I-1"]
    [denied] = model.requests[2].observations
    assert denied.status == "denied"
    assert result.trace.of_kind("denial")[0]["reason"] == "budget_exhausted"


async def test_a_summariser_that_raises_refuses_the_decision_as_a_summary_failure() -> None:
    """A host ``summarize`` raising is a local refusal with its own code, not the provider's
    failure: no provider retry can help, and the callback's error is chained to it."""

    async def summarize(request: SummaryRequest) -> str:
        raise RuntimeError("summariser bug: order A1")

    program = Program()

    @program.capability
    async def again(n: int) -> int:
        return n

    history = HistoryConfig(max_messages=3, summarize=summarize)
    model = ScriptedProvider(
        *[step((f"c{i}", "again", {"n": i})) for i in range(6)], history=history
    )
    program.agent("a", provider=model, capabilities=("again",), max_decisions=8)
    result = await Runtime(program).invoke("a", input="go")
    assert result.status == "failed"
    assert isinstance(result.error, DecisionHistorySummaryInvalid)
    assert not result.error.retryable
    assert isinstance(result.error.__cause__, RuntimeError)
    assert "order A1" not in str(result.error)
    [failed] = result.trace.of_kind("invocation_failed")
    assert failed["error_code"] == "DecisionHistorySummaryInvalid"
    assert len(model.requests) < 6  # refused once the window needed a summary

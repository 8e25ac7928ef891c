"""``kind="flow"``: declared steps in a fixed order (touba.runtime._flow)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from touba.errors import (
    AgentBudgetExceeded,
    AgentDecisionProviderSchemaViolation,
    ConfigurationError,
    FlowStepFailed,
)
from touba.history import HistoryConfig, MemoryHistoryStore, conversation_key
from touba.memory._session import turn_trace
from touba.providers import Decision
from touba.runtime import (
    InvocationResult,
    ModelStep,
    Program,
    Runtime,
    SqliteCheckpointStore,
    Step,
)
from touba.testing import ScriptedProvider

from ._helpers import RawProvider, calls, done, final, step

REPLY_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"message": {"type": "string"}, "tags": {"type": "array", "items": {}}},
    "required": ["message"],
    "additionalProperties": False,
}


class Ledger:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []


def make_program(
    provider: Any,
    ledger: Ledger,
    *,
    steps: tuple[Any, ...] | None = None,
    grants: tuple[str, ...] = ("orders:read", "mail:send"),
    approval: bool = False,
    max_calls: int | None = None,
    **agent: Any,
) -> Program:
    program = Program()

    @program.capability(permissions=("orders:read",), max_calls=max_calls)
    async def lookup_order(order_id: str) -> dict[str, str]:
        ledger.calls.append(("lookup_order", order_id))
        if order_id == "BOOM":
            raise RuntimeError("orders database down")
        return {"order_id": order_id, "status": "shipped"}

    @program.capability(permissions=("mail:send",), requires_approval=approval)
    async def send_mail(to: str, text: str) -> str:
        ledger.calls.append(("send_mail", text))
        return f"sent to {to}"

    if steps is None:
        steps = (
            Step.call("lookup_order", {"order_id": "$input.order_id"}, name="order"),
            Step.model("reply", instructions="Write the reply.", output_schema=REPLY_SCHEMA),
            Step.call("send_mail", {"to": "$input.email", "text": "$steps.reply.output.message"}),
        )
    program.agent(
        "triage",
        provider=provider,
        instructions="You help customers.",
        grants=grants,
        kind="flow",
        steps=steps,
        **agent,
    )
    return program


INPUT = {"order_id": "A1", "email": "ada@example.org"}


def of(result: InvocationResult, kind: str) -> list[dict[str, Any]]:
    return [dict(e.data) for e in result.trace.of_kind(kind)]


# -- the happy path ------------------------------------------------------------------------


async def test_steps_run_in_order_and_model_steps_see_earlier_results_as_data() -> None:
    ledger = Ledger()
    model = ScriptedProvider(final({"message": "Your order shipped."}))
    runtime = Runtime(make_program(model, ledger))
    result = await runtime.invoke("triage", input=INPUT)

    assert result.status == "completed", result.error
    assert result.output == "sent to ada@example.org"  # the last step's output
    assert ledger.calls == [("lookup_order", "A1"), ("send_mail", "Your order shipped.")]
    (request,) = model.requests
    assert request.capabilities == ()  # a model step offers no capability
    assert request.output_schema == REPLY_SCHEMA
    assert request.instructions == "You help customers.\n\nWrite the reply."
    assert request.input == INPUT
    (data,) = request.data
    assert (data.name, data.arguments, data.status) == ("lookup_order", {"order_id": "A1"}, "ok")
    assert data.result == {"order_id": "A1", "status": "shipped"}
    # What the model was sent: the input, then the earlier step's result as data.
    sent = json.dumps(model.sent[0])
    assert "results of capability calls made earlier in this invocation" in sent
    assert "shipped" in sent

    started = of(result, "flow_step_started")
    assert [(s["step"], s["index"], s["type"]) for s in started] == [
        ("order", 0, "call"),
        ("reply", 1, "model"),
        ("send_mail", 2, "call"),
    ]
    finished = of(result, "flow_step_finished")
    assert [(f["step"], f["status"]) for f in finished] == [
        ("order", "ok"),
        ("reply", "ok"),
        ("send_mail", "ok"),
    ]
    assert finished[1]["output"] == {"message": "Your order shipped."}
    kinds = [e.kind for e in result.trace]
    assert kinds[0] == "invocation_started"
    assert kinds[-1] == "invocation_completed"
    # Each capability step is checked and observed like a model's call.
    assert [c["name"] for c in of(result, "call")] == ["lookup_order", "send_mail"]
    assert len(of(result, "observation")) == 2


async def test_output_names_another_step_and_the_agent_output_schema_checks_it() -> None:
    ledger = Ledger()
    model = ScriptedProvider(final({"message": "Hi"}))
    program = make_program(
        model,
        ledger,
        output="$steps.reply.output",
        output_schema={"type": "object", "required": ["message"]},
    )
    result = await Runtime(program).invoke("triage", input=INPUT)
    assert result.output == {"message": "Hi"}

    ledger = Ledger()
    model = ScriptedProvider(final({"message": "Hi"}))
    program = make_program(model, ledger, output_schema={"type": "integer"})
    failed = await Runtime(program).invoke("triage", input=INPUT)
    assert failed.status == "failed"
    assert isinstance(failed.error, FlowStepFailed)
    assert failed.error.step == "output"
    assert "output_schema" in failed.error.message


async def test_an_output_reference_finding_nothing_fails_the_flow() -> None:
    model = RawProvider(done("plain text"))
    steps = (Step.model("reply"),)
    program = make_program(model, Ledger(), steps=steps, output="$steps.reply.output.message")
    result = await Runtime(program).invoke("triage", input={})
    assert result.status == "failed"
    assert isinstance(result.error, FlowStepFailed)
    assert result.error.step == "output"
    assert "finds nothing" in result.error.message


async def test_model_steps_share_the_invocations_conversation() -> None:
    ledger = Ledger()
    store = MemoryHistoryStore()
    model = ScriptedProvider(
        final({"message": "draft"}),
        final("approved"),
        history=HistoryConfig(store=store, namespace="flows"),
    )
    steps = (
        Step.call("lookup_order", {"order_id": "$input.order_id"}),
        Step.model("draft", instructions="Draft.", output_schema=REPLY_SCHEMA),
        Step.model("review", instructions="Review the draft."),
    )
    result = await Runtime(make_program(model, ledger, steps=steps)).invoke(
        "triage", input=INPUT, run_id="r-1"
    )
    assert result.output == "approved"
    key = conversation_key(
        "flows", "scripted", "scripted", "native", "r-1", result.invocation_id, "triage"
    )
    record = await store.read(key)
    assert record is not None
    # Each model step opens an exchange with the earlier steps' results, then decides.
    assert [[m["kind"] for m in ex] for ex in record["exchanges"]] == [
        ["data"],
        ["decision"],
        ["data"],
        ["decision"],
    ]
    second = model.requests[1]
    assert [o.name for o in second.data] == ["lookup_order", "draft"]
    assert second.data[1].result == {"message": "draft"}
    # The second model step was sent its own earlier decision, then the new data.
    roles = [m["role"] for m in model.sent[1]]
    assert roles[-1] == "user"
    assert "draft" in json.dumps(model.sent[1])


async def test_a_flow_can_start_with_a_model_step_and_end_with_it() -> None:
    model = ScriptedProvider(final("hello"))
    program = make_program(model, Ledger(), steps=(Step.model("greet"),))
    result = await Runtime(program).invoke("triage", input="hi")
    assert result.output == "hello"
    assert model.requests[0].data == ()


# -- the same checks as a model's calls ---------------------------------------------------


async def test_a_capability_step_without_its_permission_is_denied_and_fails_the_flow() -> None:
    ledger = Ledger()
    model = ScriptedProvider(final({"message": "x"}))
    result = await Runtime(make_program(model, ledger, grants=("mail:send",))).invoke(
        "triage", input=INPUT
    )
    assert result.status == "failed"
    assert isinstance(result.error, FlowStepFailed)
    assert result.error.step == "order"
    assert "denied" in result.error.message
    assert ledger.calls == []
    (denial,) = of(result, "denial")
    assert denial["reason"] == "permission_denied"
    assert model.requests == []  # the flow stopped at its first step


async def test_budgets_apply_to_capability_steps() -> None:
    ledger = Ledger()
    steps = (
        Step.call("lookup_order", {"order_id": "A1"}, name="first"),
        Step.call("lookup_order", {"order_id": "A2"}, name="second"),
    )
    result = await Runtime(make_program(RawProvider(), ledger, steps=steps, max_calls=1)).invoke(
        "triage", input=INPUT
    )
    assert result.status == "failed"
    assert isinstance(result.error, FlowStepFailed)
    assert result.error.step == "second"
    assert ledger.calls == [("lookup_order", "A1")]
    assert [d["reason"] for d in of(result, "denial")] == ["budget_exhausted"]


async def test_arguments_are_validated_at_run_time_too() -> None:
    ledger = Ledger()
    steps = (
        Step.model("pick", output_schema={"type": "object"}),
        Step.call("lookup_order", {"order_id": "$steps.pick.output.id"}),
    )
    model = RawProvider(done({"id": 42}))  # not a str
    result = await Runtime(make_program(model, ledger, steps=steps)).invoke("triage", input={})
    assert result.status == "failed"
    assert [d["reason"] for d in of(result, "denial")] == ["invalid_arguments"]
    assert ledger.calls == []


async def test_a_reference_finding_nothing_fails_the_step_without_a_call() -> None:
    ledger = Ledger()
    result = await Runtime(make_program(RawProvider(), ledger)).invoke(
        "triage", input={"email": "x"}
    )
    assert result.status == "failed"
    assert isinstance(result.error, FlowStepFailed)
    assert "'$input.order_id' finds nothing" in result.error.message
    assert ledger.calls == []
    assert of(result, "call") == []


async def test_on_error_continue_lets_later_steps_see_the_error() -> None:
    ledger = Ledger()
    model = RawProvider(done("sorry, the lookup failed"))
    steps = (
        Step.call("lookup_order", {"order_id": "BOOM"}, on_error="continue"),
        Step.model("reply"),
    )
    result = await Runtime(make_program(model, ledger, steps=steps)).invoke("triage", input={})
    assert result.status == "completed"
    assert result.output == "sorry, the lookup failed"
    (data,) = model.requests[0].data
    assert data.status == "error"
    assert data.error is not None
    assert "orders database down" in data.error
    finished = of(result, "flow_step_finished")
    assert (finished[0]["status"], finished[0]["output"]) == ("error", None)


async def test_an_error_fails_the_flow_by_default() -> None:
    steps = (Step.call("lookup_order", {"order_id": "BOOM"}), Step.model("reply"))
    model = RawProvider()
    result = await Runtime(make_program(model, Ledger(), steps=steps)).invoke("triage", input={})
    assert result.status == "failed"
    assert isinstance(result.error, FlowStepFailed)
    assert "'error'" in result.error.message
    assert model.requests == []


# -- approvals -----------------------------------------------------------------------------


async def test_a_step_needing_approval_pauses_and_resumes_where_it_stopped(
    tmp_path: Path,
) -> None:
    directory = tmp_path / "private"
    directory.mkdir(mode=0o700)
    ledger = Ledger()
    async with SqliteCheckpointStore(directory / "checkpoints.db") as checkpoints:
        model = ScriptedProvider(final({"message": "Shipped."}))
        runtime = Runtime(make_program(model, ledger, approval=True), checkpoints)
        paused = await runtime.invoke("triage", input=INPUT, run_id="r-9")
        assert paused.status == "awaiting_approval"
        (pending,) = paused.pending
        assert (pending.name, dict(pending.arguments)) == (
            "send_mail",
            {"to": "ada@example.org", "text": "Shipped."},
        )
        assert ledger.calls == [("lookup_order", "A1")]
        assert paused.checkpoint_id is not None

        # Another runtime (a new process) with the same program resumes it.
        again = ScriptedProvider()
        other = Runtime(make_program(again, ledger, approval=True), checkpoints)
        result = await other.resume(paused.checkpoint_id, approvals={pending.call_id: True})
    assert result.status == "completed", result.error
    assert result.output == "sent to ada@example.org"
    assert (result.run_id, result.invocation_id) == ("r-9", paused.invocation_id)
    assert ledger.calls == [("lookup_order", "A1"), ("send_mail", "Shipped.")]
    assert again.requests == []  # the model step was not run again
    finished = of(result, "flow_step_finished")
    assert [f["step"] for f in finished] == ["order", "reply", "send_mail"]


async def test_a_refused_approval_fails_the_step() -> None:
    ledger = Ledger()
    model = ScriptedProvider(final({"message": "Shipped."}))
    runtime = Runtime(make_program(model, ledger, approval=True))
    paused = await runtime.invoke("triage", input=INPUT)
    assert paused.checkpoint_id is not None
    result = await runtime.resume(
        paused.checkpoint_id, approvals={paused.pending[0].call_id: False}
    )
    assert result.status == "failed"
    assert isinstance(result.error, FlowStepFailed)
    assert result.error.step == "send_mail"
    assert [d["reason"] for d in of(result, "denial")] == ["not_approved"]
    assert ledger.calls == [("lookup_order", "A1")]


async def test_a_step_can_delegate_to_another_agent() -> None:
    program = Program()
    program.delegate("helper")
    helper = ScriptedProvider(final("helped"))
    program.agent("helper", provider=helper)
    program.agent(
        "triage",
        provider=RawProvider(),
        kind="flow",
        steps=(Step.call("helper", {"input": "$input"}),),
    )
    result = await Runtime(program).invoke("triage", input="do it")
    assert result.output == "helped"
    assert helper.requests[0].input == "do it"
    (started,) = of(result, "sub_invocation_started")
    assert started["child_agent_ref"] == "helper"


# -- model steps may not call capabilities --------------------------------------------------


async def test_a_call_proposed_in_a_model_step_is_denied_and_the_model_asked_again() -> None:
    ledger = Ledger()
    model = RawProvider(
        calls(("m1", "send_mail", {"to": "x", "text": "spam"})),
        done({"message": "ok"}),
    )
    steps = (Step.model("reply", output_schema=REPLY_SCHEMA),)
    result = await Runtime(make_program(model, ledger, steps=steps)).invoke("triage", input={})
    assert result.status == "completed"
    assert result.output == {"message": "ok"}
    assert ledger.calls == []
    (denial,) = of(result, "denial")
    assert (denial["name"], denial["reason"]) == ("send_mail", "calls_not_allowed")
    retry = model.requests[1]
    (observation,) = retry.observations
    assert observation.status == "denied"
    assert retry.data == ()


async def test_model_step_decisions_share_the_agents_max_decisions() -> None:
    model = RawProvider(*(calls((f"m{i}", "lookup_order", {"order_id": "A"})) for i in range(3)))
    program = make_program(model, Ledger(), steps=(Step.model("reply"),), max_decisions=2)
    result = await Runtime(program).invoke("triage", input={})
    assert result.status == "failed"
    assert isinstance(result.error, AgentBudgetExceeded)
    assert "model step 'reply'" in result.error.message


async def test_a_built_in_provider_refuses_a_call_outside_the_empty_catalog() -> None:
    model = ScriptedProvider(step(("m1", "lookup_order", {"order_id": "A1"})))
    program = make_program(model, Ledger(), steps=(Step.model("reply"),))
    result = await Runtime(program).invoke("triage", input={})
    assert result.status == "failed"
    assert isinstance(result.error, AgentDecisionProviderSchemaViolation)
    assert result.error.provider_error_code == "unknown_capability"


async def test_a_model_step_output_must_match_its_schema() -> None:
    model = RawProvider(Decision(output={"wrong": True}))
    program = make_program(
        model, Ledger(), steps=(Step.model("reply", output_schema=REPLY_SCHEMA),)
    )
    result = await Runtime(program).invoke("triage", input={})
    assert result.status == "failed"
    assert isinstance(result.error, AgentDecisionProviderSchemaViolation)
    assert "'reply'" in result.error.message


# -- chat memory sees the flow's calls -----------------------------------------------------


async def test_the_turn_trace_holds_the_capability_steps() -> None:
    model = ScriptedProvider(final({"message": "Shipped."}))
    result = await Runtime(make_program(model, Ledger())).invoke("triage", input=INPUT)
    groups = turn_trace(result.trace, result.invocation_id)
    assert [[(c.name, c.status) for c in g] for g in groups] == [
        [("lookup_order", "ok")],
        [("send_mail", "ok")],
    ]


# -- definition-time checks ---------------------------------------------------------------


def define(steps: Any, **agent: Any) -> None:
    make_program(RawProvider(), Ledger(), steps=steps, **agent)


@pytest.mark.parametrize(
    ("steps", "output", "match"),
    [
        ((Step.call("lookup_order", {"order_id": "$steps.nope.output"}),), None, "not an earlier"),
        (
            (
                Step.call("lookup_order", {"order_id": "$steps.reply.output.message"}),
                Step.model("reply"),
            ),
            None,
            "not an earlier",
        ),
        (
            (
                Step.model("reply", output_schema=REPLY_SCHEMA),
                Step.call("lookup_order", {"order_id": "$steps.reply.output.msg"}),
            ),
            None,
            "no property 'msg'",
        ),
        (
            (
                Step.model("reply", output_schema=REPLY_SCHEMA),
                Step.call("lookup_order", {"order_id": "$steps.reply.output.message.x"}),
            ),
            None,
            "a string",
        ),
        (
            (
                Step.model("reply", output_schema=REPLY_SCHEMA),
                Step.call("lookup_order", {"order_id": "$steps.reply.output.tags.first"}),
            ),
            None,
            "indexes a list",
        ),
        ((Step.call("lookup_order", {"order_id": "$order"}),), None, "not a reference"),
        ((Step.call("lookup_order", {"order_id": "$steps.x"}),), None, "not a reference"),
        ((Step.call("lookup_order", {"order_id": "$input..a"}),), None, "empty segment"),
        ((Step.call("lookup_order", {"order_id": 7}),), None, "do not match"),
        ((Step.call("lookup_order", {"id": "A1", "order_id": "A1"}),), None, "no parameters"),
        ((Step.call("lookup_order", {}),), None, "needs the arguments"),
        ((Step.call("unknown", {}),), None, "unknown capability"),
        ((Step.model("a"), Step.model("a")), None, "two steps are named"),
        ((Step.model("bad name"),), None, "step name"),
        ((Step.model("a", output_schema={"type": 5}),), None, "not a valid JSON Schema"),
        ((), None, "non-empty"),
        (("lookup_order",), None, "Step.call or Step.model"),
        ((Step.model("a"),), "$steps.b.output", "not an earlier"),
        ((Step.model("a"),), "steps.a.output", "must be a reference"),
        ((Step.call("lookup_order", {"order_id": "A1"}, on_error="skip"),), None, "on_error"),  # type: ignore[arg-type]
    ],
)
def test_bad_flows_are_refused_when_defined(steps: Any, output: Any, match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        define(steps, output=output)


def test_flow_options_belong_to_flows_and_flows_need_steps() -> None:
    program = Program()
    with pytest.raises(ConfigurationError, match="kind='flow'"):
        program.agent("a", provider=RawProvider(), steps=(Step.model("x"),))
    with pytest.raises(ConfigurationError, match="needs steps"):
        program.agent("b", provider=RawProvider(), kind="flow")


def test_the_catalog_defaults_to_the_called_capabilities_and_must_hold_them() -> None:
    program = make_program(RawProvider(), Ledger())
    assert program.agents["triage"].capabilities == ("lookup_order", "send_mail")
    with pytest.raises(ConfigurationError, match="not in its capabilities"):
        define(None, capabilities=("lookup_order",))


async def test_references_reach_into_lists_nested_arguments_and_escape_dollars() -> None:
    ledger = Ledger()
    steps: tuple[Any, ...] = (
        Step.model("pick", output_schema={"type": "object"}),
        Step.call("send_mail", {"to": "$steps.pick.output.to.1", "text": "$$5 off"}),
    )
    model = RawProvider(done({"to": ["a@x", "b@x"]}))
    result = await Runtime(make_program(model, ledger, steps=steps)).invoke("triage", input={})
    assert result.status == "completed", result.error
    assert ledger.calls == [("send_mail", "$5 off")]
    assert result.output == "sent to b@x"
    assert isinstance(Step.model("x"), ModelStep)

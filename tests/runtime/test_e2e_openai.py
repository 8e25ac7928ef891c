"""The runtime end to end with the OpenAI provider (SPEC section 7).

Every test drives ``touba.Runtime`` with ``create_openai_decision_provider``
through the official ``openai`` SDK against ``FakeOpenAIServer``, which
speaks the Responses wire format and refuses what the real API refuses (a
``function_call`` without its output, an output without its call, an
altered reasoning item). "The validator accepted it" means every request
was answered 200.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from pydantic import BaseModel, field_validator

from touba.errors import AgentBudgetExceeded, AgentDecisionProviderSchemaViolation
from touba.history import HistoryConfig
from touba.history.sqlite import SqliteHistoryStore
from touba.providers import ContextConfig, create_openai_decision_provider
from touba.runtime import (
    InvocationResult,
    MemoryCheckpointStore,
    Program,
    Runtime,
    SqliteCheckpointStore,
)
from touba.testing.fakes import (
    FakeOpenAIServer,
    openai_function_call,
    openai_reasoning,
    openai_text,
    validate_openai_responses_request,
)

MODEL = "gpt-e2e"
API_KEY = "sk-e2e-do-not-leak-0123456789"
Body = dict[str, Any]
Act = Callable[[Runtime], Awaitable[InvocationResult]]


@pytest.fixture
def server() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer() as srv:
        yield srv


def sdk(srv: FakeOpenAIServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=srv.base_url + "/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture
async def client(server: FakeOpenAIServer) -> AsyncIterator[openai.AsyncOpenAI]:
    async with sdk(server) as c:
        yield c


@pytest.fixture
def private_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "state"
    directory.mkdir(mode=0o700)
    return directory


# what went over the wire ---------------------------------------------------------


def generations(srv: FakeOpenAIServer) -> list[Body]:
    return [r.body for r in srv.requests_to("responses")]


def assert_accepted(srv: FakeOpenAIServer) -> None:
    """The fake's validator refused nothing, and every request re-validates cleanly."""
    assert [(r.endpoint, r.status) for r in srv.requests if r.status != 200] == []
    for body in generations(srv):
        assert validate_openai_responses_request(body, ledger=srv.ledger) == []


def outputs(body: Body) -> dict[str, dict[str, Any]]:
    """The ``function_call_output`` items of a request, decoded, by call id."""
    return {
        i["call_id"]: json.loads(i["output"])
        for i in body["input"]
        if i.get("type") == "function_call_output"
    }


def call_ids(body: Body) -> list[str]:
    return [i["call_id"] for i in body["input"] if i.get("type") == "function_call"]


def item_kinds(body: Body) -> list[tuple[str | None, str | None]]:
    return [(i.get("type"), i.get("call_id")) for i in body["input"]]


def history_events(result: InvocationResult, event: str) -> list[Any]:
    return [e for e in result.trace.of_kind("history_event") if e["event"] == event]


def completed(result: InvocationResult) -> InvocationResult:
    assert result.status == "completed", result.error
    return result


# a support program -------------------------------------------------------------


class Pickup(BaseModel):
    """A pickup request; the weekday rule is not expressible in the JSON Schema."""

    order_id: str
    day: str

    @field_validator("day")
    @classmethod
    def weekday(cls, value: str) -> str:
        if value.lower() in ("saturday", "sunday"):
            raise ValueError("no pickups on weekends")
        return value


# The model's schema as touba offers it: pydantic's, without derived titles.
PICKUP_SCHEMA = {
    "type": "object",
    "description": "A pickup request; the weekday rule is not expressible in the JSON Schema.",
    "properties": {"order_id": {"type": "string"}, "day": {"type": "string"}},
    "required": ["order_id", "day"],
}


LOOKUP_SCHEMA = {
    "type": "object",
    "properties": {"order_id": {"type": "string"}},
    "required": ["order_id"],
    "additionalProperties": False,
}


def support_program(provider: Any, ran: list[str], **agent: Any) -> Program:
    """lookup_order (orders:read, at most 2 calls), refund (orders:write), schedule_pickup."""
    program = Program()

    @program.capability(permissions=("orders:read",), max_calls=2)
    async def lookup_order(order_id: str) -> dict[str, str]:
        """Look up the status of an order."""
        ran.append(f"lookup {order_id}")
        return {"order_id": order_id, "status": "shipped"}

    @program.capability(permissions=("orders:write",))
    async def refund(order_id: str, amount: float) -> str:
        """Refund an order."""
        ran.append(f"refund {order_id}")
        return "refunded"

    @program.capability(permissions=("orders:read",))
    async def schedule_pickup(pickup: Pickup) -> str:
        """Schedule a pickup of a returned order."""
        ran.append(f"pickup {pickup.order_id}")
        return "scheduled"

    program.agent(
        "support",
        provider=provider,
        instructions="You are a support agent.",
        capabilities=("lookup_order", "refund", "schedule_pickup"),
        grants=("orders:read",),
        **agent,
    )
    return program


def provider_for(client: openai.AsyncOpenAI, **kwargs: Any) -> Any:
    return create_openai_decision_provider(model=MODEL, client=client, **kwargs)


# the capability round trip -----------------------------------------------------


async def test_a_capability_round_trip_sends_tools_from_type_hints_and_pairs_the_result(
    server: FakeOpenAIServer, client: openai.AsyncOpenAI
) -> None:
    ran: list[str] = []
    runtime = Runtime(support_program(provider_for(client), ran))
    server.script_response(
        openai_reasoning("look it up"),
        openai_function_call("lookup_order", {"order_id": "A1"}, call_id="call_1"),
    )
    server.script_response(openai_text("A1 has shipped."))

    result = completed(await runtime.invoke("support", input="Where is order A1?"))

    assert result.output == "A1 has shipped."
    assert ran == ["lookup A1"]
    first, second = generations(server)
    assert first["tools"] == [
        {
            "type": "function",
            "name": "lookup_order",
            "description": "Look up the status of an order.",
            "parameters": LOOKUP_SCHEMA,
            "strict": False,
        },
        {
            "type": "function",
            "name": "refund",
            "description": "Refund an order.",
            "parameters": {
                "type": "object",
                "properties": {"order_id": {"type": "string"}, "amount": {"type": "number"}},
                "required": ["order_id", "amount"],
                "additionalProperties": False,
            },
            "strict": False,
        },
        {
            "type": "function",
            "name": "schedule_pickup",
            "description": "Schedule a pickup of a returned order.",
            "parameters": {
                "type": "object",
                "properties": {"pickup": PICKUP_SCHEMA},
                "required": ["pickup"],
                "additionalProperties": False,
            },
            "strict": False,
        },
    ]
    assert (first["instructions"], first["store"]) == ("You are a support agent.", False)
    assert first["input"] == [{"role": "user", "content": "Where is order A1?"}]
    assert item_kinds(second)[1:] == [
        ("reasoning", None),
        ("function_call", "call_1"),
        ("function_call_output", "call_1"),
    ]
    assert outputs(second) == {
        "call_1": {"status": "ok", "result": {"order_id": "A1", "status": "shipped"}}
    }
    assert [e.kind for e in result.trace if e.kind != "history_event"] == [
        "invocation_started",
        "decision",
        "call",
        "observation",
        "decision",
        "invocation_completed",
    ]
    assert_accepted(server)


# every check refusal comes back as a denied observation -------------------------


@pytest.mark.parametrize(
    ("name", "arguments", "reason", "says"),
    [
        ("refund", {"order_id": "A1", "amount": 5}, "permission_denied", "orders:write"),
        (
            "schedule_pickup",
            {"pickup": {"order_id": "A1", "day": "Sunday"}},
            "invalid_arguments",
            "pickup",
        ),
    ],
)
async def test_a_refused_call_goes_back_as_a_denied_output_and_never_runs(
    server: FakeOpenAIServer,
    client: openai.AsyncOpenAI,
    name: str,
    arguments: dict[str, Any],
    reason: str,
    says: str,
) -> None:
    ran: list[str] = []
    runtime = Runtime(support_program(provider_for(client), ran))
    server.script_response(openai_function_call(name, arguments, call_id="call_x"))
    server.script_response(openai_text("I cannot do that."))

    result = completed(await runtime.invoke("support", input="Please help with A1."))

    assert ran == []
    (denial,) = result.trace.of_kind("denial")
    assert (denial["call_id"], denial["reason"]) == ("call_x", reason)
    sent = outputs(generations(server)[1])
    assert sent["call_x"]["status"] == "denied"
    assert says in sent["call_x"]["error"]
    assert "Sunday" not in sent["call_x"]["error"]  # a refusal names the rule, not the value
    assert_accepted(server)


async def test_identical_calls_run_while_the_budget_lasts_then_are_denied(
    server: FakeOpenAIServer, client: openai.AsyncOpenAI
) -> None:
    ran: list[str] = []
    runtime = Runtime(support_program(provider_for(client), ran))
    for n in range(3):  # the same call three times; lookup_order has max_calls=2
        server.script_response(
            openai_function_call("lookup_order", {"order_id": "A1"}, call_id=f"call_{n}")
        )
    server.script_response(openai_text("A1 has shipped."))

    completed(await runtime.invoke("support", input="Check A1, then check again."))

    assert ran == ["lookup A1", "lookup A1"]
    last = generations(server)[-1]
    assert call_ids(last) == ["call_0", "call_1", "call_2"]
    sent = outputs(last)
    assert [sent[f"call_{n}"]["status"] for n in range(3)] == ["ok", "ok", "denied"]
    assert "at most 2 time(s)" in sent["call_2"]["error"]
    assert_accepted(server)


async def test_a_capability_removed_before_an_approved_resume_is_denied_as_not_in_catalog(
    server: FakeOpenAIServer, client: openai.AsyncOpenAI
) -> None:
    """The runtime's catalog check, through the wire.

    The provider itself refuses a call to a tool it did not offer (a schema
    violation, see below), so a call outside the agent's catalog meets the
    runtime's check when the program changed between a pause and its resume:
    an approved call is checked again against the resuming program.
    """
    ran: list[str] = []
    provider = provider_for(client)  # one conversation store for both deploys

    def deploy(catalog: tuple[str, ...]) -> Program:
        program = Program()

        @program.capability
        async def lookup_invoice(invoice: str) -> str:
            """Read an invoice."""
            return "12.00"

        @program.capability(requires_approval=True)
        async def pay(invoice: str) -> str:
            """Pay an invoice."""
            ran.append(invoice)
            return "paid"

        program.agent("billing", provider=provider, capabilities=catalog)
        return program

    checkpoints = MemoryCheckpointStore()
    before = Runtime(deploy(("lookup_invoice", "pay")), checkpoints=checkpoints)
    server.script_response(openai_function_call("pay", {"invoice": "I-1"}, call_id="call_pay"))
    paused = await before.invoke("billing", input="Pay I-1")
    assert paused.status == "awaiting_approval"

    after = Runtime(deploy(("lookup_invoice",)), checkpoints=checkpoints)  # `pay` withdrawn
    server.script_response(openai_text("Payment is no longer possible."))
    result = completed(await after.resume(paused.checkpoint_id or "", approvals={"call_pay": True}))

    assert ran == []
    (denial,) = result.trace.of_kind("denial")
    assert denial["reason"] == "unknown_capability"
    last = generations(server)[-1]
    assert [t["name"] for t in last["tools"]] == ["lookup_invoice"]
    assert call_ids(last) == ["call_pay"]
    assert outputs(last)["call_pay"]["status"] == "denied"
    assert_accepted(server)


# concurrency, failures, budgets --------------------------------------------------


async def test_parallel_calls_of_one_decision_run_concurrently_and_all_results_go_back(
    server: FakeOpenAIServer, client: openai.AsyncOpenAI
) -> None:
    program = Program()
    started: list[str] = []
    all_running = asyncio.Event()

    @program.capability
    async def lookup_order(order_id: str) -> str:
        """Look up the status of an order."""
        started.append(order_id)
        if len(started) == 3:
            all_running.set()
        # Run one after the other, the first call would wait here alone and time out.
        await asyncio.wait_for(all_running.wait(), timeout=5)
        return f"{order_id}: shipped"

    program.agent("support", provider=provider_for(client), capabilities=("lookup_order",))
    server.script_response(
        openai_reasoning("three lookups at once"),
        *(
            openai_function_call("lookup_order", {"order_id": o}, call_id=f"call_{o}")
            for o in ("A1", "B2", "C3")
        ),
    )
    server.script_response(openai_text("All three have shipped."))

    completed(await Runtime(program).invoke("support", input="A1, B2 and C3?"))

    second = generations(server)[1]
    assert item_kinds(second)[1:] == [
        ("reasoning", None),
        ("function_call", "call_A1"),
        ("function_call", "call_B2"),
        ("function_call", "call_C3"),
        ("function_call_output", "call_A1"),
        ("function_call_output", "call_B2"),
        ("function_call_output", "call_C3"),
    ]
    assert outputs(second)["call_B2"] == {"status": "ok", "result": "B2: shipped"}
    assert_accepted(server)


async def test_a_raising_capability_is_an_error_output_and_the_model_goes_on(
    server: FakeOpenAIServer, client: openai.AsyncOpenAI
) -> None:
    program = Program()

    @program.capability
    def lookup_order(order_id: str) -> str:  # sync: runs in a worker thread
        """Look up the status of an order."""
        raise ConnectionError("warehouse offline")

    program.agent("support", provider=provider_for(client), capabilities=("lookup_order",))
    server.script_response(openai_function_call("lookup_order", {"order_id": "A1"}, call_id="c"))
    server.script_response(openai_text("The warehouse is offline; try later."))

    result = completed(await Runtime(program).invoke("support", input="A1?"))

    assert outputs(generations(server)[1]) == {
        "c": {"status": "error", "error": "ConnectionError: warehouse offline"}
    }
    (observation,) = result.trace.of_kind("observation")
    assert observation["status"] == "error"
    assert_accepted(server)


async def test_max_decisions_exhausted_fails_with_agent_budget_exceeded(
    server: FakeOpenAIServer, client: openai.AsyncOpenAI
) -> None:
    ran: list[str] = []
    runtime = Runtime(support_program(provider_for(client), ran, max_decisions=2))
    server.script_response(openai_function_call("lookup_order", {"order_id": "A1"}))
    server.script_response(openai_function_call("lookup_order", {"order_id": "B2"}))

    result = await runtime.invoke("support", input="Check everything.")

    assert result.status == "failed"
    assert isinstance(result.error, AgentBudgetExceeded)
    assert result.error.max_decisions == 2
    assert ran == ["lookup A1"]  # the last decision's calls were not run
    (failed,) = result.trace.of_kind("invocation_failed")
    assert failed["error_code"] == "AgentBudgetExceeded"
    assert len(generations(server)) == 2
    assert_accepted(server)


@pytest.mark.parametrize(
    ("script", "code"),
    [
        ({"items": [openai_function_call("drop_tables", {})]}, "unknown_capability"),
        (
            {
                "items": [openai_function_call("lookup_order", {"order_id": 7})],
            },
            "arguments_schema_mismatch",
        ),
        (
            {"items": [openai_text('{"partial": ')], "incomplete_reason": "max_output_tokens"},
            "truncated_output",
        ),
        ({"items": [openai_function_call("lookup_order", '{"order_id": "A')]}, "invalid_json"),
    ],
)
async def test_a_response_without_a_valid_decision_fails_with_its_provider_error_code(
    server: FakeOpenAIServer, client: openai.AsyncOpenAI, script: dict[str, Any], code: str
) -> None:
    ran: list[str] = []
    runtime = Runtime(support_program(provider_for(client), ran))
    server.script_response(*script["items"], incomplete_reason=script.get("incomplete_reason"))

    result = await runtime.invoke("support", input="Where is A1?")

    assert result.status == "failed"
    assert isinstance(result.error, AgentDecisionProviderSchemaViolation)
    assert result.error.provider_error_code == code
    (error,) = result.trace.of_kind("provider_error")
    assert (error["error_code"], error["provider_error_code"]) == (
        "AgentDecisionProviderSchemaViolation",
        code,
    )
    assert result.trace.of_kind("invocation_failed")[0]["provider_error_code"] == code
    assert ran == []
    assert len(generations(server)) == 1  # a received response is never retried


# approvals across processes ------------------------------------------------------


def billing_program(provider: Any, ran: list[str]) -> Program:
    """What a worker process imports: the same program on both sides of a restart."""
    program = Program()

    @program.capability(permissions=("billing:read",))
    async def lookup_invoice(invoice: str) -> dict[str, str]:
        """Read an invoice."""
        ran.append(f"lookup {invoice}")
        return {"invoice": invoice, "amount": "12.00"}

    @program.capability(permissions=("billing:pay",), requires_approval=True)
    async def pay(invoice: str) -> str:
        """Pay an invoice."""
        ran.append(f"pay {invoice}")
        return "paid"

    program.agent(
        "billing",
        provider=provider,
        instructions="You pay invoices.",
        capabilities=("lookup_invoice", "pay"),
        grants=("billing:read", "billing:pay"),
    )
    return program


async def run_in_worker(
    srv: FakeOpenAIServer,
    directory: Path,
    *,
    durable_history: bool,
    ran: list[str],
    act: Act,
) -> InvocationResult:
    """One worker process: its own client, provider, stores and runtime, all closed after.

    ``durable_history`` keeps the conversation in SQLite next to the
    checkpoints; otherwise it lives in this worker's RAM and dies with it.
    """
    async with sdk(srv) as client, SqliteCheckpointStore(directory / "checkpoints.sqlite") as cps:
        if durable_history:
            async with SqliteHistoryStore(directory / "history.sqlite") as store:
                history = HistoryConfig(store=store, namespace="billing-prod")
                runtime = Runtime(billing_program(provider_for(client, history=history), ran), cps)
                return await act(runtime)
        return await act(Runtime(billing_program(provider_for(client), ran), cps))


async def pause_in_worker(
    srv: FakeOpenAIServer, directory: Path, *, durable_history: bool
) -> tuple[InvocationResult, list[str]]:
    ran: list[str] = []
    srv.script_response(
        openai_reasoning("look, then pay"),
        openai_function_call("lookup_invoice", {"invoice": "I-1"}, call_id="call_look"),
        openai_function_call("pay", {"invoice": "I-1"}, call_id="call_pay"),
    )

    async def invoke(runtime: Runtime) -> InvocationResult:
        return await runtime.invoke("billing", input="Pay invoice I-1", run_id="run-42")

    paused = await run_in_worker(
        srv, directory, durable_history=durable_history, ran=ran, act=invoke
    )
    assert paused.status == "awaiting_approval", paused.error
    assert [c.call_id for c in paused.pending] == ["call_pay"]
    return paused, ran


@pytest.mark.parametrize("approved", [True, False])
async def test_approval_resumed_by_another_worker_pairs_the_old_calls_with_their_results(
    server: FakeOpenAIServer, private_dir: Path, approved: bool
) -> None:
    paused, ran_before = await pause_in_worker(server, private_dir, durable_history=True)
    assert ran_before == ["lookup I-1"]  # the other call of the decision ran before the stop

    ran_after: list[str] = []
    server.script_response(openai_text("Paid." if approved else "Payment was refused."))

    async def resume(runtime: Runtime) -> InvocationResult:
        return await runtime.resume(paused.checkpoint_id or "", {"call_pay": approved})

    result = completed(
        await run_in_worker(server, private_dir, durable_history=True, ran=ran_after, act=resume)
    )

    assert (result.run_id, result.invocation_id, result.agent_ref) == (
        "run-42",
        paused.invocation_id,
        "billing",
    )
    assert ran_after == (["pay I-1"] if approved else [])
    after = generations(server)[-1]
    assert item_kinds(after)[1:] == [
        ("reasoning", None),
        ("function_call", "call_look"),
        ("function_call", "call_pay"),
        ("function_call_output", "call_look"),
        ("function_call_output", "call_pay"),
    ]
    # The reasoning item came back from SQLite in another worker with its encrypted
    # content; the fake's ledger (assert_accepted) checks it is the one it issued.
    assert after["input"][1]["encrypted_content"]
    sent = outputs(after)
    assert sent["call_look"] == {"status": "ok", "result": {"invoice": "I-1", "amount": "12.00"}}
    if approved:
        assert sent["call_pay"] == {"status": "ok", "result": "paid"}
        assert result.trace.of_kind("approval_granted")
    else:
        assert sent["call_pay"]["status"] == "denied"
        assert "not approved" in sent["call_pay"]["error"]
        assert result.trace.of_kind("approval_refused")[0]["given"] is True
    assert history_events(result, "resumed_without_messages") == []
    kinds = [e.kind for e in result.trace]  # the trace carries on from the first worker
    assert kinds.index("awaiting_approval") < kinds.index("invocation_resumed")
    assert_accepted(server)

    async with SqliteHistoryStore(private_dir / "history.sqlite") as store:
        (row,) = await store.list("billing-prod")
        record = await store.read(row.key)
    assert record is not None
    assert record["identity"]["invocation_id"] == paused.invocation_id
    assert (record["stats"]["exchanges"], record["pending"]) == (2, [])


async def test_resume_after_a_restart_with_ram_only_history_sends_observations_as_data(
    server: FakeOpenAIServer, private_dir: Path
) -> None:
    paused, _ = await pause_in_worker(server, private_dir, durable_history=False)
    server.script_response(openai_text("Paid."))
    ran: list[str] = []

    async def resume(runtime: Runtime) -> InvocationResult:
        return await runtime.resume(paused.checkpoint_id or "", {"call_pay": True})

    result = completed(
        await run_in_worker(server, private_dir, durable_history=False, ran=ran, act=resume)
    )

    assert ran == ["pay I-1"]
    assert len(history_events(result, "resumed_without_messages")) == 1
    after = generations(server)[-1]
    kinds = {i.get("type") for i in after["input"]}
    assert kinds == {None}  # only plain messages: no function_call_output without its call
    assert [i["role"] for i in after["input"]] == ["user", "user"]
    data = after["input"][1]["content"]
    assert "data, not instructions" in data
    assert '"capability":"lookup_invoice"' in data
    assert '"result":"paid"' in data
    assert "call_pay" not in json.dumps(after)  # no invented call id
    assert_accepted(server)


# delegation ----------------------------------------------------------------------


async def test_a_delegated_agent_has_its_own_invocation_and_history(
    server: FakeOpenAIServer, client: openai.AsyncOpenAI
) -> None:
    program = Program()
    provider = provider_for(client)  # one provider for both agents: still two conversations

    @program.capability
    async def lookup_order(order_id: str) -> str:
        """Look up the status of an order."""
        return "shipped"

    program.delegate("researcher", description="Ask the researcher about orders.")
    program.agent(
        "support",
        provider=provider,
        instructions="You are the support agent.",
        capabilities=("researcher",),
    )
    program.agent(
        "researcher",
        provider=provider,
        instructions="You research orders.",
        capabilities=("lookup_order",),
    )
    server.script_response(
        openai_function_call("researcher", {"input": "Status of A1?"}, call_id="call_sub")
    )
    server.script_response(openai_function_call("lookup_order", {"order_id": "A1"}))
    server.script_response(openai_text("A1: shipped"))
    server.script_response(openai_text("Your order A1 has shipped."))

    result = completed(
        await Runtime(program).invoke("support", input="Customer SECRET-PARENT asks about A1")
    )

    assert result.output == "Your order A1 has shipped."
    (started,) = result.trace.of_kind("sub_invocation_started")
    child_id = started["child_invocation_id"]
    assert child_id != result.invocation_id
    child_entries = [e for e in result.trace if e.invocation_id == child_id]
    assert {e.run_id for e in child_entries} == {result.run_id}
    assert {e.agent_ref for e in child_entries} == {"researcher"}

    parent_1, child_1, child_2, parent_2 = generations(server)
    for body in (child_1, child_2):
        assert body["instructions"] == "You research orders."
        assert body["input"][0] == {"role": "user", "content": "Status of A1?"}
        assert "SECRET-PARENT" not in json.dumps(body)
        assert "call_sub" not in json.dumps(body)
    assert [t["name"] for t in parent_1["tools"]] == ["researcher"]
    assert parent_1["tools"][0]["parameters"]["required"] == ["input"]
    assert outputs(parent_2) == {"call_sub": {"status": "ok", "result": "A1: shipped"}}
    assert "lookup_order" not in json.dumps(parent_2["input"])
    assert_accepted(server)


# the context guard ---------------------------------------------------------------


def outputs_cost(body: Body) -> int:
    """Deterministic counts: 100 tokens plus 1000 per function_call_output."""
    return 100 + 1000 * sum(1 for i in body["input"] if i.get("type") == "function_call_output")


async def test_guard_counts_are_traced_and_a_trim_happens_before_generation() -> None:
    with FakeOpenAIServer(count_tokens=outputs_cost) as srv:
        async with sdk(srv) as client:
            provider = provider_for(
                client,
                # fits while 100 + 1000 * outputs + 100 <= 2300: at most two outputs
                context=ContextConfig(2300, input_token_multiplier=1, safety_margin_tokens=0),
                max_output_tokens=100,
            )
            program = Program()

            @program.capability
            async def lookup_order(order_id: str) -> str:
                """Look up the status of an order."""
                return "shipped"

            program.agent("support", provider=provider, capabilities=("lookup_order",))
            for order in ("A1", "B2", "C3"):
                srv.script_response(
                    openai_function_call("lookup_order", {"order_id": order}, call_id=order)
                )
            srv.script_response(openai_text("All shipped."))
            result = completed(await Runtime(program).invoke("support", input="A1, B2, C3?"))

        counts = history_events(result, "provider_context_count")
        assert [(e["count"], e["fits"]) for e in counts[:3]] == [
            (100, True),
            (1100, True),
            (2100, True),
        ]
        assert counts[3]["fits"] is False
        assert counts[3]["count"] == 3100
        assert counts[-1]["fits"] is True
        assert all(e["provider"] == "openai" and e["window"] == 2300 for e in counts)
        assert counts[-1]["reserve"] == counts[-1]["count"] + 100
        (trimmed,) = history_events(result, "history_trimmed")
        assert trimmed["removed_exchanges"] == 1
        # Counted before each generation, and the too-large request was never generated.
        endpoints = [r.endpoint for r in srv.requests]
        assert endpoints[:6] == ["input_tokens", "responses"] * 3
        assert endpoints[-1] == "responses"
        assert set(endpoints[6:-1]) == {"input_tokens"}
        last = generations(srv)[-1]
        assert list(outputs(last)) == ["B2", "C3"]
        assert call_ids(last) == ["B2", "C3"]  # A1's call left with its output
        assert all(outputs_cost(b) + 100 <= 2300 for b in generations(srv))
        for entry in counts:  # sizes only, never content
            assert "shipped" not in json.dumps(entry.to_dict())
        assert_accepted(srv)


# keys ----------------------------------------------------------------------------


async def test_the_exported_trace_and_the_stored_history_hold_no_api_key(
    server: FakeOpenAIServer, client: openai.AsyncOpenAI, private_dir: Path
) -> None:
    async with SqliteHistoryStore(private_dir / "history.sqlite") as store:
        provider = provider_for(
            client,
            history=HistoryConfig(store=store, namespace="support-prod"),
            context=ContextConfig(32768),
            max_output_tokens=500,
        )
        ran: list[str] = []
        server.script_response(openai_function_call("lookup_order", {"order_id": "A1"}))
        server.script_response(openai_text("Shipped."))
        result = completed(await Runtime(support_program(provider, ran)).invoke("support", "A1?"))
        (row,) = await store.list()
        record = await store.read(row.key)

    exported = result.trace.to_jsonl()
    assert len(exported.splitlines()) == len(result.trace)
    assert history_events(result, "provider_context_count")
    for text in (exported, json.dumps(record)):
        assert API_KEY not in text
        assert "Bearer" not in text
        assert "authorization" not in text.lower()
    for name in ("history.sqlite", "history.sqlite-wal"):
        path = private_dir / name
        if path.exists():
            assert API_KEY.encode() not in path.read_bytes()


# the structured interface --------------------------------------------------------


async def test_structured_interface_round_trip_through_the_runtime(
    server: FakeOpenAIServer, client: openai.AsyncOpenAI
) -> None:
    ran: list[str] = []
    provider = provider_for(client, decision_interface="structured")
    runtime = Runtime(support_program(provider, ran))
    call = {
        "action": "call",
        "calls": [
            {"name": "lookup_order", "arguments": {"order_id": "A1"}},
            {"name": "refund", "arguments": {"order_id": "A1", "amount": 5}},
        ],
    }
    server.script_response(openai_text(json.dumps(call)))
    server.script_response(openai_text(json.dumps({"action": "final", "output": "Shipped."})))

    result = completed(await runtime.invoke("support", input="Where is A1? Refund it."))

    assert result.output == "Shipped."
    assert ran == ["lookup A1"]  # refund: permission denied, as in the native interface
    assert [d["reason"] for d in result.trace.of_kind("denial")] == ["permission_denied"]
    first, second = generations(server)
    assert "tools" not in first
    fmt = first["text"]["format"]
    assert (fmt["type"], fmt["name"]) == ("json_schema", "touba_decision")
    assert "lookup_order" in json.dumps(fmt["schema"])
    assert [(i.get("type"), i.get("role")) for i in second["input"]] == [
        (None, "user"),
        ("message", "assistant"),
        (None, "user"),
    ]
    results = second["input"][2]["content"]
    assert "data, not instructions" in results
    assert '"status":"ok"' in results
    assert '"status":"denied"' in results
    assert outputs(second) == {}
    assert_accepted(server)


async def test_a_503_after_an_approved_payment_is_retried_from_another_worker_paying_once(
    server: FakeOpenAIServer, private_dir: Path
) -> None:
    """Issue 8: the provider fails on the generation right after the approved call ran;
    the checkpoint survives, and a resume in a third worker completes without paying again."""
    paused, ran_before = await pause_in_worker(server, private_dir, durable_history=True)
    assert ran_before == ["lookup I-1"]
    server.script_error(503)

    async def approve(runtime: Runtime) -> InvocationResult:
        return await runtime.resume(paused.checkpoint_id or "", {"call_pay": True})

    ran: list[str] = []
    failed = await run_in_worker(server, private_dir, durable_history=True, ran=ran, act=approve)
    assert failed.status == "failed"
    assert failed.error is not None
    assert failed.error.retryable
    assert failed.checkpoint_id not in (None, paused.checkpoint_id)
    assert ran == ["pay I-1"]

    server.script_response(openai_text("Paid."))

    async def retry(runtime: Runtime) -> InvocationResult:
        return await runtime.resume(failed.checkpoint_id or "")

    done = completed(
        await run_in_worker(server, private_dir, durable_history=True, ran=ran, act=retry)
    )
    assert done.invocation_id == paused.invocation_id
    assert ran == ["pay I-1"]  # exactly once across three workers
    statuses = [r.status for r in server.requests_to("responses")]
    assert statuses == [200, 503, 200]
    last = generations(server)[-1]
    assert outputs(last)["call_pay"] == {"status": "ok", "result": "paid"}
    assert item_kinds(last)[1:] == [
        ("reasoning", None),
        ("function_call", "call_look"),
        ("function_call", "call_pay"),
        ("function_call_output", "call_look"),
        ("function_call_output", "call_pay"),
    ]

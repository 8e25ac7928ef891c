"""The runtime end to end with the Anthropic provider (SPEC section 7).

Every test drives ``touba.Runtime`` with ``create_anthropic_decision_provider``
through the official ``anthropic`` SDK against ``FakeAnthropicServer``, which
speaks the Messages wire format and refuses what the real API refuses (a
``tool_use`` without its ``tool_result`` right after, results not first in
their user message, an orphan result, an altered thinking signature). "The
validator accepted it" means every request was answered 200.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import pytest
from pydantic import BaseModel, field_validator

from touba.errors import AgentBudgetExceeded, AgentDecisionProviderSchemaViolation
from touba.history import HistoryConfig
from touba.history.sqlite import SqliteHistoryStore
from touba.providers import ContextConfig, create_anthropic_decision_provider
from touba.runtime import (
    InvocationResult,
    MemoryCheckpointStore,
    Program,
    Runtime,
    SqliteCheckpointStore,
)
from touba.testing.fakes import (
    FakeAnthropicServer,
    anthropic_text,
    anthropic_thinking,
    anthropic_tool_use,
)
from touba.testing.fakes._anthropic_rules import check_messages

MODEL = "claude-e2e"
API_KEY = "sk-ant-e2e-do-not-leak-0123456789"
ADAPTIVE = {"type": "adaptive"}
Body = dict[str, Any]
Act = Callable[[Runtime], Awaitable[InvocationResult]]


@pytest.fixture
def server() -> Iterator[FakeAnthropicServer]:
    with FakeAnthropicServer() as srv:
        yield srv


def sdk(srv: FakeAnthropicServer) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=srv.base_url, api_key=API_KEY, max_retries=0)


@pytest.fixture
async def client(server: FakeAnthropicServer) -> AsyncIterator[anthropic.AsyncAnthropic]:
    async with sdk(server) as c:
        yield c


@pytest.fixture
def private_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "state"
    directory.mkdir(mode=0o700)
    return directory


# what went over the wire ---------------------------------------------------------


def generations(srv: FakeAnthropicServer) -> list[Body]:
    return [r.body for r in srv.requests_to("messages")]


def assert_accepted(srv: FakeAnthropicServer) -> None:
    """The fake's validator refused nothing, and every request re-validates cleanly."""
    assert [(r.endpoint, r.status) for r in srv.requests if r.status != 200] == []
    for body in generations(srv):
        problems = check_messages(body, srv.ledger, bind_prefix=srv.preserved_thinking)
        assert [p.message for p in problems] == []


def blocks(message: Body) -> list[tuple[str, str | None]]:
    """``(type, id or tool_use_id)`` of a message's content blocks."""
    return [(b["type"], b.get("id") or b.get("tool_use_id")) for b in message["content"]]


def results(body: Body) -> dict[str, dict[str, Any]]:
    """Every ``tool_result`` of a request, decoded, by tool_use_id (with ``is_error``)."""
    found: dict[str, dict[str, Any]] = {}
    for message in body["messages"]:
        if message["role"] != "user" or isinstance(message["content"], str):
            continue
        for block in message["content"]:
            if block["type"] == "tool_result":
                found[block["tool_use_id"]] = {
                    **json.loads(block["content"]),
                    "is_error": block.get("is_error", False),
                }
    return found


def tool_use_ids(body: Body) -> list[str]:
    return [
        b["id"]
        for m in body["messages"]
        if m["role"] == "assistant"
        for b in m["content"]
        if b["type"] == "tool_use"
    ]


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


def provider_for(client: anthropic.AsyncAnthropic, **kwargs: Any) -> Any:
    return create_anthropic_decision_provider(model=MODEL, client=client, **kwargs)


# the capability round trip -----------------------------------------------------


async def test_a_capability_round_trip_sends_tools_from_type_hints_and_pairs_the_result(
    server: FakeAnthropicServer, client: anthropic.AsyncAnthropic
) -> None:
    ran: list[str] = []
    runtime = Runtime(support_program(provider_for(client), ran))
    server.script_response(
        anthropic_text("Let me check."),
        anthropic_tool_use("lookup_order", {"order_id": "A1"}, id="toolu_1"),
    )
    server.script_response(anthropic_text("A1 has shipped."))

    result = completed(await runtime.invoke("support", input="Where is order A1?"))

    assert result.output == "A1 has shipped."
    assert ran == ["lookup A1"]
    first, second = generations(server)
    assert first["tools"] == [
        {
            "name": "lookup_order",
            "description": "Look up the status of an order.",
            "input_schema": {
                "type": "object",
                "properties": {"order_id": {"type": "string"}},
                "required": ["order_id"],
                "additionalProperties": False,
            },
        },
        {
            "name": "refund",
            "description": "Refund an order.",
            "input_schema": {
                "type": "object",
                "properties": {"order_id": {"type": "string"}, "amount": {"type": "number"}},
                "required": ["order_id", "amount"],
                "additionalProperties": False,
            },
        },
        {
            "name": "schedule_pickup",
            "description": "Schedule a pickup of a returned order.",
            "input_schema": {
                "type": "object",
                "properties": {"pickup": PICKUP_SCHEMA},
                "required": ["pickup"],
                "additionalProperties": False,
            },
        },
    ]
    assert (first["system"], first["model"]) == ("You are a support agent.", MODEL)
    assert first["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "Where is order A1?"}]}
    ]
    _, assistant, answer = second["messages"]
    assert blocks(assistant) == [("text", None), ("tool_use", "toolu_1")]
    assert blocks(answer) == [("tool_result", "toolu_1")]
    assert results(second) == {
        "toolu_1": {
            "status": "ok",
            "result": {"order_id": "A1", "status": "shipped"},
            "is_error": False,
        }
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
async def test_a_refused_call_goes_back_as_an_error_tool_result_and_never_runs(
    server: FakeAnthropicServer,
    client: anthropic.AsyncAnthropic,
    name: str,
    arguments: dict[str, Any],
    reason: str,
    says: str,
) -> None:
    ran: list[str] = []
    runtime = Runtime(support_program(provider_for(client), ran))
    server.script_response(anthropic_tool_use(name, arguments, id="toolu_x"))
    server.script_response(anthropic_text("I cannot do that."))

    result = completed(await runtime.invoke("support", input="Please help with A1."))

    assert ran == []
    (denial,) = result.trace.of_kind("denial")
    assert (denial["call_id"], denial["reason"]) == ("toolu_x", reason)
    sent = results(generations(server)[1])["toolu_x"]
    assert (sent["status"], sent["is_error"]) == ("denied", True)
    assert says in sent["error"]
    assert "Sunday" not in sent["error"]  # a refusal names the rule, not the value
    assert_accepted(server)


async def test_identical_calls_run_while_the_budget_lasts_then_are_denied(
    server: FakeAnthropicServer, client: anthropic.AsyncAnthropic
) -> None:
    ran: list[str] = []
    runtime = Runtime(support_program(provider_for(client), ran))
    for n in range(3):  # the same call three times; lookup_order has max_calls=2
        server.script_response(anthropic_tool_use("lookup_order", {"order_id": "A1"}, id=f"t{n}"))
    server.script_response(anthropic_text("A1 has shipped."))

    completed(await runtime.invoke("support", input="Check A1, then check again."))

    assert ran == ["lookup A1", "lookup A1"]
    last = generations(server)[-1]
    assert tool_use_ids(last) == ["t0", "t1", "t2"]
    sent = results(last)
    assert [sent[f"t{n}"]["status"] for n in range(3)] == ["ok", "ok", "denied"]
    assert "at most 2 time(s)" in sent["t2"]["error"]
    assert_accepted(server)


async def test_a_capability_removed_before_an_approved_resume_is_denied_as_not_in_catalog(
    server: FakeAnthropicServer, client: anthropic.AsyncAnthropic
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
    server.script_response(anthropic_tool_use("pay", {"invoice": "I-1"}, id="toolu_pay"))
    paused = await before.invoke("billing", input="Pay I-1")
    assert paused.status == "awaiting_approval"

    after = Runtime(deploy(("lookup_invoice",)), checkpoints=checkpoints)  # `pay` withdrawn
    server.script_response(anthropic_text("Payment is no longer possible."))
    result = completed(
        await after.resume(paused.checkpoint_id or "", approvals={"toolu_pay": True})
    )

    assert ran == []
    (denial,) = result.trace.of_kind("denial")
    assert denial["reason"] == "unknown_capability"
    last = generations(server)[-1]
    assert [t["name"] for t in last["tools"]] == ["lookup_invoice"]
    assert results(last)["toolu_pay"]["status"] == "denied"
    assert_accepted(server)


# concurrency, failures, budgets --------------------------------------------------


async def test_parallel_calls_run_concurrently_and_all_results_come_first_in_one_message(
    server: FakeAnthropicServer, client: anthropic.AsyncAnthropic
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
        anthropic_text("Checking all three."),
        *(anthropic_tool_use("lookup_order", {"order_id": o}, id=f"t_{o}") for o in "ABC"),
    )
    server.script_response(anthropic_text("All three have shipped."))

    completed(await Runtime(program).invoke("support", input="A, B and C?"))

    second = generations(server)[1]
    assert [m["role"] for m in second["messages"]] == ["user", "assistant", "user"]
    assert blocks(second["messages"][2]) == [
        ("tool_result", "t_A"),
        ("tool_result", "t_B"),
        ("tool_result", "t_C"),
    ]
    assert results(second)["t_B"] == {"status": "ok", "result": "B: shipped", "is_error": False}
    assert_accepted(server)


async def test_a_raising_capability_is_an_error_tool_result_and_the_model_goes_on(
    server: FakeAnthropicServer, client: anthropic.AsyncAnthropic
) -> None:
    program = Program()

    @program.capability
    def lookup_order(order_id: str) -> str:  # sync: runs in a worker thread
        """Look up the status of an order."""
        raise ConnectionError("warehouse offline")

    program.agent("support", provider=provider_for(client), capabilities=("lookup_order",))
    server.script_response(anthropic_tool_use("lookup_order", {"order_id": "A1"}, id="t1"))
    server.script_response(anthropic_text("The warehouse is offline; try later."))

    result = completed(await Runtime(program).invoke("support", input="A1?"))

    assert results(generations(server)[1]) == {
        "t1": {"status": "error", "error": "ConnectionError: warehouse offline", "is_error": True}
    }
    (observation,) = result.trace.of_kind("observation")
    assert observation["status"] == "error"
    assert_accepted(server)


async def test_max_decisions_exhausted_fails_with_agent_budget_exceeded(
    server: FakeAnthropicServer, client: anthropic.AsyncAnthropic
) -> None:
    ran: list[str] = []
    runtime = Runtime(support_program(provider_for(client), ran, max_decisions=2))
    server.script_response(anthropic_tool_use("lookup_order", {"order_id": "A1"}))
    server.script_response(anthropic_tool_use("lookup_order", {"order_id": "B2"}))

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
    ("content", "stop_reason", "code"),
    [
        ([anthropic_tool_use("drop_tables", {})], None, "unknown_capability"),
        (
            [anthropic_tool_use("lookup_order", {"order_id": 7})],
            None,
            "arguments_schema_mismatch",
        ),
        ([anthropic_text("The order A1 is")], "max_tokens", "truncated_output"),
        ([anthropic_text("I will not help.")], "refusal", "refusal"),
        ([], None, "empty_output"),
    ],
)
async def test_a_response_without_a_valid_decision_fails_with_its_provider_error_code(
    server: FakeAnthropicServer,
    client: anthropic.AsyncAnthropic,
    content: list[Body],
    stop_reason: str | None,
    code: str,
) -> None:
    ran: list[str] = []
    runtime = Runtime(support_program(provider_for(client), ran))
    server.script_response(*content, stop_reason=stop_reason)

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
    srv: FakeAnthropicServer,
    directory: Path,
    *,
    durable_history: bool,
    ran: list[str],
    act: Act,
) -> InvocationResult:
    """One worker process: its own client, provider, stores and runtime, all closed after.

    ``durable_history`` keeps the conversation in SQLite next to the
    checkpoints; otherwise it lives in this worker's RAM and dies with it.
    The model thinks (adaptive thinking): its signed blocks must survive.
    """
    async with sdk(srv) as client, SqliteCheckpointStore(directory / "checkpoints.sqlite") as cps:
        if durable_history:
            async with SqliteHistoryStore(directory / "history.sqlite") as store:
                history = HistoryConfig(store=store, namespace="billing-prod")
                provider = provider_for(client, history=history, thinking=ADAPTIVE)
                return await act(Runtime(billing_program(provider, ran), cps))
        provider = provider_for(client, thinking=ADAPTIVE)
        return await act(Runtime(billing_program(provider, ran), cps))


async def pause_in_worker(
    srv: FakeAnthropicServer, directory: Path, *, durable_history: bool
) -> tuple[InvocationResult, list[str]]:
    ran: list[str] = []
    srv.script_response(
        anthropic_thinking("read the invoice, then pay it"),
        anthropic_tool_use("lookup_invoice", {"invoice": "I-1"}, id="toolu_look"),
        anthropic_tool_use("pay", {"invoice": "I-1"}, id="toolu_pay"),
    )

    async def invoke(runtime: Runtime) -> InvocationResult:
        return await runtime.invoke("billing", input="Pay invoice I-1", run_id="run-42")

    paused = await run_in_worker(
        srv, directory, durable_history=durable_history, ran=ran, act=invoke
    )
    assert paused.status == "awaiting_approval", paused.error
    assert [c.call_id for c in paused.pending] == ["toolu_pay"]
    return paused, ran


@pytest.mark.parametrize("approved", [True, False])
async def test_approval_resumed_by_another_worker_pairs_the_old_calls_with_their_results(
    private_dir: Path, approved: bool
) -> None:
    with FakeAnthropicServer(preserved_thinking=True) as server:
        paused, ran_before = await pause_in_worker(server, private_dir, durable_history=True)
        assert ran_before == ["lookup I-1"]  # the other call of the decision ran before the stop

        ran_after: list[str] = []
        server.script_response(anthropic_text("Paid." if approved else "Payment was refused."))

        async def resume(runtime: Runtime) -> InvocationResult:
            return await runtime.resume(paused.checkpoint_id or "", {"toolu_pay": approved})

        result = completed(
            await run_in_worker(
                server, private_dir, durable_history=True, ran=ran_after, act=resume
            )
        )

        assert (result.run_id, result.invocation_id, result.agent_ref) == (
            "run-42",
            paused.invocation_id,
            "billing",
        )
        assert ran_after == (["pay I-1"] if approved else [])
        _, after = generations(server)
        assert [m["role"] for m in after["messages"]] == ["user", "assistant", "user"]
        replayed = after["messages"][1]
        assert blocks(replayed) == [
            ("thinking", None),
            ("tool_use", "toolu_look"),
            ("tool_use", "toolu_pay"),
        ]
        # The signed thinking block came back from SQLite in another worker, unchanged.
        assert replayed["content"][0]["signature"]
        assert blocks(after["messages"][2]) == [
            ("tool_result", "toolu_look"),
            ("tool_result", "toolu_pay"),
        ]
        sent = results(after)
        assert sent["toolu_look"]["result"] == {"invoice": "I-1", "amount": "12.00"}
        if approved:
            assert sent["toolu_pay"] == {"status": "ok", "result": "paid", "is_error": False}
            assert result.trace.of_kind("approval_granted")
        else:
            assert (sent["toolu_pay"]["status"], sent["toolu_pay"]["is_error"]) == ("denied", True)
            assert "not approved" in sent["toolu_pay"]["error"]
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
    server: FakeAnthropicServer, private_dir: Path
) -> None:
    paused, _ = await pause_in_worker(server, private_dir, durable_history=False)
    server.script_response(anthropic_text("Paid."))
    ran: list[str] = []

    async def resume(runtime: Runtime) -> InvocationResult:
        return await runtime.resume(paused.checkpoint_id or "", {"toolu_pay": True})

    result = completed(
        await run_in_worker(server, private_dir, durable_history=False, ran=ran, act=resume)
    )

    assert ran == ["pay I-1"]
    assert len(history_events(result, "resumed_without_messages")) == 1
    after = generations(server)[-1]
    (message,) = after["messages"]  # one user message: the input, then the data
    assert message["role"] == "user"
    assert [b["type"] for b in message["content"]] == ["text", "text"]
    data = message["content"][1]["text"]
    assert "data, not instructions" in data
    assert '"capability":"lookup_invoice"' in data
    assert '"result":"paid"' in data
    assert results(after) == {}  # no tool_result without its tool_use
    assert "toolu_pay" not in json.dumps(after)  # no invented call id
    assert_accepted(server)


# delegation ----------------------------------------------------------------------


async def test_a_delegated_agent_has_its_own_invocation_and_history(
    server: FakeAnthropicServer, client: anthropic.AsyncAnthropic
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
        anthropic_tool_use("researcher", {"input": "Status of A1?"}, id="toolu_sub")
    )
    server.script_response(anthropic_tool_use("lookup_order", {"order_id": "A1"}))
    server.script_response(anthropic_text("A1: shipped"))
    server.script_response(anthropic_text("Your order A1 has shipped."))

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
        assert body["system"] == "You research orders."
        assert body["messages"][0] == {
            "role": "user",
            "content": [{"type": "text", "text": "Status of A1?"}],
        }
        assert "SECRET-PARENT" not in json.dumps(body)
        assert "toolu_sub" not in json.dumps(body)
    assert [t["name"] for t in parent_1["tools"]] == ["researcher"]
    assert parent_1["tools"][0]["input_schema"]["required"] == ["input"]
    assert results(parent_2) == {
        "toolu_sub": {"status": "ok", "result": "A1: shipped", "is_error": False}
    }
    assert "lookup_order" not in json.dumps(parent_2["messages"])
    assert_accepted(server)


# the context guard ---------------------------------------------------------------


def results_cost(body: Body) -> int:
    """Deterministic counts: 100 tokens plus 1000 per tool_result block."""
    return 100 + 1000 * json.dumps(body["messages"]).count('"tool_result"')


async def test_guard_counts_are_traced_and_a_trim_happens_before_generation() -> None:
    with FakeAnthropicServer(count_tokens=results_cost) as srv:
        async with sdk(srv) as client:
            provider = provider_for(
                client,
                # fits while 100 + 1000 * results + 100 <= 2300: at most two results
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
                    anthropic_tool_use("lookup_order", {"order_id": order}, id=order)
                )
            srv.script_response(anthropic_text("All shipped."))
            result = completed(await Runtime(program).invoke("support", input="A1, B2, C3?"))

        counts = history_events(result, "provider_context_count")
        assert [(e["count"], e["fits"]) for e in counts[:3]] == [
            (100, True),
            (1100, True),
            (2100, True),
        ]
        assert (counts[3]["count"], counts[3]["fits"]) == (3100, False)
        assert counts[-1]["fits"] is True
        assert all(e["provider"] == "anthropic" and e["window"] == 2300 for e in counts)
        assert counts[-1]["reserve"] == counts[-1]["count"] + 100
        (trimmed,) = history_events(result, "history_trimmed")
        assert trimmed["removed_exchanges"] == 1
        # Counted before each generation, and the too-large request was never generated.
        endpoints = [r.endpoint for r in srv.requests]
        assert endpoints[:6] == ["count_tokens", "messages"] * 3
        assert endpoints[-1] == "messages"
        assert set(endpoints[6:-1]) == {"count_tokens"}
        last = generations(srv)[-1]
        assert list(results(last)) == ["B2", "C3"]
        assert tool_use_ids(last) == ["B2", "C3"]  # A1's call left with its result
        assert last["messages"][0]["content"][0]["text"] == "A1, B2, C3?"  # never trimmed
        assert all(results_cost(b) + 100 <= 2300 for b in generations(srv))
        for entry in counts:  # sizes only, never content
            assert "shipped" not in json.dumps(entry.to_dict())
        assert_accepted(srv)


# keys ----------------------------------------------------------------------------


async def test_the_exported_trace_and_the_stored_history_hold_no_api_key(
    server: FakeAnthropicServer, client: anthropic.AsyncAnthropic, private_dir: Path
) -> None:
    async with SqliteHistoryStore(private_dir / "history.sqlite") as store:
        provider = provider_for(
            client,
            history=HistoryConfig(store=store, namespace="support-prod"),
            context=ContextConfig(32768),
            max_output_tokens=500,
        )
        ran: list[str] = []
        server.script_response(anthropic_tool_use("lookup_order", {"order_id": "A1"}))
        server.script_response(anthropic_text("Shipped."))
        result = completed(await Runtime(support_program(provider, ran)).invoke("support", "A1?"))
        (row,) = await store.list()
        record = await store.read(row.key)

    exported = result.trace.to_jsonl()
    assert len(exported.splitlines()) == len(result.trace)
    assert history_events(result, "provider_context_count")
    for text in (exported, json.dumps(record)):
        assert API_KEY not in text
        assert "x-api-key" not in text.lower()
    for name in ("history.sqlite", "history.sqlite-wal"):
        path = private_dir / name
        if path.exists():
            assert API_KEY.encode() not in path.read_bytes()


# the structured interface --------------------------------------------------------


async def test_structured_interface_round_trip_through_the_runtime(
    server: FakeAnthropicServer, client: anthropic.AsyncAnthropic
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
    server.script_response(anthropic_tool_use("touba_decision", call, id="toolu_d1"))
    server.script_response(
        anthropic_tool_use("touba_decision", {"action": "final", "output": "Shipped."})
    )

    result = completed(await runtime.invoke("support", input="Where is A1? Refund it."))

    assert result.output == "Shipped."
    assert ran == ["lookup A1"]  # refund: permission denied, as in the native interface
    assert [d["reason"] for d in result.trace.of_kind("denial")] == ["permission_denied"]
    first, second = generations(server)
    assert [t["name"] for t in first["tools"]] == ["touba_decision"]
    assert first["tool_choice"]["name"] == "touba_decision"
    assert "lookup_order" in json.dumps(first["tools"][0]["input_schema"])
    _, assistant, answer = second["messages"]
    assert blocks(assistant) == [("tool_use", "toolu_d1")]
    (block,) = answer["content"]
    assert (block["type"], block["tool_use_id"]) == ("tool_result", "toolu_d1")
    assert '"status":"ok"' in block["content"]
    assert '"status":"denied"' in block["content"]
    assert_accepted(server)

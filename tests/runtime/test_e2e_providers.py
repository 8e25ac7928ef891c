"""The runtime end to end with each provider (SPEC section 7).

Every test runs once per wire (``_wires.py``): it drives ``touba.Runtime``
with that provider's decision provider through its official SDK against its
fake server, which speaks the real wire format and refuses what the real API
refuses (OpenAI: a ``function_call`` without its output, an output without its
call, an altered reasoning item; Anthropic: a ``tool_use`` without its
``tool_result`` right after, results not first in their user message, an
orphan result, an altered thinking signature). "The validator accepted it"
means every request was answered 200.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, field_validator

from tests.runtime._wires import WIRES, Broken, Wire
from touba.errors import AgentBudgetExceeded, AgentDecisionProviderSchemaViolation
from touba.history import HistoryConfig
from touba.history.sqlite import SqliteHistoryStore
from touba.providers import ContextConfig
from touba.runtime import (
    InvocationResult,
    MemoryCheckpointStore,
    Program,
    Runtime,
    SqliteCheckpointStore,
)
from touba.testing.fakes import FakeProviderServer

AnyWire = Wire[Any, Any]
Act = Callable[[Runtime], Awaitable[InvocationResult]]


@pytest.fixture(params=WIRES, ids=repr)
def wire(request: pytest.FixtureRequest) -> AnyWire:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture
def server(wire: AnyWire) -> Iterator[FakeProviderServer]:
    with wire.fake() as srv:
        yield srv


@pytest.fixture
async def client(wire: AnyWire, server: FakeProviderServer) -> AsyncIterator[Any]:
    async with wire.sdk(server) as c:
        yield c


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


# the capability round trip -----------------------------------------------------


async def test_a_capability_round_trip_sends_tools_from_type_hints_and_pairs_the_result(
    wire: AnyWire, server: Any, client: Any
) -> None:
    ran: list[str] = []
    runtime = Runtime(support_program(wire.provider(client), ran))
    server.script_response(
        wire.preface("look it up"), wire.call("lookup_order", {"order_id": "A1"}, id="call_1")
    )
    server.script_response(wire.text("A1 has shipped."))

    result = completed(await runtime.invoke("support", input="Where is order A1?"))

    assert result.output == "A1 has shipped."
    assert ran == ["lookup A1"]
    first, second = wire.generations(server)
    lookup = {
        "type": "object",
        "properties": {"order_id": {"type": "string"}},
        "required": ["order_id"],
        "additionalProperties": False,
    }
    refund = {
        "type": "object",
        "properties": {"order_id": {"type": "string"}, "amount": {"type": "number"}},
        "required": ["order_id", "amount"],
        "additionalProperties": False,
    }
    pickup = {
        "type": "object",
        "properties": {"pickup": PICKUP_SCHEMA},
        "required": ["pickup"],
        "additionalProperties": False,
    }
    assert first["tools"] == [
        wire.tool("lookup_order", "Look up the status of an order.", lookup),
        wire.tool("refund", "Refund an order.", refund),
        wire.tool("schedule_pickup", "Schedule a pickup of a returned order.", pickup),
    ]
    assert wire.system(first) == "You are a support agent."
    assert wire.messages(first) == [wire.user("Where is order A1?")]
    assert wire.turn(second) == [
        (wire.preface_kind, None),
        ("call", "call_1"),
        ("result", "call_1"),
    ]
    assert wire.results(second) == {
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
    wire.assert_accepted(server)


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
async def test_a_refused_call_goes_back_as_a_denied_result_and_never_runs(
    wire: AnyWire,
    server: Any,
    client: Any,
    name: str,
    arguments: dict[str, Any],
    reason: str,
    says: str,
) -> None:
    ran: list[str] = []
    runtime = Runtime(support_program(wire.provider(client), ran))
    server.script_response(wire.call(name, arguments, id="call_x"))
    server.script_response(wire.text("I cannot do that."))

    result = completed(await runtime.invoke("support", input="Please help with A1."))

    assert ran == []
    (denial,) = result.trace.of_kind("denial")
    assert (denial["call_id"], denial["reason"]) == ("call_x", reason)
    sent = wire.results(wire.generations(server)[1])["call_x"]
    assert sent["status"] == "denied"
    assert says in sent["error"]
    assert "Sunday" not in sent["error"]  # a refusal names the rule, not the value
    wire.assert_accepted(server)


async def test_identical_calls_run_while_the_budget_lasts_then_are_denied(
    wire: AnyWire, server: Any, client: Any
) -> None:
    ran: list[str] = []
    runtime = Runtime(support_program(wire.provider(client), ran))
    for n in range(3):  # the same call three times; lookup_order has max_calls=2
        server.script_response(wire.call("lookup_order", {"order_id": "A1"}, id=f"call_{n}"))
    server.script_response(wire.text("A1 has shipped."))

    completed(await runtime.invoke("support", input="Check A1, then check again."))

    assert ran == ["lookup A1", "lookup A1"]
    last = wire.generations(server)[-1]
    assert wire.call_ids(last) == ["call_0", "call_1", "call_2"]
    sent = wire.results(last)
    assert [sent[f"call_{n}"]["status"] for n in range(3)] == ["ok", "ok", "denied"]
    assert "at most 2 time(s)" in sent["call_2"]["error"]
    wire.assert_accepted(server)


async def test_a_capability_removed_before_an_approved_resume_is_denied_as_not_in_catalog(
    wire: AnyWire, server: Any, client: Any
) -> None:
    """The runtime's catalog check, through the wire.

    The provider itself refuses a call to a tool it did not offer (a schema
    violation, see below), so a call outside the agent's catalog meets the
    runtime's check when the program changed between a pause and its resume:
    an approved call is checked again against the resuming program.
    """
    ran: list[str] = []
    provider = wire.provider(client)  # one conversation store for both deploys

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
    server.script_response(wire.call("pay", {"invoice": "I-1"}, id="call_pay"))
    paused = await before.invoke("billing", input="Pay I-1")
    assert paused.status == "awaiting_approval"

    after = Runtime(deploy(("lookup_invoice",)), checkpoints=checkpoints)  # `pay` withdrawn
    server.script_response(wire.text("Payment is no longer possible."))
    result = completed(await after.resume(paused.checkpoint_id or "", approvals={"call_pay": True}))

    assert ran == []
    (denial,) = result.trace.of_kind("denial")
    assert denial["reason"] == "unknown_capability"
    last = wire.generations(server)[-1]
    assert [t["name"] for t in last["tools"]] == ["lookup_invoice"]
    assert wire.call_ids(last) == ["call_pay"]
    assert wire.results(last)["call_pay"]["status"] == "denied"
    wire.assert_accepted(server)


# concurrency, failures, budgets --------------------------------------------------


async def test_parallel_calls_of_one_decision_run_concurrently_and_all_results_go_back_together(
    wire: AnyWire, server: Any, client: Any
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

    orders = ("A1", "B2", "C3")
    program.agent("support", provider=wire.provider(client), capabilities=("lookup_order",))
    server.script_response(
        wire.preface("three lookups at once"),
        *(wire.call("lookup_order", {"order_id": o}, id=f"call_{o}") for o in orders),
    )
    server.script_response(wire.text("All three have shipped."))

    completed(await Runtime(program).invoke("support", input="A1, B2 and C3?"))

    second = wire.generations(server)[1]
    assert wire.turn(second) == [
        (wire.preface_kind, None),
        *(("call", f"call_{o}") for o in orders),
        *(("result", f"call_{o}") for o in orders),
    ]
    assert wire.results(second)["call_B2"] == {"status": "ok", "result": "B2: shipped"}
    wire.assert_accepted(server)


async def test_a_raising_capability_is_an_error_result_and_the_model_goes_on(
    wire: AnyWire, server: Any, client: Any
) -> None:
    program = Program()

    @program.capability
    def lookup_order(order_id: str) -> str:  # sync: runs in a worker thread
        """Look up the status of an order."""
        raise ConnectionError("warehouse offline")

    program.agent("support", provider=wire.provider(client), capabilities=("lookup_order",))
    server.script_response(wire.call("lookup_order", {"order_id": "A1"}, id="c"))
    server.script_response(wire.text("The warehouse is offline; try later."))

    result = completed(await Runtime(program).invoke("support", input="A1?"))

    assert wire.results(wire.generations(server)[1]) == {
        "c": {"status": "error", "error": "ConnectionError: warehouse offline"}
    }
    (observation,) = result.trace.of_kind("observation")
    assert observation["status"] == "error"
    wire.assert_accepted(server)


async def test_max_decisions_exhausted_fails_with_agent_budget_exceeded(
    wire: AnyWire, server: Any, client: Any
) -> None:
    ran: list[str] = []
    runtime = Runtime(support_program(wire.provider(client), ran, max_decisions=2))
    server.script_response(wire.call("lookup_order", {"order_id": "A1"}))
    server.script_response(wire.call("lookup_order", {"order_id": "B2"}))

    result = await runtime.invoke("support", input="Check everything.")

    assert result.status == "failed"
    assert isinstance(result.error, AgentBudgetExceeded)
    assert result.error.max_decisions == 2
    assert ran == ["lookup A1"]  # the last decision's calls were not run
    (failed,) = result.trace.of_kind("invocation_failed")
    assert failed["error_code"] == "AgentBudgetExceeded"
    assert len(wire.generations(server)) == 2
    wire.assert_accepted(server)


@pytest.mark.parametrize(
    ("wire", "broken"),
    [pytest.param(w, b, id=f"{w!r}-{b.code}") for w in WIRES for b in w.broken],
)
async def test_a_response_without_a_valid_decision_fails_with_its_provider_error_code(
    wire: AnyWire, server: Any, client: Any, broken: Broken
) -> None:
    ran: list[str] = []
    runtime = Runtime(support_program(wire.provider(client), ran))
    server.script_response(*broken.items, **broken.options)

    result = await runtime.invoke("support", input="Where is A1?")

    assert result.status == "failed"
    assert isinstance(result.error, AgentDecisionProviderSchemaViolation)
    assert result.error.provider_error_code == broken.code
    (error,) = result.trace.of_kind("provider_error")
    assert (error["error_code"], error["provider_error_code"]) == (
        "AgentDecisionProviderSchemaViolation",
        broken.code,
    )
    assert result.trace.of_kind("invocation_failed")[0]["provider_error_code"] == broken.code
    assert ran == []
    assert len(wire.generations(server)) == 1  # a received response is never retried


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
    wire: AnyWire,
    srv: FakeProviderServer,
    directory: Path,
    *,
    durable_history: bool,
    ran: list[str],
    act: Act,
) -> InvocationResult:
    """One worker process: its own client, provider, stores and runtime, all closed after.

    ``durable_history`` keeps the conversation in SQLite next to the
    checkpoints; otherwise it lives in this worker's RAM and dies with it.
    The model may think (Anthropic: adaptive thinking): its signed blocks must survive.
    """
    options = dict(wire.worker_options)
    async with (
        wire.sdk(srv) as client,
        SqliteCheckpointStore(directory / "checkpoints.sqlite") as cps,
    ):
        if durable_history:
            async with SqliteHistoryStore(directory / "history.sqlite") as store:
                history = HistoryConfig(store=store, namespace="billing-prod")
                provider = wire.provider(client, history=history, **options)
                return await act(Runtime(billing_program(provider, ran), cps))
        return await act(Runtime(billing_program(wire.provider(client, **options), ran), cps))


async def pause_in_worker(
    wire: AnyWire, srv: Any, directory: Path, *, durable_history: bool
) -> tuple[InvocationResult, list[str]]:
    ran: list[str] = []
    srv.script_response(
        wire.thought("look, then pay"),
        wire.call("lookup_invoice", {"invoice": "I-1"}, id="call_look"),
        wire.call("pay", {"invoice": "I-1"}, id="call_pay"),
    )

    async def invoke(runtime: Runtime) -> InvocationResult:
        return await runtime.invoke("billing", input="Pay invoice I-1", run_id="run-42")

    paused = await run_in_worker(
        wire, srv, directory, durable_history=durable_history, ran=ran, act=invoke
    )
    assert paused.status == "awaiting_approval", paused.error
    assert [c.call_id for c in paused.pending] == ["call_pay"]
    return paused, ran


def assert_paid_turn(wire: AnyWire, body: dict[str, Any]) -> None:
    """The paused decision replayed whole: its thought, both calls, then both results."""
    assert wire.turn(body) == [
        (wire.thought_kind, None),
        ("call", "call_look"),
        ("call", "call_pay"),
        ("result", "call_look"),
        ("result", "call_pay"),
    ]


@pytest.mark.parametrize("approved", [True, False])
async def test_approval_resumed_by_another_worker_pairs_the_old_calls_with_their_results(
    wire: AnyWire, private_dir: Path, approved: bool
) -> None:
    with wire.fake(**wire.bound_replay) as server:
        paused, ran_before = await pause_in_worker(wire, server, private_dir, durable_history=True)
        assert ran_before == ["lookup I-1"]  # the other call of the decision ran before the stop

        ran_after: list[str] = []
        server.script_response(wire.text("Paid." if approved else "Payment was refused."))

        async def resume(runtime: Runtime) -> InvocationResult:
            return await runtime.resume(paused.checkpoint_id or "", {"call_pay": approved})

        result = completed(
            await run_in_worker(
                wire, server, private_dir, durable_history=True, ran=ran_after, act=resume
            )
        )

        assert (result.run_id, result.invocation_id, result.agent_ref) == (
            "run-42",
            paused.invocation_id,
            "billing",
        )
        assert ran_after == (["pay I-1"] if approved else [])
        _, after = wire.generations(server)
        assert_paid_turn(wire, after)
        # The signed thought came back from SQLite in another worker, unchanged.
        assert wire.thought_token(after)
        sent = wire.results(after)
        assert sent["call_look"] == {
            "status": "ok",
            "result": {"invoice": "I-1", "amount": "12.00"},
        }
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
        wire.assert_accepted(server)

    async with SqliteHistoryStore(private_dir / "history.sqlite") as store:
        (row,) = await store.list("billing-prod")
        record = await store.read(row.key)
    assert record is not None
    assert record["identity"]["invocation_id"] == paused.invocation_id
    assert (record["stats"]["exchanges"], record["pending"]) == (2, [])


async def test_resume_after_a_restart_with_ram_only_history_sends_observations_as_data(
    wire: AnyWire, server: Any, private_dir: Path
) -> None:
    paused, _ = await pause_in_worker(wire, server, private_dir, durable_history=False)
    server.script_response(wire.text("Paid."))
    ran: list[str] = []

    async def resume(runtime: Runtime) -> InvocationResult:
        return await runtime.resume(paused.checkpoint_id or "", {"call_pay": True})

    result = completed(
        await run_in_worker(wire, server, private_dir, durable_history=False, ran=ran, act=resume)
    )

    assert ran == ["pay I-1"]
    assert len(history_events(result, "resumed_without_messages")) == 1
    after = wire.generations(server)[-1]
    data = wire.data_message(after)
    assert "data, not instructions" in data
    assert '"capability":"lookup_invoice"' in data
    assert '"result":"paid"' in data
    assert wire.results(after) == {}  # no result without its call
    assert "call_pay" not in json.dumps(after)  # no invented call id
    wire.assert_accepted(server)


async def test_a_503_after_an_approved_payment_is_retried_from_another_worker_paying_once(
    wire: AnyWire, server: Any, private_dir: Path
) -> None:
    """Issue 8: the provider fails on the generation right after the approved call ran;
    the checkpoint survives, and a resume in a third worker completes without paying again."""
    paused, ran_before = await pause_in_worker(wire, server, private_dir, durable_history=True)
    assert ran_before == ["lookup I-1"]
    server.script_error(503)

    async def approve(runtime: Runtime) -> InvocationResult:
        return await runtime.resume(paused.checkpoint_id or "", {"call_pay": True})

    ran: list[str] = []
    failed = await run_in_worker(
        wire, server, private_dir, durable_history=True, ran=ran, act=approve
    )
    assert failed.status == "failed"
    assert failed.error is not None
    assert failed.error.retryable
    assert failed.checkpoint_id not in (None, paused.checkpoint_id)
    assert ran == ["pay I-1"]

    server.script_response(wire.text("Paid."))

    async def retry(runtime: Runtime) -> InvocationResult:
        return await runtime.resume(failed.checkpoint_id or "")

    done = completed(
        await run_in_worker(wire, server, private_dir, durable_history=True, ran=ran, act=retry)
    )
    assert done.invocation_id == paused.invocation_id
    assert ran == ["pay I-1"]  # exactly once across three workers
    statuses = [r.status for r in server.requests_to(server.generation_endpoint)]
    assert statuses == [200, 503, 200]
    last = wire.generations(server)[-1]
    assert wire.results(last)["call_pay"] == {"status": "ok", "result": "paid"}
    assert_paid_turn(wire, last)


# delegation ----------------------------------------------------------------------


async def test_a_delegated_agent_has_its_own_invocation_and_history(
    wire: AnyWire, server: Any, client: Any
) -> None:
    program = Program()
    provider = wire.provider(client)  # one provider for both agents: still two conversations

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
    server.script_response(wire.call("researcher", {"input": "Status of A1?"}, id="call_sub"))
    server.script_response(wire.call("lookup_order", {"order_id": "A1"}))
    server.script_response(wire.text("A1: shipped"))
    server.script_response(wire.text("Your order A1 has shipped."))

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

    parent_1, child_1, child_2, parent_2 = wire.generations(server)
    for body in (child_1, child_2):
        assert wire.system(body) == "You research orders."
        assert wire.messages(body)[0] == wire.user("Status of A1?")
        assert "SECRET-PARENT" not in json.dumps(body)
        assert "call_sub" not in json.dumps(body)
    assert [t["name"] for t in parent_1["tools"]] == ["researcher"]
    assert wire.parameters(parent_1["tools"][0])["required"] == ["input"]
    assert wire.results(parent_2) == {"call_sub": {"status": "ok", "result": "A1: shipped"}}
    assert "lookup_order" not in json.dumps(wire.messages(parent_2))
    wire.assert_accepted(server)


# the context guard ---------------------------------------------------------------


async def test_guard_counts_are_traced_and_a_trim_happens_before_generation(
    wire: AnyWire,
) -> None:
    with wire.fake(count_tokens=wire.cost) as srv:
        async with wire.sdk(srv) as client:
            provider = wire.provider(
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
                srv.script_response(wire.call("lookup_order", {"order_id": order}, id=order))
            srv.script_response(wire.text("All shipped."))
            result = completed(await Runtime(program).invoke("support", input="A1, B2, C3?"))

        counts = history_events(result, "provider_context_count")
        assert [(e["count"], e["fits"]) for e in counts[:3]] == [
            (100, True),
            (1100, True),
            (2100, True),
        ]
        assert counts[3]["count"] == 3100
        assert counts[3]["fits"] is False
        assert counts[-1]["fits"] is True
        assert all(e["provider"] == wire.name and e["window"] == 2300 for e in counts)
        assert counts[-1]["reserve"] == counts[-1]["count"] + 100
        (trimmed,) = history_events(result, "history_trimmed")
        assert trimmed["removed_exchanges"] == 1
        # Counted before each generation, and the too-large request was never generated.
        endpoints = [r.endpoint for r in srv.requests]
        assert endpoints[:6] == [wire.counting, srv.generation_endpoint] * 3
        assert endpoints[-1] == srv.generation_endpoint
        assert set(endpoints[6:-1]) == {wire.counting}
        last = wire.generations(srv)[-1]
        assert list(wire.results(last)) == ["B2", "C3"]
        assert wire.call_ids(last) == ["B2", "C3"]  # A1's call left with its result
        assert wire.messages(last)[0] == wire.user("A1, B2, C3?")  # never trimmed
        assert all(wire.cost(b) + 100 <= 2300 for b in wire.generations(srv))
        for entry in counts:  # sizes only, never content
            assert "shipped" not in json.dumps(entry.to_dict())
        wire.assert_accepted(srv)


# keys ----------------------------------------------------------------------------


async def test_the_exported_trace_and_the_stored_history_hold_no_api_key(
    wire: AnyWire, server: Any, client: Any, private_dir: Path
) -> None:
    async with SqliteHistoryStore(private_dir / "history.sqlite") as store:
        provider = wire.provider(
            client,
            history=HistoryConfig(store=store, namespace="support-prod"),
            context=ContextConfig(32768),
            max_output_tokens=500,
        )
        ran: list[str] = []
        server.script_response(wire.call("lookup_order", {"order_id": "A1"}))
        server.script_response(wire.text("Shipped."))
        result = completed(await Runtime(support_program(provider, ran)).invoke("support", "A1?"))
        (row,) = await store.list()
        record = await store.read(row.key)

    exported = result.trace.to_jsonl()
    assert len(exported.splitlines()) == len(result.trace)
    assert history_events(result, "provider_context_count")
    for text in (exported, json.dumps(record)):
        assert wire.api_key not in text
        for header in ("bearer", "authorization", "x-api-key"):  # each wire's auth header
            assert header not in text.lower()
    for name in ("history.sqlite", "history.sqlite-wal"):
        path = private_dir / name
        if path.exists():
            assert wire.api_key.encode() not in path.read_bytes()


# the structured interface --------------------------------------------------------


async def test_structured_interface_round_trip_through_the_runtime(
    wire: AnyWire, server: Any, client: Any
) -> None:
    ran: list[str] = []
    provider = wire.provider(client, decision_interface="structured")
    runtime = Runtime(support_program(provider, ran))
    call = {
        "action": "call",
        "calls": [
            {"name": "lookup_order", "arguments": {"order_id": "A1"}},
            {"name": "refund", "arguments": {"order_id": "A1", "amount": 5}},
        ],
    }
    server.script_response(wire.decision(call, id="toolu_d1"))
    server.script_response(wire.decision({"action": "final", "output": "Shipped."}))

    result = completed(await runtime.invoke("support", input="Where is A1? Refund it."))

    assert result.output == "Shipped."
    assert ran == ["lookup A1"]  # refund: permission denied, as in the native interface
    assert [d["reason"] for d in result.trace.of_kind("denial")] == ["permission_denied"]
    first, second = wire.generations(server)
    wire.check_structured(first, second)
    wire.assert_accepted(server)

"""Delegated agents and parallel branches: separate invocations, never shared history."""

from __future__ import annotations

import asyncio
from typing import Any

from touba.providers import DecisionRequest
from touba.runtime import MemoryCheckpointStore, Program, Runtime
from touba.testing import ScriptedProvider

from ._helpers import final, sent_json, step


def worker_step(request: DecisionRequest, sent: list[dict[str, Any]]) -> dict[str, Any]:
    """A child model: meet the sibling once, then answer with its own input."""
    if not request.observations:
        return step((f"m-{request.input}", "meet", {"who": str(request.input)}))
    return final(f"{request.input} done")


async def test_a_delegated_agent_is_a_separate_invocation_with_its_own_history() -> None:
    program = Program()
    program.delegate("research", description="Ask the research agent.")
    parent = ScriptedProvider(
        step(("d1", "research", {"input": "find the PARENT-TASK detail"})),
        final("answered"),
    )
    child = ScriptedProvider(final("CHILD-ANSWER"))
    program.agent(
        "support", provider=parent, instructions="PARENT-INSTRUCTIONS", capabilities=("research",)
    )
    program.agent("research", provider=child, instructions="CHILD-INSTRUCTIONS")
    result = await Runtime(program).invoke("support", input="PARENT-INPUT", run_id="run-9")
    assert result.status == "completed"

    [child_request] = child.requests
    assert child_request.run_id == "run-9"
    assert child_request.agent_ref == "research"
    assert child_request.invocation_id not in (None, result.invocation_id)
    assert child_request.input == "find the PARENT-TASK detail"
    child_sent = sent_json(child.sent[0])
    assert "PARENT-INPUT" not in child_sent
    assert "PARENT-INSTRUCTIONS" not in child_sent

    [observation] = parent.requests[1].observations
    assert (observation.status, observation.result) == ("ok", "CHILD-ANSWER")
    parent_sent = sent_json(parent.sent[1])
    assert "CHILD-INSTRUCTIONS" not in parent_sent

    [started] = result.trace.of_kind("sub_invocation_started")
    assert started["child_invocation_id"] == child_request.invocation_id
    assert started.invocation_id == result.invocation_id
    [child_start] = result.trace.of_kind(
        "invocation_started", invocation_id=child_request.invocation_id
    )
    assert child_start["parent_invocation_id"] == result.invocation_id
    assert child_start.run_id == "run-9"


async def test_one_provider_shared_by_parent_and_child_keeps_two_conversations() -> None:
    program = Program()
    program.delegate("helper")
    shared = ScriptedProvider(
        step(("d1", "helper", {"input": "CHILD-TASK"})),  # parent
        final("CHILD-RESULT"),  # child
        final("PARENT-RESULT"),  # parent again
    )
    program.agent("main", provider=shared, instructions="MAIN", capabilities=("helper",))
    program.agent("helper", provider=shared, instructions="HELPER")
    result = await Runtime(program).invoke("main", input="MAIN-INPUT")
    assert result.output == "PARENT-RESULT"
    _parent_first, child_only, parent_second = (sent_json(m) for m in shared.sent)
    assert "MAIN-INPUT" not in child_only
    assert "HELPER" in child_only
    assert [m["role"] for m in shared.sent[2]] == ["system", "user", "assistant", "tool"]
    assert "HELPER" not in parent_second
    keys = {e["session_key"] for e in result.trace.of_kind("history_event")}
    assert len(keys) == 2  # two conversations in the one history store


async def test_parallel_branches_run_concurrently_and_share_nothing() -> None:
    program = Program()
    barrier = asyncio.Barrier(2)

    @program.capability
    async def meet(who: str) -> str:
        async with asyncio.timeout(5):
            await barrier.wait()
        return who

    program.delegate("worker")
    parent = ScriptedProvider(
        step(("d1", "worker", {"input": "ALPHA"}), ("d2", "worker", {"input": "BETA"})),
        final("both"),
    )
    workers = ScriptedProvider(worker_step, worker_step, worker_step, worker_step)
    program.agent("lead", provider=parent, capabilities=("worker",))
    program.agent("worker", provider=workers, capabilities=("meet",))
    result = await Runtime(program).invoke("lead")
    assert result.status == "completed"
    assert [o.result for o in parent.requests[1].observations] == ["ALPHA done", "BETA done"]

    ids = {r.invocation_id for r in workers.requests}
    assert len(ids) == 2
    assert result.invocation_id not in ids
    assert {r.run_id for r in workers.requests} == {result.run_id}
    for request, messages in zip(workers.requests, workers.sent, strict=True):
        other = "BETA" if request.input == "ALPHA" else "ALPHA"
        assert other not in sent_json(messages)


async def test_a_failing_child_is_an_error_observation_for_its_parent() -> None:
    program = Program()
    program.delegate("flaky")
    parent = ScriptedProvider(step(("d1", "flaky", {"input": "try"})), final("recovered"))
    program.agent("main", provider=parent, capabilities=("flaky",))
    program.agent("flaky", provider=ScriptedProvider())  # no step: the provider fails
    result = await Runtime(program).invoke("main")
    assert result.status == "completed"
    [observation] = parent.requests[1].observations
    assert observation.status == "error"
    assert "AgentDecisionProviderUnavailable" in str(observation.error)
    [finished] = result.trace.of_kind("sub_invocation_finished")
    assert finished["status"] == "failed"


async def test_delegation_needs_the_parents_grants() -> None:
    program = Program()
    program.delegate("billing", permissions=("billing:ask",))
    parent = ScriptedProvider(step(("d1", "billing", {"input": "x"})), final("no"))
    child = ScriptedProvider()
    program.agent("main", provider=parent, capabilities=("billing",))
    program.agent("billing", provider=child)
    result = await Runtime(program).invoke("main")
    assert result.status == "completed"
    assert child.requests == []
    assert result.trace.of_kind("denial")[0]["reason"] == "permission_denied"


def approval_program(
    parent: ScriptedProvider, child: ScriptedProvider
) -> tuple[Program, list[str]]:
    program = Program()
    paid: list[str] = []

    @program.capability(requires_approval=True)
    async def pay(invoice: str) -> str:
        paid.append(invoice)
        return f"paid {invoice}"

    program.delegate("billing")
    program.agent("main", provider=parent, capabilities=("billing",))
    program.agent("billing", provider=child, capabilities=("pay",))
    return program, paid


async def test_a_child_awaiting_approval_pauses_its_parent_and_resumes_first() -> None:
    parent = ScriptedProvider(step(("d1", "billing", {"input": "pay I-1"})), final("all good"))
    child = ScriptedProvider(step(("p1", "pay", {"invoice": "I-1"})), final("I-1 is paid"))
    program, paid = approval_program(parent, child)
    store = MemoryCheckpointStore()
    runtime = Runtime(program, checkpoints=store)
    paused = await runtime.invoke("main")
    assert paused.status == "awaiting_approval"
    assert [c.call_id for c in paused.pending] == ["p1"]
    assert len(store) == 1  # one entry: the child's checkpoint is nested in the parent's
    checkpoint = await store.get(paused.checkpoint_id or "")
    assert checkpoint is not None
    [pending] = checkpoint["pending"]
    assert pending["kind"] == "delegate"
    assert pending["call"]["call_id"] == "d1"
    assert pending["child"]["agent_ref"] == "billing"
    assert pending["child"]["pending"][0]["call"]["call_id"] == "p1"
    child_id = child.requests[0].invocation_id

    result = await runtime.resume(paused.checkpoint_id or "", approvals={"p1": True})
    assert result.status == "completed"
    assert result.output == "all good"
    assert result.invocation_id == paused.invocation_id
    assert paid == ["I-1"]
    assert child.requests[1].invocation_id == child_id  # the child keeps its identity too
    assert child.requests[1].resuming is True
    [observation] = parent.requests[1].observations
    assert (observation.call_id, observation.result) == ("d1", "I-1 is paid")
    assert parent.requests[1].resuming is True


async def test_parallel_children_awaiting_approval_are_decided_separately() -> None:
    parent = ScriptedProvider(
        step(("d1", "billing", {"input": "I-1"}), ("d2", "billing", {"input": "I-2"})),
        final("reviewed"),
    )

    def pay_own(request: DecisionRequest, sent: list[dict[str, Any]]) -> dict[str, Any]:
        if request.observations:
            [observation] = request.observations
            return final(f"{request.input}: {observation.status}")
        return step((f"p-{request.input}", "pay", {"invoice": str(request.input)}))

    child = ScriptedProvider(pay_own, pay_own, pay_own, pay_own)
    program, paid = approval_program(parent, child)
    runtime = Runtime(program)
    paused = await runtime.invoke("main")
    assert sorted(c.call_id for c in paused.pending) == ["p-I-1", "p-I-2"]
    result = await runtime.resume(
        paused.checkpoint_id or "", approvals={"p-I-1": True, "p-I-2": False}
    )
    assert result.status == "completed"
    assert paid == ["I-1"]
    answers = {o.call_id: o.result for o in parent.requests[1].observations}
    assert answers == {"d1": "I-1: ok", "d2": "I-2: denied"}


async def test_a_child_pausing_again_keeps_the_parent_paused() -> None:
    parent = ScriptedProvider(step(("d1", "billing", {"input": "two"})), final("done"))
    child = ScriptedProvider(
        step(("p1", "pay", {"invoice": "I-1"})),
        step(("p2", "pay", {"invoice": "I-2"})),
        final("both paid"),
    )
    program, paid = approval_program(parent, child)
    runtime = Runtime(program)
    first = await runtime.invoke("main")
    second = await runtime.resume(first.checkpoint_id or "", approvals={"p1": True})
    assert second.status == "awaiting_approval"
    assert second.checkpoint_id != first.checkpoint_id
    assert [c.call_id for c in second.pending] == ["p2"]
    assert len(parent.requests) == 1  # the parent has not decided again yet
    third = await runtime.resume(second.checkpoint_id or "", approvals={"p2": True})
    assert third.status == "completed"
    assert paid == ["I-1", "I-2"]
    assert third.invocation_id == first.invocation_id


async def test_a_delegation_itself_may_require_approval() -> None:
    program = Program()
    program.delegate("auditor", requires_approval=True)
    parent = ScriptedProvider(
        step(("d1", "auditor", {"input": "audit"})),
        step(("d2", "auditor", {"input": "audit again"})),
        final("audited once"),
    )
    child = ScriptedProvider(final("clean"))
    program.agent("main", provider=parent, capabilities=("auditor",))
    program.agent("auditor", provider=child)
    runtime = Runtime(program)
    first = await runtime.invoke("main")
    assert [(c.call_id, c.name, dict(c.arguments)) for c in first.pending] == [
        ("d1", "auditor", {"input": "audit"})
    ]
    assert child.requests == []  # nothing starts before the approval
    second = await runtime.resume(first.checkpoint_id or "", approvals={"d1": True})
    assert [r.input for r in child.requests] == ["audit"]
    assert second.status == "awaiting_approval"
    third = await runtime.resume(second.checkpoint_id or "", approvals={"d2": False})
    assert third.status == "completed"
    assert len(child.requests) == 1
    assert [o.status for o in parent.requests[2].observations] == ["denied"]

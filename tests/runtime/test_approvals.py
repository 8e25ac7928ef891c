"""Approvals: stop with a checkpoint, resume with the reviewer's decisions."""

from __future__ import annotations

import asyncio

import pytest

from touba.errors import ConfigurationError
from touba.history import CapabilityCall, HistoryConfig, MemoryHistoryStore
from touba.runtime import MemoryCheckpointStore, Program, Runtime
from touba.testing import ScriptedProvider

from ._helpers import final, step


def make_program(
    model: ScriptedProvider, *, grants: tuple[str, ...] = ("payments:write",), max_calls: int = 5
) -> tuple[Program, list[str]]:
    program = Program()
    log: list[str] = []

    @program.capability
    async def lookup_invoice(invoice: str) -> dict[str, str]:
        log.append(f"lookup {invoice}")
        return {"invoice": invoice, "amount": "12.00"}

    @program.capability(
        permissions=("payments:write",), requires_approval=True, max_calls=max_calls
    )
    async def pay(invoice: str) -> str:
        log.append(f"pay {invoice}")
        return "paid"

    program.agent("billing", provider=model, capabilities=("lookup_invoice", "pay"), grants=grants)
    return program, log


def paying_model(
    *more: dict[str, object], history: HistoryConfig | None = None
) -> ScriptedProvider:
    return ScriptedProvider(
        step(("c1", "lookup_invoice", {"invoice": "I-1"}), ("c2", "pay", {"invoice": "I-1"})),
        *more,
        history=history,
    )


async def paused_for_approval() -> tuple[Runtime, str, list[str]]:
    """A runtime whose "billing" invocation paused on ``pay`` (c2; the model then answers
    "done"): the runtime, the checkpoint to resume and the capabilities' log."""
    program, log = make_program(paying_model(final("done")))
    runtime = Runtime(program)
    paused = await runtime.invoke("billing")
    return runtime, paused.checkpoint_id or "", log


async def test_a_call_needing_approval_stops_the_invocation_after_the_others_ran() -> None:
    model = paying_model()
    program, log = make_program(model)
    result = await Runtime(program).invoke("billing", input="pay I-1")
    assert result.status == "awaiting_approval"
    assert result.checkpoint_id
    assert result.pending == (CapabilityCall("c2", "pay", {"invoice": "I-1"}),)
    assert log == ["lookup I-1"]  # the other call of the decision ran, pay did not
    assert result.output is None
    assert result.error is None
    kinds = [e.kind for e in result.trace]
    assert "approval_requested" in kinds
    assert kinds[-1] == "awaiting_approval"


async def test_resume_with_approval_runs_the_call_and_keeps_the_identity() -> None:
    model = paying_model(final("paid I-1"))
    program, log = make_program(model)
    runtime = Runtime(program)
    paused = await runtime.invoke("billing", input="pay I-1", run_id="r-7")
    result = await runtime.resume(paused.checkpoint_id or "", approvals={"c2": True})
    assert result.status == "completed"
    assert result.output == "paid I-1"
    assert (result.run_id, result.invocation_id, result.agent_ref) == (
        "r-7",
        paused.invocation_id,
        "billing",
    )
    assert result.checkpoint_id is None
    assert log == ["lookup I-1", "pay I-1"]
    resumed = model.requests[1]
    assert resumed.resuming is True
    assert resumed.invocation_id == paused.invocation_id
    assert [(o.call_id, o.status) for o in resumed.observations] == [("c1", "ok"), ("c2", "ok")]
    kinds = [e.kind for e in result.trace]
    assert kinds.index("awaiting_approval") < kinds.index("invocation_resumed")
    assert "approval_granted" in kinds


@pytest.mark.parametrize("approvals", [{"c2": False}, {}, None])
async def test_refused_or_missing_approval_is_a_denied_observation(
    approvals: dict[str, bool] | None,
) -> None:
    model = paying_model(final("not paid"))
    program, log = make_program(model)
    runtime = Runtime(program)
    paused = await runtime.invoke("billing")
    result = await runtime.resume(paused.checkpoint_id or "", approvals=approvals)
    assert result.status == "completed"
    assert log == ["lookup I-1"]
    denied = model.requests[1].observations[1]
    assert denied.status == "denied"
    assert "not approved" in str(denied.error)
    [refused] = result.trace.of_kind("approval_refused")
    assert refused["given"] is (approvals == {"c2": False})
    assert result.trace.of_kind("denial")[0]["reason"] == "not_approved"


@pytest.mark.parametrize("approve", [True, False])
async def test_the_actor_who_decided_is_recorded_and_told_to_the_model(approve: bool) -> None:
    model = paying_model(final("ok"))
    program, log = make_program(model)
    runtime = Runtime(program)
    paused = await runtime.invoke("billing")
    result = await runtime.resume(
        paused.checkpoint_id or "", approvals={"c2": approve}, actor="operator"
    )
    [decided] = result.trace.of_kind("approval_granted" if approve else "approval_refused")
    assert decided["actor"] == "operator"
    if not approve:
        denied = model.requests[1].observations[1]
        assert denied.error == "'pay' needs approval and was not approved (refused by operator)"
        assert log == ["lookup I-1"]


async def test_without_an_actor_none_is_recorded() -> None:
    model = paying_model(final("ok"))
    program, _ = make_program(model)
    runtime = Runtime(program)
    paused = await runtime.invoke("billing")
    result = await runtime.resume(paused.checkpoint_id or "", approvals={"c2": False})
    [refused] = result.trace.of_kind("approval_refused")
    assert "actor" not in refused.data
    assert model.requests[1].observations[1].error == "'pay' needs approval and was not approved"


@pytest.mark.parametrize("actor", ["", "  ", 7])
async def test_a_bad_actor_is_refused_before_anything_is_consumed(actor: object) -> None:
    runtime, checkpoint, log = await paused_for_approval()
    with pytest.raises(ConfigurationError, match="actor must be a non-empty str"):
        await runtime.resume(checkpoint, approvals={"c2": True}, actor=actor)  # type: ignore[arg-type]
    assert log == ["lookup I-1"]
    assert await runtime.checkpoints.get(checkpoint) is not None


async def test_a_checkpoint_is_consumed_by_its_first_resume() -> None:
    runtime, checkpoint, _ = await paused_for_approval()
    await runtime.resume(checkpoint, approvals={"c2": True})
    with pytest.raises(ConfigurationError, match="already resumed"):
        await runtime.resume(checkpoint, approvals={"c2": True})
    with pytest.raises(ConfigurationError, match="unknown"):
        await runtime.resume("no-such-checkpoint")


async def test_two_concurrent_resumes_have_exactly_one_winner() -> None:
    runtime, checkpoint, log = await paused_for_approval()
    outcomes = await asyncio.gather(
        runtime.resume(checkpoint, approvals={"c2": True}),
        runtime.resume(checkpoint, approvals={"c2": True}),
        return_exceptions=True,
    )
    errors = [o for o in outcomes if isinstance(o, BaseException)]
    assert len(errors) == 1
    assert isinstance(errors[0], ConfigurationError)
    assert log.count("pay I-1") == 1


async def test_bad_approvals_are_refused_before_the_checkpoint_is_consumed() -> None:
    runtime, checkpoint, _ = await paused_for_approval()
    with pytest.raises(ConfigurationError, match="not pending"):
        await runtime.resume(checkpoint, approvals={"c1": True})
    with pytest.raises(ConfigurationError, match="True or False"):
        await runtime.resume(checkpoint, approvals={"c2": "yes"})  # type: ignore[dict-item]
    assert (await runtime.resume(checkpoint, approvals={"c2": True})).status == "completed"


async def test_an_approved_call_is_checked_again_with_the_resuming_program() -> None:
    # Grants revoked between the pause and the resume: approval is not a permission.
    store = MemoryCheckpointStore()
    history = HistoryConfig(store=MemoryHistoryStore(), namespace="app")
    first_model = paying_model(history=history)
    program, log = make_program(first_model)
    paused = await Runtime(program, checkpoints=store).invoke("billing")

    second_model = ScriptedProvider(final("could not pay"), history=history)
    revoked, revoked_log = make_program(second_model, grants=())
    result = await Runtime(revoked, checkpoints=store).resume(
        paused.checkpoint_id or "", approvals={"c2": True}
    )
    assert result.status == "completed"
    assert log == ["lookup I-1"]
    assert revoked_log == []
    denied = second_model.requests[0].observations[1]
    assert denied.status == "denied"
    assert result.trace.of_kind("denial")[0]["reason"] == "permission_denied"
    # Same history store: the messages were found, nothing was lost.
    assert not [
        e for e in result.trace.of_kind("history_event") if e["event"] == "resumed_without_messages"
    ]


async def test_budgets_apply_to_calls_awaiting_approval() -> None:
    model = ScriptedProvider(
        step(("c1", "pay", {"invoice": "I-1"}), ("c2", "pay", {"invoice": "I-2"})),
        final("one paid"),
    )
    program, log = make_program(model, max_calls=1)
    runtime = Runtime(program)
    paused = await runtime.invoke("billing")
    assert [c.call_id for c in paused.pending] == ["c1"]  # c2 is over budget: denied at once
    assert paused.trace.of_kind("denial")[0]["reason"] == "budget_exhausted"
    result = await runtime.resume(paused.checkpoint_id or "", approvals={"c1": True})
    assert result.status == "completed"
    assert log == ["pay I-1"]
    assert [o.status for o in model.requests[1].observations] == ["ok", "denied"]


async def test_approval_then_another_approval_pauses_again_under_a_new_checkpoint() -> None:
    model = paying_model(step(("c3", "pay", {"invoice": "I-2"})), final("both paid"))
    program, log = make_program(model)
    runtime = Runtime(program)
    first = await runtime.invoke("billing")
    second = await runtime.resume(first.checkpoint_id or "", approvals={"c2": True})
    assert second.status == "awaiting_approval"
    assert second.checkpoint_id not in (None, first.checkpoint_id)
    assert second.invocation_id == first.invocation_id
    assert [c.call_id for c in second.pending] == ["c3"]
    third = await runtime.resume(second.checkpoint_id or "", approvals={"c3": True})
    assert third.status == "completed"
    assert log == ["lookup I-1", "pay I-1", "pay I-2"]
    assert len(third.trace.of_kind("invocation_resumed")) == 2


async def test_approved_calls_meet_the_resuming_programs_budgets_and_schemas() -> None:
    store = MemoryCheckpointStore()
    first = ScriptedProvider(
        step(("c1", "pay", {"invoice": "I-1"}), ("c2", "pay", {"invoice": "I-2"})),
    )
    program, _ = make_program(first)
    paused = await Runtime(program, checkpoints=store).invoke("billing")
    assert [c.call_id for c in paused.pending] == ["c1", "c2"]

    # Resumed by a program where pay allows one call per invocation.
    second = ScriptedProvider(final("one paid"))
    stricter, log = make_program(second, max_calls=1)
    result = await Runtime(stricter, checkpoints=store).resume(
        paused.checkpoint_id or "", approvals={"c1": True, "c2": True}
    )
    assert log == ["pay I-1"]
    assert [d["reason"] for d in result.trace.of_kind("denial")] == ["budget_exhausted"]

    # Resumed by a program where pay takes another argument type.
    third = ScriptedProvider(step(("c3", "pay", {"invoice": "I-3"})))
    program3, _ = make_program(third)
    paused = await Runtime(program3, checkpoints=store).invoke("billing")
    changed = Program()
    ran: list[int] = []

    @changed.capability(requires_approval=True)
    async def pay(invoice: int) -> str:
        ran.append(invoice)
        return "paid"

    fourth = ScriptedProvider(final("not paid"))
    changed.agent("billing", provider=fourth, capabilities=("pay",))
    result = await Runtime(changed, checkpoints=store).resume(
        paused.checkpoint_id or "", approvals={"c3": True}
    )
    assert ran == []
    assert [d["reason"] for d in result.trace.of_kind("denial")] == ["invalid_arguments"]

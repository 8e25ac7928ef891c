"""Business memory resources: scoped data behind the runtime's checks (touba.runtime._resources)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import pytest

from touba.errors import ConfigurationError, ResourceAccessDenied
from touba.memory import ChatSession
from touba.memory.sqlite import SqliteMemoryStore
from touba.providers import TraceCall, Turn
from touba.runtime import (
    InvocationContext,
    InvocationResult,
    MemoryResourceBinding,
    Program,
    ResourceAddress,
    ResourceHandle,
    Resources,
    Runtime,
    SqliteResourceBinding,
    Step,
)
from touba.runtime._resources import ResourceAccess
from touba.testing import ScriptedProvider

from ._helpers import RawProvider, calls, done, final, step

Scope = Literal["run", "session", "user", "agent"]
ALL: tuple[Scope, ...] = ("run", "session", "user", "agent")


def notes_program(
    provider: Any,
    *,
    grants: tuple[str, ...] = ("notes:read", "notes:write"),
    scopes: tuple[Scope, ...] = ALL,
    approval: bool = False,
) -> Program:
    """Agent "clerk": ``save_note``/``read_note``, and ``sneaky_save`` (declares read only)."""
    program = Program()
    program.resource("notes", scopes=scopes, read=("notes:read",), write=("notes:write",))

    @program.capability(permissions=("notes:write",), requires_approval=approval)
    async def save_note(key: str, text: str, scope: Scope, resources: Resources) -> str:
        """Save a note."""
        await resources["notes"].put(key, {"text": text}, scope=scope)
        return "saved"

    @program.capability(permissions=("notes:read",))
    async def read_note(key: str, scope: Scope, resources: Resources) -> Any:
        """Read a note."""
        return await resources["notes"].get(key, scope=scope)

    @program.capability(permissions=("notes:read",))
    async def sneaky_save(key: str, text: str, resources: Resources) -> str:
        await resources["notes"].put(key, {"text": text}, scope="user")
        return "saved"

    capabilities = ("save_note", "read_note", "sneaky_save")
    program.agent("clerk", provider=provider, capabilities=capabilities, grants=grants)
    program.agent("other", provider=provider, capabilities=capabilities, grants=grants)
    return program


def save(key: str, text: str, scope: Scope, call_id: str = "w") -> Any:
    return calls((call_id, "save_note", {"key": key, "text": text, "scope": scope}))


def read(key: str, scope: Scope, call_id: str = "r") -> Any:
    return calls((call_id, "read_note", {"key": key, "scope": scope}))


def observations(result: InvocationResult) -> list[dict[str, Any]]:
    return [dict(e.data) for e in result.trace.of_kind("observation")]


def accesses(result: InvocationResult) -> list[dict[str, Any]]:
    return [dict(e.data) for e in result.trace.of_kind("resource_access")]


def ctx(user: str | None = None, session: str | None = None) -> InvocationContext:
    return InvocationContext(user_id=user, session_id=session)


async def run(
    runtime: Runtime,
    *decisions: Any,
    agent: str = "clerk",
    context: InvocationContext | None = None,
    run_id: str | None = None,
) -> InvocationResult:
    provider = runtime.program.agents[agent].provider
    assert isinstance(provider, RawProvider)
    provider.steps.extend([*decisions, done("ok")])
    return await runtime.invoke(agent, input="go", context=context, run_id=run_id)


async def read_back(
    runtime: Runtime,
    key: str,
    scope: Scope,
    *,
    agent: str = "clerk",
    context: InvocationContext | None = None,
    run_id: str | None = None,
) -> Any:
    result = await run(runtime, read(key, scope), agent=agent, context=context, run_id=run_id)
    (observation,) = observations(result)
    assert observation["status"] == "ok", observation
    return observation["result"]


# -- scopes isolate --------------------------------------------------------------------------


async def test_user_scope_is_the_users_across_sessions_and_no_one_elses() -> None:
    runtime = Runtime(notes_program(RawProvider()))
    written = await run(runtime, save("A1", "VIP", "user"), context=ctx("ada", "s-1"))
    assert observations(written)[0]["result"] == "saved"
    assert await read_back(runtime, "A1", "user", context=ctx("ada", "s-2")) == {"text": "VIP"}
    assert await read_back(runtime, "A1", "user", context=ctx("bob", "s-1")) is None


async def test_session_scope_differs_across_sessions_of_one_user() -> None:
    runtime = Runtime(notes_program(RawProvider()))
    await run(runtime, save("draft", "x", "session"), context=ctx("ada", "s-1"))
    assert await read_back(runtime, "draft", "session", context=ctx("ada", "s-1")) == {"text": "x"}
    assert await read_back(runtime, "draft", "session", context=ctx("ada", "s-2")) is None


async def test_run_scope_differs_across_runs() -> None:
    runtime = Runtime(notes_program(RawProvider()))
    await run(runtime, save("k", "x", "run"), run_id="r-1")
    assert await read_back(runtime, "k", "run", run_id="r-1") == {"text": "x"}
    assert await read_back(runtime, "k", "run", run_id="r-2") is None
    assert await read_back(runtime, "k", "run") is None  # a new run id


async def test_agent_scope_is_shared_by_the_agents_users_only() -> None:
    runtime = Runtime(notes_program(RawProvider()))
    await run(runtime, save("policy", "x", "agent"), context=ctx("ada"))
    assert await read_back(runtime, "policy", "agent", context=ctx("bob")) == {"text": "x"}
    assert await read_back(runtime, "policy", "agent", agent="other") is None


async def test_without_a_user_id_there_is_no_user_scope() -> None:
    runtime = Runtime(notes_program(RawProvider()))
    result = await run(runtime, save("A1", "x", "user"), context=ctx(None, "s-1"))
    (observation,) = observations(result)
    assert observation["status"] == "error"
    assert observation["error"].startswith("ResourceAccessDenied: this invocation has no")
    (access,) = accesses(result)
    assert (access["outcome"], access["reason"], access["scope"]) == (
        "denied",
        "no_scope_key",
        "user",
    )


async def test_an_undeclared_scope_is_refused() -> None:
    runtime = Runtime(notes_program(RawProvider(), scopes=("user",)))
    result = await run(runtime, save("A1", "x", "session"), context=ctx("ada", "s-1"))
    (access,) = accesses(result)
    assert access["reason"] == "scope_not_declared"
    assert "ResourceAccessDenied" in observations(result)[0]["error"]


async def test_scope_keys_never_come_from_the_model() -> None:
    runtime = Runtime(notes_program(RawProvider()))
    await run(runtime, save("A1", "secret", "user"), context=ctx("ada"))
    # The model tries to pass the handle, or to name another user's key: refused by the schema.
    forged = calls(("f", "read_note", {"key": "A1", "scope": "user", "resources": "ada"}))
    result = await run(runtime, forged, context=ctx("bob"))
    (denial,) = [dict(e.data) for e in result.trace.of_kind("denial")]
    assert denial["reason"] == "invalid_arguments"
    schema = runtime.program.capabilities["read_note"].parameters.schema
    assert set(schema["properties"]) == {"key", "scope"}


# -- permissions ----------------------------------------------------------------------------


async def test_a_capability_must_declare_the_resources_permission() -> None:
    binding = MemoryResourceBinding()
    runtime = Runtime(notes_program(RawProvider()), resources=binding)
    result = await run(
        runtime, calls(("s", "sneaky_save", {"key": "A1", "text": "x"})), context=ctx("ada")
    )
    (observation,) = observations(result)
    assert observation["status"] == "error"
    assert "does not declare notes:write" in observation["error"]
    (access,) = accesses(result)
    assert (access["operation"], access["outcome"], access["reason"]) == (
        "put",
        "denied",
        "permission_not_declared",
    )
    assert await binding.keys(ResourceAddress("notes", "user", "ada"), prefix="", limit=10) == []


async def test_an_agent_without_the_grant_cannot_call_a_writing_capability() -> None:
    runtime = Runtime(notes_program(RawProvider(), grants=("notes:read",)))
    program = runtime.program
    assert program.agents["clerk"].grants == frozenset({"notes:read"})
    result = await run(runtime, save("A1", "x", "user"), context=ctx("ada"))
    (denial,) = [dict(e.data) for e in result.trace.of_kind("denial")]
    assert denial["reason"] == "permission_denied"
    assert accesses(result) == []


async def test_every_operation_checks_the_agents_grants_at_call_time() -> None:
    """Defence in depth: the handle checks grants itself, not only the call's check."""
    binding = MemoryResourceBinding()
    program = notes_program(RawProvider())
    notes: list[tuple[str, dict[str, Any]]] = []
    access = ResourceAccess(
        definitions=program.resources,
        binding=binding,
        agent="clerk",
        grants=frozenset({"notes:read"}),
        capability="save_note",
        declared=frozenset({"notes:read", "notes:write"}),
        scope_keys={"run": "r", "session": None, "user": "ada", "agent": "clerk"},
        call_id="c",
        note=lambda kind, **data: notes.append((kind, data)),
    )
    handle = Resources(access)["notes"]
    assert isinstance(handle, ResourceHandle)
    with pytest.raises(ResourceAccessDenied) as caught:
        await handle.put("A1", "x", scope="user")
    assert caught.value.reason == "permission_not_granted"
    assert caught.value.code == "ResourceAccessDenied"
    assert await handle.get("A1", "none", scope="user") == "none"
    assert [n[1]["outcome"] for n in notes] == ["denied", "ok"]
    with pytest.raises(ConfigurationError, match="pass scope"):
        await handle.get("A1")
    with pytest.raises(ConfigurationError, match="unknown resource"):
        Resources(access)["orders"]


async def test_a_write_seen_in_history_is_checked_again_when_re_proposed(
    private_dir: Path,
) -> None:
    """History grants nothing: a write the model saw succeed is refused once the grant is gone."""
    async with SqliteResourceBinding(private_dir / "resources.db") as binding:
        runtime = Runtime(notes_program(RawProvider()), resources=binding)
        first = await run(runtime, save("A1", "v1", "user"), context=ctx("ada", "s-1"))
        assert observations(first)[0]["result"] == "saved"

        # Later, the same agent without notes:write; the earlier turn is in its memory.
        restricted = Runtime(
            notes_program(RawProvider(), grants=("notes:read",)), resources=binding
        )
        earlier = Turn(
            user="save it",
            replies=("Saved.",),
            trace=(
                (
                    TraceCall(
                        "w",
                        "save_note",
                        {"key": "A1", "text": "v1", "scope": "user"},
                        "ok",
                        result="saved",
                    ),
                ),
            ),
        )
        context = InvocationContext(prior_turns=(earlier,), user_id="ada", session_id="s-1")
        again = await run(
            restricted,
            save("A1", "v2", "user", "w2"),
            calls(("s", "sneaky_save", {"key": "A1", "text": "v3"})),
            context=context,
        )
        denials = [dict(e.data) for e in again.trace.of_kind("denial")]
        assert [d["reason"] for d in denials] == ["permission_denied"]
        statuses = [o["status"] for o in observations(again)]
        assert statuses == ["denied", "error"]
        assert [a["outcome"] for a in accesses(again)] == ["denied"]
        item = await binding.get(ResourceAddress("notes", "user", "ada"), "A1")
    assert item is not None
    assert item.value == {"text": "v1"}


async def test_a_capability_may_catch_a_refusal() -> None:
    program = Program()
    program.resource("notes", scopes=("user",), read=("notes:read",), write=("notes:write",))

    @program.capability(permissions=("notes:read",))
    async def lookup(key: str, resources: Resources) -> str:
        try:
            value = await resources["notes"].get(key)
        except ResourceAccessDenied as e:
            return f"unavailable ({e.reason})"
        return str(value)

    program.agent("a", provider=RawProvider(), capabilities=("lookup",), grants=("notes:read",))
    runtime = Runtime(program)
    result = await run(runtime, calls(("c", "lookup", {"key": "k"})), agent="a")
    assert observations(result)[0]["result"] == "unavailable (no_scope_key)"


# -- identity through sessions, checkpoints and delegation -----------------------------------


async def test_chat_sessions_give_their_user_and_session_ids(private_dir: Path) -> None:
    model = ScriptedProvider()
    runtime = Runtime(notes_program(model))
    async with SqliteMemoryStore(private_dir / "memory.db") as store:
        model.add(step(("w", "save_note", {"key": "A1", "text": "VIP", "scope": "user"})))
        model.add(final("Saved."))
        async with ChatSession(runtime, "clerk", "ada", store=store) as session:
            await session.send("Remember A1 is VIP")

        for user, expected in (("ada", {"text": "VIP"}), (None, None)):
            model.add(step(("r", "read_note", {"key": "A1", "scope": "user"})), final("Done."))
            async with ChatSession(runtime, "clerk", user, store=store) as session:
                turn = await session.send("What about A1?")
            (observation,) = observations(turn.result)
            if user is None:  # an anonymous visitor has no user scope
                assert "no trusted user id" in observation["error"]
            else:
                assert observation["result"] == expected


async def test_checkpoints_keep_the_ids_and_a_resume_cannot_change_them() -> None:
    runtime = Runtime(notes_program(RawProvider(), approval=True))
    provider = runtime.program.agents["clerk"].provider
    provider.steps.append(save("A1", "x", "user", "w"))
    paused = await runtime.invoke("clerk", input="go", context=ctx("ada", "s-1"))
    assert paused.status == "awaiting_approval"
    assert paused.checkpoint_id is not None
    stored = await runtime.checkpoints.get(paused.checkpoint_id)
    assert stored is not None
    assert (stored["user_id"], stored["session_id"]) == ("ada", "s-1")
    with pytest.raises(ConfigurationError, match="other session and user ids"):
        await runtime.resume(paused.checkpoint_id, {"w": True}, context=ctx("bob", "s-1"))
    provider.steps.append(done("ok"))
    result = await runtime.resume(paused.checkpoint_id, {"w": True})  # no context: its own ids
    assert result.status == "completed"
    assert await read_back(runtime, "A1", "user", context=ctx("ada")) == {"text": "x"}


async def test_a_delegate_keeps_the_user_but_uses_its_own_grants_and_agent_scope() -> None:
    program = Program()
    program.resource("notes", scopes=("user", "agent"), read=("r",), write=("w",))

    @program.capability(permissions=("w",))
    async def remember(text: str, resources: Resources) -> str:
        await resources["notes"].put("last", text, scope="user")
        await resources["notes"].put("last", text, scope="agent")
        return "ok"

    program.delegate("helper")
    helper = RawProvider(calls(("c", "remember", {"text": "hi"})), done("remembered"))
    program.agent("helper", provider=helper, capabilities=("remember",), grants=("w",))
    program.agent("boss", provider=RawProvider(), capabilities=("helper",))
    binding = MemoryResourceBinding()
    runtime = Runtime(program, resources=binding)
    result = await run(
        runtime, calls(("d", "helper", {"input": "x"})), agent="boss", context=ctx("ada")
    )
    assert result.status == "completed"
    user = await binding.get(ResourceAddress("notes", "user", "ada"), "last")
    agent = await binding.get(ResourceAddress("notes", "agent", "helper"), "last")
    assert (user and user.value, agent and agent.value) == ("hi", "hi")


async def test_flow_capability_steps_use_resources_too() -> None:
    program = notes_program(RawProvider())
    program.agent(
        "recorder",
        provider=RawProvider(),
        kind="flow",
        grants=("notes:read", "notes:write"),
        steps=(
            Step.call("save_note", {"key": "$input.key", "text": "$input.text", "scope": "user"}),
            Step.call("read_note", {"key": "$input.key", "scope": "user"}),
        ),
    )
    runtime = Runtime(program)
    result = await runtime.invoke(
        "recorder", input={"key": "A1", "text": "VIP"}, context=ctx("ada")
    )
    assert result.output == {"text": "VIP"}
    assert [a["operation"] for a in accesses(result)] == ["put", "get"]


# -- definitions --------------------------------------------------------------------------


def test_resource_definitions_are_checked() -> None:
    program = Program()
    with pytest.raises(ConfigurationError, match="scopes"):
        program.resource("a", scopes=("tenant",), read=("r",), write=("w",))  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="scopes"):
        program.resource("a", scopes=(), read=("r",), write=("w",))
    with pytest.raises(ConfigurationError, match="at least one permission"):
        program.resource("a", scopes=("user",), read=(), write=("w",))
    program.resource("a", scopes=("user",), read=("r",), write=("w",))
    with pytest.raises(ConfigurationError, match="twice"):
        program.resource("a", scopes=("user",), read=("r",), write=("w",))

    async def two(a: Resources, b: Resources) -> None: ...

    with pytest.raises(ConfigurationError, match="both Resources"):
        program.capability(two)

    def blocking(resources: Resources) -> None: ...

    with pytest.raises(ConfigurationError, match="must be async"):
        program.capability(blocking)


async def test_values_are_bounded_json() -> None:
    program = Program()
    program.resource("n", scopes=("run",), read=("r",), write=("w",), max_value_bytes=16)

    @program.capability(permissions=("w",))
    async def put(value: str, resources: Resources) -> str:
        await resources["n"].put("k", value)
        return "ok"

    program.agent("a", provider=RawProvider(), capabilities=("put",), grants=("w",))
    runtime = Runtime(program)
    result = await run(runtime, calls(("c", "put", {"value": "x" * 20})), agent="a")
    assert "max_value_bytes=16" in observations(result)[0]["error"]


# -- bindings (their contract, on every binding: test_resource_bindings.py) ------------------


def test_the_runtime_checks_its_binding() -> None:
    with pytest.raises(ConfigurationError, match="resource binding"):
        Runtime(Program(), resources=object())  # type: ignore[arg-type]
    assert isinstance(Runtime(Program()).resources, MemoryResourceBinding)

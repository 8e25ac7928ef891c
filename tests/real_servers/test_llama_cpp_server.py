"""touba's OpenAI-compatible provider against llama-cpp-python's own server (issue 30).

A real ``python -m llama_cpp.server`` (the pinned llama-cpp-python, built by
``build_llama.py``) runs the tiny random model of ``_model.py`` on each chat format: the
model's own template, ``chatml`` and ``chatml-function-calling``. The text is gibberish;
what is real is everything touba depends on: the server's chat templates, its request
validation, grammar-constrained tool calls and JSON, SSE, authentication, and what a
client sees when the server dies.

Decisions are sampled (temperature 0.8, a fixed ``seed``): greedy decoding of random
weights never closes a JSON string. Each test asserts what holds whatever the sampled
text: the server accepted every request, the decisions are well formed, the results went
back, nothing was stored on a failure.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from jsonschema import Draft202012Validator

from tests._netproxy import net_proxy
from tests.real_servers.conftest import MODEL_ALIAS, LlamaServer
from touba.errors import (
    AgentBudgetExceeded,
    AgentDecisionProviderSchemaViolation,
    AgentDecisionProviderUnavailable,
)
from touba.history import HistoryConfig, MemoryHistoryStore
from touba.history._model import Observation
from touba.memory import ChatSession, MemoryConfig
from touba.memory.sqlite import SqliteMemoryStore
from touba.providers import (
    CapabilitySpec,
    DecisionProvider,
    DecisionRequest,
    TraceCall,
    Turn,
    create_openai_compatible_decision_provider,
)
from touba.providers._stream import StreamedText
from touba.runtime import Program, Runtime, TextDelta

pytestmark = pytest.mark.real_server

SEED = 1234
INSTRUCTIONS = "You are a support agent. Answer briefly."
ANSWER = {"type": "string"}
LOOKUP = CapabilitySpec(
    "lookup_order",
    "Look up the status of an order.",
    {
        "type": "object",
        "properties": {"order_id": {"type": "string"}},
        "required": ["order_id"],
        "additionalProperties": False,
    },
)
FORCE_LOOKUP = {"type": "function", "function": {"name": "lookup_order"}}


@pytest.fixture
async def compatible() -> AsyncIterator[Callable[..., DecisionProvider]]:
    """``compatible(server_or_url, **options)``: the compatible provider, sampling at 0.8
    with a fixed seed; every provider made is closed after the test."""
    made: list[DecisionProvider] = []

    def make(server: LlamaServer | str, **options: Any) -> DecisionProvider:
        options.setdefault("max_output_tokens", 400)
        options.setdefault("temperature", 0.8)
        options.setdefault("seed", SEED)
        provider = create_openai_compatible_decision_provider(
            model=MODEL_ALIAS,
            base_url=server if isinstance(server, str) else server.base_url,
            timeout=120,
            **options,
        )
        made.append(provider)
        return provider

    yield make
    for provider in made:
        await provider.aclose()


def support_program(provider: DecisionProvider, ran: list[str], **agent: Any) -> Program:
    program = Program()

    @program.capability(permissions=("orders:read",))
    async def lookup_order(order_id: str) -> dict[str, Any]:
        """Look up the status of an order."""
        ran.append(order_id)
        return {"order_id": order_id, "status": "shipped", "lookup": len(ran)}

    program.agent(
        "support",
        provider=provider,
        instructions=INSTRUCTIONS,
        capabilities=("lookup_order",),
        grants=("orders:read",),
        **agent,
    )
    return program


def plain_program(provider: DecisionProvider, **agent: Any) -> Program:
    program = Program()
    program.agent("chat", provider=provider, instructions=INSTRUCTIONS, **agent)
    return program


def request(**fields: Any) -> DecisionRequest:
    fields.setdefault("capabilities", (LOOKUP,))
    fields.setdefault("invocation_id", "inv-1")
    return DecisionRequest(
        run_id="run-1",
        agent_ref="support",
        instructions=INSTRUCTIONS,
        input="Where is order A1?",
        **fields,
    )


def tool_call_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    return [m for m in body["messages"] if m["role"] == "assistant" and m.get("tool_calls")]


# a plain final ---------------------------------------------------------------------------


async def test_a_plain_final_completes_with_the_models_text(
    llama_server: LlamaServer,
    sent: list[dict[str, Any]],
    compatible: Callable[..., DecisionProvider],
) -> None:
    runtime = Runtime(plain_program(compatible(llama_server)))
    result = await runtime.invoke("chat", input="Hello, who are you?")
    assert result.status == "completed", result.error
    assert isinstance(result.output, str)
    assert result.output.strip()
    [body] = sent
    assert [m["role"] for m in body["messages"]] == ["system", "user"]
    assert "tools" not in body


# a forced tool loop ---------------------------------------------------------------------


async def test_a_forced_tool_loop_runs_six_decisions_and_sends_every_result_back(
    llama_server: LlamaServer,
    sent: list[dict[str, Any]],
    compatible: Callable[..., DecisionProvider],
) -> None:
    """tool_choice forces lookup_order: every decision calls it, until max_decisions."""
    ran: list[str] = []
    provider = compatible(llama_server, tool_choice=FORCE_LOOKUP)
    runtime = Runtime(support_program(provider, ran, max_decisions=6))
    result = await runtime.invoke("support", input="Where is order A1?")

    # Six decisions were answered (the sixth's call is not run: the budget is spent).
    assert result.status == "failed"
    assert isinstance(result.error, AgentBudgetExceeded), result.error
    assert len(sent) == 6
    assert len(ran) == 5
    for number, body in enumerate(sent):
        calls = tool_call_messages(body)
        results = [m for m in body["messages"] if m["role"] == "tool"]
        assert len(calls) == len(results) == number
        for message in calls:
            # no text beside the call: "" (absent breaks chatml's templates, null the
            # server's validation)
            assert message.get("content") == ""
        for lookup, (message, tool) in enumerate(zip(calls, results, strict=True), start=1):
            [call] = message["tool_calls"]
            assert tool["tool_call_id"] == call["id"]
            order_id = json.loads(call["function"]["arguments"])["order_id"]
            assert json.loads(tool["content"]) == {
                "status": "ok",
                "result": {"order_id": order_id, "status": "shipped", "lookup": lookup},
            }
    assert ran == [
        json.loads(m["tool_calls"][0]["function"]["arguments"])["order_id"]
        for m in tool_call_messages(sent[-1])
    ]


# the other message shapes ----------------------------------------------------------------


async def test_summaries_and_opaque_refs_replays_are_accepted(
    llama_server: LlamaServer,
    sent: list[dict[str, Any]],
    compatible: Callable[..., DecisionProvider],
) -> None:
    """A window of 4 messages with a summary, calls rebuilt from the neutral fields."""
    summaries: list[Any] = []

    async def summarize(summary_request: Any) -> str:
        summaries.append(summary_request)
        return f"Earlier lookups: {len(summaries)}."

    store = MemoryHistoryStore()
    history = HistoryConfig(
        store=store,
        namespace="real",
        max_messages=4,
        summarize=summarize,
        max_summary_bytes=512,
        continuity="opaque_refs",
    )
    ran: list[str] = []
    provider = compatible(llama_server, tool_choice=FORCE_LOOKUP, history=history)
    runtime = Runtime(support_program(provider, ran, max_decisions=5))
    result = await runtime.invoke("support", input="Where is order A1?")

    assert isinstance(result.error, AgentBudgetExceeded), result.error
    assert len(sent) == 5
    assert summaries
    last = json.dumps(sent[-1]["messages"])
    assert f"Earlier lookups: {len(summaries)}." in last
    # user texts in a row (input, summary) go as one user message
    roles = [m["role"] for m in sent[-1]["messages"]]
    assert all(a != "user" or b != "user" for a, b in itertools.pairwise(roles))
    for body in sent[1:]:
        for message in tool_call_messages(body):
            assert message.get("content") == ""


async def test_prior_turns_with_traces_and_observations_as_data_are_accepted(
    llama_server: LlamaServer,
    sent: list[dict[str, Any]],
    compatible: Callable[..., DecisionProvider],
) -> None:
    """Earlier turns' call/result pairs (no text beside the calls), observations sent as
    data (history=False), a flow's results as data."""
    trace = (
        (TraceCall("c_1", "lookup_order", {"order_id": "A1"}, "ok", {"status": "shipped"}),),
        (
            TraceCall("c_2", "lookup_order", {"order_id": "B2"}, "error", error="timeout"),
            TraceCall("c_3", "lookup_order", {"order_id": "C3"}, "denied", error="not yours"),
        ),
    )
    turns = (
        Turn("Hello", ("Hi! How can I help?",)),
        Turn("Where are A1, B2 and C3?", ("A1 has shipped.",), trace),
    )
    decision = await compatible(llama_server).decide(request(prior_turns=turns))
    assert decision.calls or isinstance(decision.output, str)

    provider = compatible(llama_server, history=False)
    observation = Observation("c_9", "lookup_order", {"order_id": "A1"}, "ok", {"s": "shipped"})
    decision = await provider.decide(request(observations=(observation,)))
    assert decision.calls or isinstance(decision.output, str)

    # a flow's earlier results: user-role data, paired with no call
    flow = Observation("step_1", "lookup_order", {"order_id": "B2"}, "ok", {"s": "delayed"})
    decision = await compatible(llama_server).decide(request(data=(flow,), invocation_id="i-3"))
    assert decision.calls or isinstance(decision.output, str)

    with_trace = sent[0]["messages"]
    assert [m["role"] for m in with_trace] == [
        "system",
        "user",
        "assistant",
        "user",
        "assistant",
        "tool",
        "assistant",
        "tool",
        "tool",
        "assistant",
        "user",
    ]
    assert all(m.get("content") == "" for m in tool_call_messages(sent[0]))
    assert "shipped" in json.dumps(sent[1]["messages"][-1])  # the observation, as data
    assert sent[2]["messages"][-1]["role"] == "user"
    assert "delayed" in sent[2]["messages"][-1]["content"]


# a chat session --------------------------------------------------------------------------


async def test_a_chat_session_of_five_turns_sends_its_memory(
    llama_server: LlamaServer,
    sent: list[dict[str, Any]],
    private_dir: Path,
    compatible: Callable[..., DecisionProvider],
) -> None:
    memory = MemoryConfig(short_term_turns=30, full_context_turns=0)
    runtime = Runtime(plain_program(compatible(llama_server), memory=memory))
    questions = [f"Question {n}: is order A{n} late?" for n in range(1, 6)]
    async with SqliteMemoryStore(private_dir / "memory.sqlite") as store:
        session = ChatSession(runtime, "chat", "u-1", "s-1", store=store)
        replies = []
        for question in questions:
            turn = await session.send(question)
            assert turn.status == "completed", turn.result.error
            assert turn.reply
            replies.append(turn.reply)
        stored = await store.recent_turns("s-1", 10)
        await session.close()
    assert [t.user for t in stored] == questions
    assert [t.replies for t in stored] == [(r,) for r in replies]
    assert len(sent) == 5
    last = sent[-1]["messages"]
    assert last[0]["role"] == "system"
    conversation = [(m["role"], m["content"]) for m in last[1:]]
    expected = []
    for question, reply in zip(questions[:4], replies[:4], strict=True):
        expected += [("user", question), ("assistant", reply)]
    assert conversation == [*expected, ("user", questions[4])]


# a streamed reply ------------------------------------------------------------------------


async def test_a_streamed_reply_arrives_in_pieces_that_make_the_output(
    llama_server: LlamaServer,
    compatible: Callable[..., DecisionProvider],
) -> None:
    # min_tokens: the server holds back the end of turn for 8 tokens (a reply of one token
    # would come in one piece)
    runtime = Runtime(plain_program(compatible(llama_server, min_tokens=8)))
    async with runtime.stream("chat", input="Tell me about my order.") as stream:
        pieces = [event.text async for event in stream if isinstance(event, TextDelta)]
    result = stream.result
    assert result.status == "completed", result.error
    assert len(pieces) > 1
    assert "".join(pieces) == result.output


async def test_usage_is_counted_without_a_stream_and_unknown_with_one(
    llama_server: LlamaServer, compatible: Callable[..., DecisionProvider]
) -> None:
    """The server sends no usage chunk in a stream, even with stream_options.include_usage."""
    provider = compatible(llama_server)
    plain = await provider.decide(request(capabilities=()))
    assert (plain.usage.input_tokens or 0) > 0
    assert (plain.usage.output_tokens or 0) > 0

    async def sink(delta: Any) -> None:
        pass

    streamed = await provider.decide(request(capabilities=(), invocation_id="inv-2"), sink=sink)
    assert isinstance(streamed.output, str)
    assert streamed.usage.input_tokens is None
    assert streamed.usage.output_tokens is None


# structured decisions --------------------------------------------------------------------


async def test_structured_decisions_are_held_to_the_schema_sent(
    llama_server: LlamaServer,
    sent: list[dict[str, Any]],
    compatible: Callable[..., DecisionProvider],
) -> None:
    """structured_format="json_object_schema": the server's JSON mode, with the schema.

    The agent's output is a string: with no output schema the grammar lets the
    model write any JSON, numbers included, and random weights once sampled one
    beyond a double's range (``1e999``), which touba rightly refuses (documented
    in docs/providers.md). Every value this schema allows is one touba can store.
    """
    ran: list[str] = []
    provider = compatible(
        llama_server,
        decision_interface="structured",
        structured_format="json_object_schema",
        max_output_tokens=2000,  # a sampled string may run long; the grammar still closes it
    )
    runtime = Runtime(support_program(provider, ran, max_decisions=5, output_schema=ANSWER))
    outcomes = [await runtime.invoke("support", input=f"Where is order A{n}?") for n in (1, 2)]
    for result in outcomes:
        # every answer was a valid decision: a final, or calls the runtime ran
        assert not isinstance(result.error, AgentDecisionProviderSchemaViolation), result.error
        assert result.status == "completed" or isinstance(result.error, AgentBudgetExceeded)
        assert result.status != "completed" or isinstance(result.output, str)
    assert len(sent) >= 2
    for body in sent:
        response_format = body["response_format"]
        assert response_format["type"] == "json_object"
        schema = response_format["schema"]
        Draft202012Validator.check_schema(schema)
        final = schema["anyOf"][1] if "anyOf" in schema else schema
        assert final["properties"]["output"] == ANSWER
        assert "tools" not in body


async def test_a_refused_request_says_what_the_server_said_and_is_not_retryable(
    llama_server: LlamaServer,
    compatible: Callable[..., DecisionProvider],
) -> None:
    """The server refuses response_format json_schema (HTTP 500, a validation error)."""
    store = MemoryHistoryStore()
    provider = compatible(
        llama_server,
        decision_interface="structured",
        history=HistoryConfig(store=store, namespace="real"),
    )
    with pytest.raises(AgentDecisionProviderUnavailable) as caught:
        await provider.decide(request())
    error = caught.value
    assert error.status_code == 500
    assert error.retryable is False
    message = error.server_message  # the server's own words: "Input should be 'text' or ..."
    assert message is not None
    assert "json_object" in message
    assert len(message) <= 500
    assert message in str(error)
    assert await store.list() == []


# authentication --------------------------------------------------------------------------


async def test_a_wrong_api_key_is_an_authentication_error_sent_once(
    start_server: Callable[..., LlamaServer],
    compatible: Callable[..., DecisionProvider],
) -> None:
    server = start_server(api_key="right-key")
    with net_proxy("127.0.0.1", server.port) as proxy:
        base_url = f"http://127.0.0.1:{proxy.port}/v1"
        store = MemoryHistoryStore()
        wrong = compatible(
            base_url, api_key="wrong-key", history=HistoryConfig(store=store, namespace="real")
        )
        runtime = Runtime(plain_program(wrong))
        result = await runtime.invoke("chat", input="Hello")
        assert result.status == "failed"
        error = result.error
        assert isinstance(error, AgentDecisionProviderUnavailable)
        assert error.status_code == 401
        assert error.retryable is False  # no key will start working on a retry
        assert error.server_message == "Invalid API key"  # the server's own words
        assert "api_key" in str(error)
        assert "wrong-key" not in str(error)
        assert proxy.connections == 1  # asked once, never retried
        assert await store.list() == []

        right = compatible(base_url, api_key="right-key")
        result = await Runtime(plain_program(right)).invoke("chat", input="Hello")
        assert result.status == "completed", result.error


# the server killed mid-request -----------------------------------------------------------


async def arrived(proxy: Any, decision: asyncio.Task[Any]) -> None:
    """Until the request has reached the server (or the decision ended)."""
    for _ in range(6000):
        if proxy.round_trips or decision.done():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the request never reached the server")


def endless() -> dict[str, Any]:
    """Options making the model write until max_tokens: every special token banned.

    Not only its end of turn: llama.cpp also ends a generation on ``<|endoftext|>``
    (it takes a token of that text for an end of generation), which the random
    weights sample now and then; with some seeds a reply ended by it within 30
    characters, before the test could cut or kill it."""
    from tests.real_servers._model import SPECIAL, vocabulary

    tokens = vocabulary()[0]
    banned = {str(tokens.index(special)): -100 for special in SPECIAL}
    return {"logit_bias": banned, "max_output_tokens": 3000}


async def test_a_server_killed_mid_request_is_retryable_and_stores_nothing(
    start_server: Callable[..., LlamaServer],
    compatible: Callable[..., DecisionProvider],
) -> None:
    server = start_server()
    store = MemoryHistoryStore()
    with net_proxy("127.0.0.1", server.port) as proxy:
        provider = compatible(
            f"http://127.0.0.1:{proxy.port}/v1",
            history=HistoryConfig(store=store, namespace="real"),
            **endless(),
        )
        decision = asyncio.create_task(provider.decide(request(capabilities=())))
        await arrived(proxy, decision)
        # the precondition: the server is still writing its 3000 tokens
        assert not decision.done(), "the decision ended before the server was killed"
        server.kill()
        with pytest.raises(AgentDecisionProviderUnavailable) as caught:
            await decision
    assert caught.value.retryable is True
    assert caught.value.status_code is None
    assert await store.list() == []


async def test_a_server_killed_mid_stream_is_retryable_and_stores_nothing(
    start_server: Callable[..., LlamaServer],
    compatible: Callable[..., DecisionProvider],
) -> None:
    server = start_server()
    store = MemoryHistoryStore()
    provider = compatible(server, history=HistoryConfig(store=store, namespace="real"), **endless())
    pieces: list[str] = []

    async def sink(delta: Any) -> None:
        if isinstance(delta, StreamedText):
            pieces.append(delta.text)
            if len(pieces) == 3:
                server.kill()  # in the middle of the reply

    with pytest.raises(AgentDecisionProviderUnavailable) as caught:
        await provider.decide(request(capabilities=()), sink=sink)
    assert len(pieces) >= 3
    assert caught.value.retryable is True
    assert await store.list() == []


# a stream cut by the next request ----------------------------------------------------------


@pytest.mark.parametrize("interrupt", [True, False], ids=["interrupting", "queueing"])
async def test_a_new_request_cuts_a_running_stream_unless_interrupt_requests_is_off(
    start_server: Callable[..., LlamaServer],
    compatible: Callable[..., DecisionProvider],
    interrupt: bool,
) -> None:
    """The server's default (--interrupt_requests True) ends a running stream with [DONE]
    when another request comes: touba reports the stream as incomplete and stores
    nothing. With --interrupt_requests False the new request waits its turn."""
    server = start_server(None, None, "--interrupt_requests", str(interrupt))
    store = MemoryHistoryStore()
    history = HistoryConfig(store=store, namespace="real")
    # the interrupted reply would run for its 3000 tokens; the queued one ends by itself
    options = endless() if interrupt else {"min_tokens": 20}
    streaming = compatible(server, history=history, **options)
    with net_proxy("127.0.0.1", server.port) as proxy:
        other = compatible(f"http://127.0.0.1:{proxy.port}/v1")
        second: list[asyncio.Task[Any]] = []

        async def sink(delta: Any) -> None:
            if isinstance(delta, StreamedText) and not second:
                # the stream is running (and held while this sink waits): ask again
                second.append(asyncio.create_task(other.decide(request(capabilities=()))))
                await arrived(proxy, second[0])

        running = streaming.decide(request(capabilities=()), sink=sink)
        if interrupt:
            with pytest.raises(AgentDecisionProviderSchemaViolation) as caught:
                await running
            assert caught.value.provider_error_code == "incomplete_stream"
            assert "--interrupt_requests False" in str(caught.value)  # what to change
            assert await store.list() == []
        else:
            decision = await running
            assert isinstance(decision.output, str)
            assert len(await store.list()) == 1
        [task] = second
        answered = await task
        assert isinstance(answered.output, str)

"""FakeOpenAIServer's Chat Completions endpoint (Ollama, vLLM, llama.cpp style servers)."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
from hypothesis import given
from hypothesis import strategies as st

import touba.testing.fakes as fakes
from touba.testing.fakes import FakeOpenAIServer, chat_tool_call, validate_chat_completions_request

MODEL = "llama-test"
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}
]
USER: Any = {"role": "user", "content": "find x"}
MISSING = (
    "An assistant message with 'tool_calls' must be followed by tool messages responding to "
    "each 'tool_call_id'. The following tool_call_ids did not have response messages: "
)
ORPHAN = (
    "Invalid parameter: messages with role 'tool' must be a response to a preceeding message "
    "with 'tool_calls'."
)


@pytest.fixture
def api_key() -> str:
    return "ollama"  # a compatible server takes any key


def _assistant(*ids: str) -> dict[str, Any]:
    calls = [chat_tool_call("search", {"q": call_id}, id=call_id) for call_id in ids]
    return {"role": "assistant", "content": None, "tool_calls": calls}


def _tool(call_id: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": "found"}


async def test_tool_calls_parse_into_sdk_types(
    openai_server: FakeOpenAIServer, openai_client: openai.AsyncOpenAI
) -> None:
    openai_server.script_chat_completion(tool_calls=[chat_tool_call("search", {"q": "x"})])
    completion = await openai_client.chat.completions.create(
        model=MODEL,
        messages=[USER],
        tools=TOOLS,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls is not None
    (call,) = choice.message.tool_calls
    assert call.type == "function"
    assert call.id.startswith("call_")
    assert (call.function.name, json.loads(call.function.arguments)) == ("search", {"q": "x"})


@pytest.mark.parametrize(
    ("options", "finish", "content", "refusal"),
    [
        pytest.param({"content": "hello"}, "stop", "hello", None, id="text"),
        pytest.param(
            {"content": "hel", "finish_reason": "length"}, "length", "hel", None, id="cut"
        ),
        pytest.param({"refusal": "no"}, "stop", None, "no", id="refusal"),
        pytest.param({}, "stop", None, None, id="empty"),
    ],
)
async def test_scripted_completion_shapes(
    openai_server: FakeOpenAIServer,
    openai_client: openai.AsyncOpenAI,
    options: dict[str, Any],
    finish: str,
    content: str | None,
    refusal: str | None,
) -> None:
    openai_server.script_chat_completion(**options)
    completion = await openai_client.chat.completions.create(model=MODEL, messages=[USER])
    choice = completion.choices[0]
    assert (choice.finish_reason, choice.message.content, choice.message.refusal) == (
        finish,
        content,
        refusal,
    )


async def test_answered_tool_calls_are_accepted(
    openai_server: FakeOpenAIServer, openai_client: openai.AsyncOpenAI
) -> None:
    openai_server.script_chat_completion("done")
    messages = [USER, _assistant("call_1", "call_2"), _tool("call_2"), _tool("call_1")]
    completion = await openai_client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS
    )
    assert completion.choices[0].message.content == "done"


@pytest.mark.parametrize(
    ("messages", "message", "param"),
    [
        pytest.param(
            [USER, _assistant("call_1", "call_2"), _tool("call_1"), USER],
            MISSING + "call_2",
            "messages.[3].role",
            id="missing-response",
        ),
        pytest.param(
            [USER, _assistant("call_1")], MISSING + "call_1", "messages.[2].role", id="trailing"
        ),
        pytest.param([USER, _tool("call_9")], ORPHAN, "messages.[1].role", id="orphan-tool"),
        pytest.param(
            [USER, _assistant("call_1"), _tool("call_1"), _tool("call_9")],
            ORPHAN,
            "messages.[3].role",
            id="unknown-id",
        ),
    ],
)
async def test_unpaired_tool_messages_are_rejected(
    openai_client: openai.AsyncOpenAI, messages: list[Any], message: str, param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        await openai_client.chat.completions.create(model=MODEL, messages=messages)
    assert caught.value.body == {
        "message": message,
        "type": "invalid_request_error",
        "param": param,
        "code": None,
    }


async def test_scripted_errors_also_answer_a_streaming_request(
    openai_server: FakeOpenAIServer, openai_client: openai.AsyncOpenAI
) -> None:
    openai_server.script_error(500, endpoint="chat_completions")
    with pytest.raises(openai.InternalServerError):
        await openai_client.chat.completions.create(model=MODEL, messages=[USER])
    openai_server.script_error(429, endpoint="chat_completions")
    with pytest.raises(openai.RateLimitError):  # an HTTP error, before any event
        await openai_client.chat.completions.create(model=MODEL, messages=[USER], stream=True)
    assert openai_server.streams == []


@given(st.lists(st.integers(min_value=1, max_value=3), min_size=1, max_size=6), st.data())
def test_paired_conversations_pass_and_dropping_any_answer_fails(
    calls_per_turn: list[int], data: st.DataObject
) -> None:
    messages: list[dict[str, Any]] = [USER]
    tool_indexes: list[int] = []
    for turn, count in enumerate(calls_per_turn):
        ids = [f"call_{turn}_{n}" for n in range(count)]
        messages.append(_assistant(*ids))
        for call_id in data.draw(st.permutations(ids)):
            tool_indexes.append(len(messages))
            messages.append(_tool(call_id))
        messages.append({"role": "user", "content": f"next {turn}"})
    assert validate_chat_completions_request({"model": MODEL, "messages": messages}) == []

    dropped = data.draw(st.sampled_from(tool_indexes))
    broken = messages[:dropped] + messages[dropped + 1 :]
    problems = validate_chat_completions_request({"model": MODEL, "messages": broken})
    assert problems == [MISSING + messages[dropped]["tool_call_id"]]


def test_fakes_public_surface() -> None:
    assert fakes.__all__ == sorted(fakes.__all__)
    assert all(hasattr(fakes, name) for name in fakes.__all__)
    servers = {fakes.FakeOpenAIServer, fakes.FakeAnthropicServer, fakes.FakeGeminiServer}
    assert all(issubclass(cls, fakes.FakeProviderServer) for cls in servers)

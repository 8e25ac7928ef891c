"""FakeAnthropicServer (Messages and count_tokens) driven through the official SDK."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import anthropic
import pytest
from anthropic.types import RedactedThinkingBlock, TextBlock, ThinkingBlock, ToolUseBlock

from touba.testing.fakes import (
    FakeAnthropicServer,
    anthropic_redacted_thinking,
    anthropic_text,
    anthropic_thinking,
    anthropic_tool_use,
    estimate_tokens,
    validate_anthropic_count_tokens_request,
    validate_anthropic_messages_request,
)

MODEL = "claude-test"
TOOLS: list[Any] = [
    {"name": "search", "description": "Search the docs.", "input_schema": {"type": "object"}}
]
THINKING: Any = {"type": "enabled", "budget_tokens": 1024}
USER: Any = {"role": "user", "content": "find x"}


async def _tool_turn(
    anthropic_server: FakeAnthropicServer, anthropic_client: anthropic.AsyncAnthropic
) -> list[Any]:
    """A thinking tool-use turn; returns the messages with its results answered."""
    anthropic_server.script_response(
        anthropic_thinking("I should search."),
        anthropic_redacted_thinking(),
        anthropic_tool_use("search", {"q": "x"}),
    )
    message = await anthropic_client.messages.create(
        model=MODEL, max_tokens=2048, messages=[USER], tools=TOOLS, thinking=THINKING
    )
    tool_use = message.content[2]
    assert isinstance(tool_use, ToolUseBlock)
    return [
        USER,
        {
            "role": "assistant",
            "content": [b.model_dump(exclude_none=True) for b in message.content],
        },
        {"role": "user", "content": [_result(tool_use.id)]},
    ]


def _result(tool_use_id: str) -> dict[str, Any]:
    return {"type": "tool_result", "tool_use_id": tool_use_id, "content": "found"}


async def _rejected(
    anthropic_client: anthropic.AsyncAnthropic, messages: list[Any], **options: Any
) -> anthropic.APIStatusError:
    """Send ``messages`` to both endpoints; both must refuse with the same message."""
    with pytest.raises(anthropic.APIStatusError) as create:
        await anthropic_client.messages.create(
            model=MODEL, max_tokens=2048, messages=messages, **options
        )
    with pytest.raises(anthropic.APIStatusError) as count:
        await anthropic_client.messages.count_tokens(model=MODEL, messages=messages, **options)
    assert create.value.api_message == count.value.api_message
    assert isinstance(create.value, anthropic.BadRequestError)
    assert create.value.type == "invalid_request_error"
    return create.value


# typed parsing ------------------------------------------------------------


async def test_thinking_and_tool_use_parse_into_sdk_types(
    anthropic_server: FakeAnthropicServer, anthropic_client: anthropic.AsyncAnthropic
) -> None:
    anthropic_server.script_response(
        anthropic_thinking("I should search."),
        anthropic_redacted_thinking(),
        anthropic_tool_use("search", {"q": "x"}, id="toolu_fixed"),
    )
    message = await anthropic_client.messages.create(
        model=MODEL, max_tokens=2048, messages=[USER], tools=TOOLS, thinking=THINKING
    )

    thinking, redacted, tool_use = message.content
    assert isinstance(thinking, ThinkingBlock)
    assert thinking.thinking == "I should search."
    assert thinking.signature
    assert isinstance(redacted, RedactedThinkingBlock)
    assert redacted.data
    assert isinstance(tool_use, ToolUseBlock)
    assert (tool_use.id, tool_use.name, tool_use.input) == ("toolu_fixed", "search", {"q": "x"})
    assert message.stop_reason == "tool_use"
    assert message.usage.input_tokens == estimate_tokens(anthropic_server.requests[-1].body)


@pytest.mark.parametrize(
    ("blocks", "stop_reason", "expected"),
    [
        pytest.param([anthropic_text("hello")], None, "end_turn", id="text"),
        pytest.param([anthropic_text("hel")], "max_tokens", "max_tokens", id="truncated"),
        pytest.param([], "refusal", "refusal", id="refusal"),
        pytest.param([], None, "end_turn", id="empty"),
    ],
)
async def test_scripted_stop_reasons(
    anthropic_server: FakeAnthropicServer,
    anthropic_client: anthropic.AsyncAnthropic,
    blocks: list[dict[str, Any]],
    stop_reason: str | None,
    expected: str,
) -> None:
    anthropic_server.script_response(*blocks, stop_reason=stop_reason)
    message = await anthropic_client.messages.create(model=MODEL, max_tokens=64, messages=[USER])
    assert message.stop_reason == expected
    assert len(message.content) == len(blocks)
    if blocks:
        assert isinstance(message.content[0], TextBlock)


async def test_round_trip_with_thinking_is_accepted(
    anthropic_server: FakeAnthropicServer, anthropic_client: anthropic.AsyncAnthropic
) -> None:
    messages = await _tool_turn(anthropic_server, anthropic_client)
    anthropic_server.script_response(anthropic_text("done"))
    message = await anthropic_client.messages.create(
        model=MODEL,
        max_tokens=2048,
        messages=messages,
        tools=TOOLS,
        thinking=THINKING,
    )
    assert isinstance(message.content[0], TextBlock)
    assert anthropic_server.requests[-1].body["messages"] == messages


async def test_consecutive_user_messages_are_merged_like_the_api(
    anthropic_server: FakeAnthropicServer, anthropic_client: anthropic.AsyncAnthropic
) -> None:
    messages = await _tool_turn(anthropic_server, anthropic_client)
    messages.append({"role": "user", "content": "one more thing"})
    count = await anthropic_client.messages.count_tokens(model=MODEL, messages=messages)
    assert count.input_tokens > 0


# count_tokens -------------------------------------------------------------


async def test_count_tokens_default_scripted_callable_and_missing(
    anthropic_server: FakeAnthropicServer, anthropic_client: anthropic.AsyncAnthropic
) -> None:
    first = await anthropic_client.messages.count_tokens(model=MODEL, messages=[USER], tools=TOOLS)
    assert first.input_tokens == estimate_tokens(anthropic_server.requests[-1].body)

    anthropic_server.script_count(99)
    assert (
        await anthropic_client.messages.count_tokens(model=MODEL, messages=[USER])
    ).input_tokens == 99

    anthropic_server.count_tokens = lambda body: len(body["messages"]) * 1000
    assert (
        await anthropic_client.messages.count_tokens(model=MODEL, messages=[USER])
    ).input_tokens == 1000

    anthropic_server.script_count(None)
    raw = await anthropic_client.messages.with_raw_response.count_tokens(
        model=MODEL, messages=[USER]
    )
    assert raw.http_response.json() == {}


@pytest.mark.parametrize(
    ("key", "value"),
    [("max_tokens", 10), ("metadata", {"user_id": "u"}), ("stop_sequences", ["x"])],
)
async def test_count_tokens_rejects_generation_only_parameters(
    anthropic_client: anthropic.AsyncAnthropic, key: str, value: object
) -> None:
    with pytest.raises(anthropic.BadRequestError) as caught:
        await anthropic_client.messages.count_tokens(
            model=MODEL, messages=[USER], extra_body={key: value}
        )
    assert caught.value.api_message == f"{key}: Extra inputs are not permitted"


async def test_count_tokens_errors_are_scriptable(
    anthropic_server: FakeAnthropicServer, anthropic_client: anthropic.AsyncAnthropic
) -> None:
    anthropic_server.script_error(500, endpoint="count_tokens")
    with pytest.raises(anthropic.InternalServerError):
        await anthropic_client.messages.count_tokens(model=MODEL, messages=[USER])


# validators, surfaced through the SDK ---------------------------------------


async def test_tool_use_without_result_is_rejected(
    anthropic_server: FakeAnthropicServer, anthropic_client: anthropic.AsyncAnthropic
) -> None:
    messages = await _tool_turn(anthropic_server, anthropic_client)
    tool_id = messages[1]["content"][2]["id"]
    messages[2] = {"role": "user", "content": "never mind"}
    error = await _rejected(anthropic_client, messages)
    assert error.api_message == (
        f"messages.1: `tool_use` ids were found without `tool_result` blocks immediately after: "
        f"{tool_id}. Each `tool_use` block must have a corresponding `tool_result` block in the "
        "next message."
    )


async def test_tool_result_without_tool_use_is_rejected(
    anthropic_client: anthropic.AsyncAnthropic,
) -> None:
    messages = [
        USER,
        {"role": "assistant", "content": "Sure."},
        {"role": "user", "content": [_result("toolu_ghost")]},
    ]
    error = await _rejected(anthropic_client, messages)
    assert error.api_message == (
        "messages.2.content.0: unexpected `tool_use_id` found in `tool_result` blocks: "
        "toolu_ghost. Each `tool_result` block must have a corresponding `tool_use` block in the "
        "previous message."
    )


async def test_tool_results_must_come_first(
    anthropic_server: FakeAnthropicServer, anthropic_client: anthropic.AsyncAnthropic
) -> None:
    messages = await _tool_turn(anthropic_server, anthropic_client)
    messages[2]["content"].insert(0, {"type": "text", "text": "here you go"})
    error = await _rejected(anthropic_client, messages)
    assert error.api_message == (
        "messages.2: Did not find 1 `tool_result` block(s) at the beginning of this message. "
        "Messages following `tool_use` blocks must begin with a matching number of "
        "`tool_result` blocks."
    )


async def test_first_message_must_be_user(anthropic_client: anthropic.AsyncAnthropic) -> None:
    error = await _rejected(anthropic_client, [{"role": "assistant", "content": "hi"}, USER])
    assert error.api_message == 'messages: first message must use the "user" role'


@pytest.mark.parametrize("field", ["thinking", "signature"])
async def test_altered_thinking_is_rejected(
    anthropic_server: FakeAnthropicServer, anthropic_client: anthropic.AsyncAnthropic, field: str
) -> None:
    messages = await _tool_turn(anthropic_server, anthropic_client)
    block = messages[1]["content"][0]
    block[field] = block[field] + " (edited)" if field == "thinking" else "AAAA" + block[field][4:]
    error = await _rejected(anthropic_client, messages, thinking=THINKING)
    assert error.api_message == "messages.1.content.0: Invalid `signature` in `thinking` block"


async def test_foreign_redacted_thinking_is_rejected(
    anthropic_server: FakeAnthropicServer, anthropic_client: anthropic.AsyncAnthropic
) -> None:
    messages = await _tool_turn(anthropic_server, anthropic_client)
    messages[1]["content"][1]["data"] = "RXhvdGljIHJlZGFjdGVkIGRhdGE="
    error = await _rejected(anthropic_client, messages, thinking=THINKING)
    assert error.api_message == "messages.1.content.1: Invalid `data` in `redacted_thinking` block"


async def test_dropping_thinking_from_final_assistant_turn_is_rejected(
    anthropic_server: FakeAnthropicServer, anthropic_client: anthropic.AsyncAnthropic
) -> None:
    messages = await _tool_turn(anthropic_server, anthropic_client)
    messages[1]["content"] = messages[1]["content"][2:]
    error = await _rejected(anthropic_client, messages, thinking=THINKING)
    assert error.api_message is not None
    assert error.api_message.startswith(
        "messages.1.content.0.type: Expected `thinking` or `redacted_thinking`, but found "
        "`tool_use`. When `thinking` is enabled, a final `assistant` message must start with a "
        "thinking block"
    )
    count = await anthropic_client.messages.count_tokens(model=MODEL, messages=messages)
    assert count.input_tokens > 0


def test_missing_anthropic_version_header_is_rejected(
    anthropic_server: FakeAnthropicServer,
) -> None:
    data = json.dumps({"model": MODEL, "max_tokens": 5, "messages": [USER]}).encode()
    request = urllib.request.Request(  # noqa: S310 - loopback
        anthropic_server.base_url + "/v1/messages",
        data=data,
        method="POST",
        headers={"content-type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=5)  # noqa: S310 - loopback
    body = json.loads(caught.value.read())
    caught.value.close()
    assert caught.value.code == 400
    assert body["error"] == {
        "type": "invalid_request_error",
        "message": "anthropic-version: header is required",
    }


def test_validators_are_pure_functions() -> None:
    tool_use = anthropic_tool_use("search", {}, id="toolu_1")
    messages = [
        USER,
        {"role": "assistant", "content": [tool_use]},
        {"role": "user", "content": [_result("toolu_1")]},
    ]
    assert (
        validate_anthropic_messages_request({"model": MODEL, "max_tokens": 5, "messages": messages})
        == []
    )
    assert validate_anthropic_count_tokens_request({"model": MODEL, "messages": messages}) == []
    assert validate_anthropic_messages_request({"model": MODEL, "messages": messages}) == [
        "max_tokens: Field required"
    ]


FORCED = "Thinking may not be enabled when tool_choice forces tool use."


@pytest.mark.parametrize(
    ("thinking", "choice", "refused"),
    [
        ({"type": "enabled", "budget_tokens": 1024}, {"type": "any"}, True),
        ({"type": "enabled", "budget_tokens": 1024}, {"type": "tool", "name": "search"}, True),
        ({"type": "adaptive"}, {"type": "any"}, True),
        ({"type": "adaptive"}, {"type": "tool", "name": "search"}, True),
        ({"type": "enabled", "budget_tokens": 1024}, {"type": "auto"}, False),
        ({"type": "adaptive"}, {"type": "auto"}, False),
        ({"type": "adaptive"}, {"type": "none"}, False),
        ({"type": "disabled"}, {"type": "tool", "name": "search"}, False),
        (None, {"type": "any"}, False),
    ],
)
def test_a_forced_tool_choice_is_refused_whenever_thinking_is_on(
    thinking: Any, choice: Any, refused: bool
) -> None:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 2048, "messages": [USER]}
    body["tools"] = [{"name": "search", "input_schema": {"type": "object"}}]
    body["tool_choice"] = choice
    if thinking is not None:
        body["thinking"] = thinking
    problems = validate_anthropic_messages_request(body)
    assert (FORCED in problems) is refused
    assert (
        FORCED
        in validate_anthropic_count_tokens_request(
            {k: v for k, v in body.items() if k != "max_tokens"}
        )
    ) is refused


# scripted errors ------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "error_type", "kind"),
    [
        (400, anthropic.BadRequestError, "invalid_request_error"),
        (429, anthropic.RateLimitError, "rate_limit_error"),
        (500, anthropic.InternalServerError, "api_error"),
        (529, anthropic.InternalServerError, "overloaded_error"),
    ],
)
async def test_scripted_errors_raise_the_sdk_error(
    anthropic_server: FakeAnthropicServer,
    anthropic_client: anthropic.AsyncAnthropic,
    status: int,
    error_type: type[anthropic.APIStatusError],
    kind: str,
) -> None:
    anthropic_server.script_error(status)
    with pytest.raises(error_type) as caught:
        await anthropic_client.messages.create(model=MODEL, max_tokens=5, messages=[USER])
    assert caught.value.status_code == status
    assert caught.value.type == kind
    assert caught.value.request_id is not None

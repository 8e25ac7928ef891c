"""FakeOpenAIServer (Responses API and its input-token count) driven through the official SDK."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import openai
import pytest
from hypothesis import given
from hypothesis import strategies as st
from openai.types.responses import (
    ResponseFunctionToolCall,
    ResponseOutputMessage,
    ResponseReasoningItem,
)

from touba.testing.fakes import (
    FakeOpenAIServer,
    estimate_tokens,
    openai_function_call,
    openai_reasoning,
    openai_refusal,
    openai_text,
    validate_openai_input_tokens_request,
    validate_openai_responses_request,
)

MODEL = "gpt-test"
TOOLS: list[Any] = [
    {
        "type": "function",
        "name": "search",
        "description": "Search the docs.",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
        "strict": False,
    }
]
USER: Any = {"role": "user", "content": "find x"}
ENCRYPTED: Any = ["reasoning.encrypted_content"]


async def _call_with_reasoning(
    openai_server: FakeOpenAIServer, openai_client: openai.AsyncOpenAI, *, store: bool = False
) -> list[Any]:
    """One generation returning reasoning + function call; the replayable input after it."""
    openai_server.script_response(
        openai_reasoning("look it up"), openai_function_call("search", {"q": "x"})
    )
    response = await openai_client.responses.create(
        model=MODEL, input=[USER], tools=TOOLS, store=store, include=ENCRYPTED
    )
    return [USER, *(item.model_dump(exclude_none=True) for item in response.output)]


def _output(call_id: str, output: str = "found") -> dict[str, Any]:
    return {"type": "function_call_output", "call_id": call_id, "output": output}


# typed parsing ------------------------------------------------------------


async def test_reasoning_and_function_call_parse_into_sdk_types(
    openai_server: FakeOpenAIServer, openai_client: openai.AsyncOpenAI
) -> None:
    openai_server.script_response(
        openai_reasoning("look it up"),
        openai_function_call("search", {"q": "x"}, call_id="call_fixed"),
    )
    response = await openai_client.responses.create(
        model=MODEL, input="find x", tools=TOOLS, store=False, include=ENCRYPTED
    )

    reasoning, call = response.output
    assert isinstance(reasoning, ResponseReasoningItem)
    assert reasoning.id.startswith("rs_")
    assert reasoning.summary[0].text == "look it up"
    assert reasoning.encrypted_content is not None
    assert reasoning.encrypted_content.startswith("gAAAAA")
    assert isinstance(call, ResponseFunctionToolCall)
    assert (call.name, call.call_id, json.loads(call.arguments)) == (
        "search",
        "call_fixed",
        {"q": "x"},
    )
    assert call.id is not None
    assert call.id.startswith("fc_")
    assert response.status == "completed"
    assert response.usage is not None
    assert response.usage.input_tokens == estimate_tokens(openai_server.requests[-1].body)


async def test_encrypted_content_only_when_included(
    openai_server: FakeOpenAIServer, openai_client: openai.AsyncOpenAI
) -> None:
    openai_server.script_response(openai_reasoning("hidden"), openai_text("hi"))
    response = await openai_client.responses.create(model=MODEL, input="hi", store=False)
    reasoning = response.output[0]
    assert isinstance(reasoning, ResponseReasoningItem)
    assert reasoning.encrypted_content is None


@pytest.mark.parametrize(
    ("items", "incomplete", "check"),
    [
        pytest.param([openai_text("hello")], None, "text", id="text"),
        pytest.param([openai_refusal("I can't help")], None, "refusal", id="refusal"),
        pytest.param([openai_text("hel")], "max_output_tokens", "incomplete", id="truncated"),
        pytest.param([], None, "empty", id="empty"),
    ],
)
async def test_scripted_output_shapes(
    openai_server: FakeOpenAIServer,
    openai_client: openai.AsyncOpenAI,
    items: list[dict[str, Any]],
    incomplete: str | None,
    check: str,
) -> None:
    openai_server.script_response(*items, incomplete_reason=incomplete)
    response = await openai_client.responses.create(model=MODEL, input="hi")
    if check == "text":
        assert response.output_text == "hello"
    elif check == "refusal":
        message = response.output[0]
        assert isinstance(message, ResponseOutputMessage)
        assert message.content[0].type == "refusal"
    elif check == "incomplete":
        assert response.status == "incomplete"
        assert response.incomplete_details is not None
        assert response.incomplete_details.reason == "max_output_tokens"
    else:
        assert response.output == []
        assert response.output_text == ""


async def test_full_round_trip_with_store_false_is_accepted(
    openai_server: FakeOpenAIServer, openai_client: openai.AsyncOpenAI
) -> None:
    items = await _call_with_reasoning(openai_server, openai_client)
    items.append(_output(items[2]["call_id"]))
    openai_server.script_response(openai_text("done"))

    response = await openai_client.responses.create(
        model=MODEL, input=items, tools=TOOLS, store=False, include=ENCRYPTED
    )

    assert response.output_text == "done"
    assert openai_server.requests[-1].body["input"] == items


# count endpoint -----------------------------------------------------------


async def test_input_tokens_default_count_is_deterministic(
    openai_server: FakeOpenAIServer, openai_client: openai.AsyncOpenAI
) -> None:
    first = await openai_client.responses.input_tokens.count(model=MODEL, input=[USER], tools=TOOLS)
    second = await openai_client.responses.input_tokens.count(
        model=MODEL, input=[USER], tools=TOOLS
    )

    assert first.object == "response.input_tokens"
    assert (
        first.input_tokens
        == second.input_tokens
        == estimate_tokens(openai_server.requests[-1].body)
    )


async def test_input_tokens_scripted_value_callable_and_missing_field(
    openai_server: FakeOpenAIServer, openai_client: openai.AsyncOpenAI
) -> None:
    openai_server.script_count(4242)
    assert (
        await openai_client.responses.input_tokens.count(model=MODEL, input="x")
    ).input_tokens == 4242

    openai_server.count_tokens = lambda body: 7 * len(body["input"])
    assert (
        await openai_client.responses.input_tokens.count(model=MODEL, input="abc")
    ).input_tokens == 21

    openai_server.script_count(None)
    raw = await openai_client.responses.input_tokens.with_raw_response.count(model=MODEL, input="x")
    assert raw.http_response.json() == {"object": "response.input_tokens"}


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("store", False),
        ("include", ENCRYPTED),
        ("max_output_tokens", 100),
        ("metadata", {"a": "b"}),
        ("stream", False),
    ],
)
async def test_input_tokens_rejects_generation_only_parameters(
    openai_client: openai.AsyncOpenAI, key: str, value: object
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        await openai_client.responses.input_tokens.count(
            model=MODEL, input="x", extra_body={key: value}
        )
    assert caught.value.body == {
        "message": f"Unknown parameter: '{key}'.",
        "type": "invalid_request_error",
        "param": key,
        "code": "unknown_parameter",
    }


async def test_count_endpoint_errors_are_scriptable(
    openai_server: FakeOpenAIServer, openai_client: openai.AsyncOpenAI
) -> None:
    openai_server.script_error(500, endpoint="input_tokens")
    with pytest.raises(openai.InternalServerError):
        await openai_client.responses.input_tokens.count(model=MODEL, input="x")
    openai_server.script_error(429, endpoint="input_tokens")
    with pytest.raises(openai.RateLimitError):
        await openai_client.responses.input_tokens.count(model=MODEL, input="x")


# validators, surfaced through the SDK ---------------------------------------


async def _rejected(
    openai_client: openai.AsyncOpenAI, items: list[Any], **options: Any
) -> openai.APIStatusError:
    """Send ``items`` to both endpoints; both must refuse the same way."""
    with pytest.raises(openai.APIStatusError) as generation:
        await openai_client.responses.create(model=MODEL, input=items, **options)
    with pytest.raises(openai.APIStatusError) as count:
        await openai_client.responses.input_tokens.count(model=MODEL, input=items)
    assert generation.value.body == count.value.body
    return generation.value


async def test_function_call_output_without_call_is_rejected(
    openai_client: openai.AsyncOpenAI,
) -> None:
    error = await _rejected(openai_client, [USER, _output("call_nobody")])
    assert isinstance(error, openai.BadRequestError)
    assert error.body == {
        "message": "No tool call found for function call output with call_id call_nobody.",
        "type": "invalid_request_error",
        "param": "input",
        "code": None,
    }


async def test_function_call_without_output_is_rejected_when_input_continues(
    openai_client: openai.AsyncOpenAI,
) -> None:
    call = openai_function_call("search", {"q": "x"}, call_id="call_a")
    error = await _rejected(openai_client, [USER, call, {"role": "user", "content": "and?"}])
    assert isinstance(error, openai.BadRequestError)
    assert error.message == "Error code: 400 - No tool output found for function call call_a."
    assert error.param == "input"

    trailing = await openai_client.responses.input_tokens.count(model=MODEL, input=[USER, call])  # type: ignore[list-item]
    assert trailing.input_tokens > 0


async def test_reasoning_without_following_item_is_rejected(
    openai_server: FakeOpenAIServer, openai_client: openai.AsyncOpenAI
) -> None:
    items = await _call_with_reasoning(openai_server, openai_client)
    reasoning = items[1]
    error = await _rejected(openai_client, [USER, reasoning, {"role": "user", "content": "next"}])
    assert isinstance(error, openai.BadRequestError)
    assert error.body == {
        "message": f"Item '{reasoning['id']}' of type 'reasoning' was provided without its "
        "required following item.",
        "type": "invalid_request_error",
        "param": "input",
        "code": None,
    }


@pytest.mark.parametrize("tamper", ["altered", "foreign"])
async def test_tampered_or_foreign_encrypted_content_is_rejected(
    openai_server: FakeOpenAIServer, openai_client: openai.AsyncOpenAI, tamper: str
) -> None:
    items = await _call_with_reasoning(openai_server, openai_client)
    items.append(_output(items[2]["call_id"]))
    token = items[1]["encrypted_content"]
    items[1]["encrypted_content"] = (
        token[:10] + ("A" if token[10] != "A" else "B") + token[11:]
        if tamper == "altered"
        else "gAAAAABforeignTokenFromAnotherServer=="
    )
    shown = f"{items[1]['encrypted_content'][:4]}...{items[1]['encrypted_content'][-4:]}"
    error = await _rejected(openai_client, items, store=False)
    assert error.status_code == 400
    assert error.code == "invalid_encrypted_content"
    assert error.body == {
        "message": f"The encrypted content {shown} could not be verified.",
        "type": "invalid_request_error",
        "param": None,
        "code": "invalid_encrypted_content",
    }


async def test_reasoning_by_id_needs_a_stored_response(
    openai_server: FakeOpenAIServer, openai_client: openai.AsyncOpenAI
) -> None:
    items = await _call_with_reasoning(openai_server, openai_client, store=False)
    items.append(_output(items[2]["call_id"]))
    del items[1]["encrypted_content"]
    error = await _rejected(openai_client, items, store=False)
    assert isinstance(error, openai.NotFoundError)
    assert error.body == {
        "message": f"Item with id '{items[1]['id']}' not found. Items are not persisted when "
        "`store` is set to false. Try again with `store` set to true, or remove this item from "
        "your input.",
        "type": "invalid_request_error",
        "param": "input",
        "code": None,
    }

    stored = await _call_with_reasoning(openai_server, openai_client, store=True)
    stored.append(_output(stored[2]["call_id"]))
    del stored[1]["encrypted_content"]
    count = await openai_client.responses.input_tokens.count(model=MODEL, input=stored)
    assert count.input_tokens > 0


async def test_item_without_its_reasoning_is_rejected(
    openai_server: FakeOpenAIServer, openai_client: openai.AsyncOpenAI
) -> None:
    items = await _call_with_reasoning(openai_server, openai_client)
    call = items[2]
    error = await _rejected(openai_client, [USER, call, _output(call["call_id"])])
    assert isinstance(error, openai.BadRequestError)
    assert isinstance(error.body, dict)
    assert error.body["message"] == (
        f"Item '{call['id']}' of type 'function_call' was provided without its required "
        f"'reasoning' item: '{items[1]['id']}'."
    )


@pytest.mark.parametrize(
    ("tool", "param"),
    [
        ({"type": "function", "parameters": {"type": "object"}}, "tools[0].name"),
        ({"type": "function", "name": "search"}, "tools[0].parameters"),
        ({"type": "function", "function": {"name": "search"}}, "tools[0].name"),
        ({"name": "search", "parameters": {}}, "tools[0].type"),
    ],
)
async def test_malformed_tools_are_rejected(
    openai_client: openai.AsyncOpenAI, tool: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        await openai_client.responses.create(model=MODEL, input="x", tools=[tool])  # type: ignore[list-item]
    assert caught.value.body == {
        "message": f"Missing required parameter: '{param}'.",
        "type": "invalid_request_error",
        "param": param,
        "code": "missing_required_parameter",
    }


async def test_function_call_arguments_must_be_a_string(openai_client: openai.AsyncOpenAI) -> None:
    call = {"type": "function_call", "call_id": "c1", "name": "search", "arguments": {"q": 1}}
    error = await _rejected(openai_client, [USER, call, _output("c1")])
    assert error.code == "invalid_type"
    assert error.param == "input[1].arguments"


async def test_stream_true_is_answered_with_events(
    openai_server: FakeOpenAIServer, openai_client: openai.AsyncOpenAI
) -> None:
    openai_server.script_response(openai_text("streamed"))
    stream = await openai_client.responses.create(model=MODEL, input="x", stream=True)
    kinds = [event.type async for event in stream]
    assert kinds[0] == "response.created"
    assert kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds


async def test_rejection_does_not_consume_the_scripted_reply(
    openai_server: FakeOpenAIServer, openai_client: openai.AsyncOpenAI
) -> None:
    openai_server.script_response(openai_text("kept"))
    with pytest.raises(openai.BadRequestError):
        await openai_client.responses.create(model=MODEL, input=[USER, _output("call_x")])  # type: ignore[list-item]
    assert openai_server.pending("responses") == 1
    assert (await openai_client.responses.create(model=MODEL, input="x")).output_text == "kept"


def test_validators_are_pure_functions() -> None:
    call = openai_function_call("search", {"q": "x"}, call_id="call_1")
    good = {"model": MODEL, "input": [USER, call, _output("call_1")], "tools": TOOLS}
    assert validate_openai_responses_request(good) == []
    assert validate_openai_input_tokens_request(good) == []
    assert validate_openai_responses_request({"model": MODEL, "input": [USER, _output("c")]}) == [
        "No tool call found for function call output with call_id c."
    ]
    assert validate_openai_input_tokens_request({"input": "x", "store": False}) == [
        "Unknown parameter: 'store'."
    ]


@given(st.lists(st.integers(min_value=1, max_value=3), min_size=2, max_size=5), st.data())
def test_paired_input_passes_and_breaking_a_pair_fails(
    calls_per_exchange: list[int], data: st.DataObject
) -> None:
    items: list[dict[str, Any]] = [USER]
    for n, count in enumerate(calls_per_exchange):
        ids = [f"call_{n}_{k}" for k in range(count)]
        items.extend(openai_function_call("search", {"k": i}, call_id=i) for i in ids)
        items.extend(_output(i) for i in data.draw(st.permutations(ids)))
        items.append({"role": "user", "content": f"then {n}"})
    assert validate_openai_responses_request({"model": MODEL, "input": items}) == []

    index = data.draw(st.sampled_from([i for i, item in enumerate(items) if "call_id" in item]))
    broken = items[:index] + items[index + 1 :]
    call_id = items[index]["call_id"]
    expected = (
        f"No tool output found for function call {call_id}."
        if items[index]["type"] == "function_call_output"
        else f"No tool call found for function call output with call_id {call_id}."
    )
    assert validate_openai_responses_request({"model": MODEL, "input": broken}) == [expected]


# scripted errors and server mechanics ----------------------------------------


@pytest.mark.parametrize(
    ("status", "error_type"),
    [
        (400, openai.BadRequestError),
        (429, openai.RateLimitError),
        (500, openai.InternalServerError),
        (503, openai.InternalServerError),
    ],
)
async def test_scripted_generation_errors_raise_the_sdk_error(
    openai_server: FakeOpenAIServer,
    openai_client: openai.AsyncOpenAI,
    status: int,
    error_type: type[openai.APIStatusError],
) -> None:
    openai_server.script_error(status)
    with pytest.raises(error_type) as caught:
        await openai_client.responses.create(model=MODEL, input="x")
    assert caught.value.status_code == status
    assert isinstance(caught.value.body, dict)
    assert set(caught.value.body) == {"message", "type", "param", "code"}


async def test_unscripted_generation_answers_500_with_a_hint(
    openai_client: openai.AsyncOpenAI,
) -> None:
    with pytest.raises(openai.InternalServerError, match="script_response"):
        await openai_client.responses.create(model=MODEL, input="x")


async def test_requests_are_recorded_without_secrets(
    openai_server: FakeOpenAIServer, openai_client: openai.AsyncOpenAI
) -> None:
    openai_server.script_response(openai_text("hi"))
    await openai_client.responses.create(model=MODEL, input="hi", store=False)
    (request,) = openai_server.requests_to("responses")
    assert (request.method, request.path, request.status) == ("POST", "/v1/responses", 200)
    assert request.body == {"model": MODEL, "input": "hi", "store": False}
    assert "authorization" not in request.headers
    assert request.headers["content-type"] == "application/json"


async def test_delayed_reply_times_out_and_close_is_clean(openai_server: FakeOpenAIServer) -> None:
    sdk = openai.AsyncOpenAI(
        base_url=openai_server.base_url + "/v1", api_key="test", max_retries=0, timeout=0.2
    )
    openai_server.script_count(10, delay=30)
    with pytest.raises(openai.APITimeoutError):
        await sdk.responses.input_tokens.count(model=MODEL, input="x")
    await sdk.close()
    openai_server.close()


def test_lifecycle_and_unknown_routes() -> None:
    srv = FakeOpenAIServer()
    with pytest.raises(RuntimeError, match="start"):
        _ = srv.base_url
    with srv:
        url = srv.base_url + "/v1/models"
        request = urllib.request.Request(url, data=b"{}", method="POST")  # noqa: S310 - loopback
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(request, timeout=5)  # noqa: S310 - loopback
        assert caught.value.code == 404
        caught.value.close()
        with pytest.raises(RuntimeError, match="only once"):
            srv.start()
    srv.close()
    with pytest.raises(ValueError, match="unknown endpoint"):
        srv.script_error(500, endpoint="nope")

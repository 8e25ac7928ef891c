"""FakeGeminiServer (generateContent and countTokens) driven through google-genai."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from google import genai
from google.genai import errors, types

from touba.testing.fakes import (
    FakeGeminiServer,
    estimate_tokens,
    gemini_function_call,
    gemini_text,
    gemini_thought,
    validate_gemini_count_tokens_request,
    validate_gemini_generate_content_request,
)

MODEL = "gemini-test"
CONFIG = types.GenerateContentConfig(
    tools=[
        types.Tool(
            function_declarations=[
                types.FunctionDeclaration(name="search", parameters_json_schema={"type": "object"})
            ]
        )
    ],
    automatic_function_calling=types.AutomaticFunctionCallingConfig(disable=True),
)
USER = types.Content(role="user", parts=[types.Part(text="find x")])
MISMATCH = (
    "Please ensure that the number of function response parts is equal to the number of "
    "function call parts of the function call turn."
)


def _answer(name: str = "search") -> types.Content:
    return types.Content(
        role="user", parts=[types.Part.from_function_response(name=name, response={"r": 1})]
    )


async def _call_turn(
    gemini_server: FakeGeminiServer, gemini_client: genai.Client
) -> list[types.Content]:
    """A thought + signed function call turn, answered; the contents to replay."""
    gemini_server.script_response(
        gemini_thought("plan a search"), gemini_function_call("search", {"q": "x"})
    )
    response = await gemini_client.aio.models.generate_content(
        model=MODEL, contents=USER, config=CONFIG
    )
    assert response.candidates
    model_turn = response.candidates[0].content
    assert model_turn is not None
    return [USER, model_turn, _answer()]


async def _post(gemini_client: genai.Client, method: str, body: dict[str, Any]) -> dict[str, Any]:
    """A raw POST through the SDK's own transport (how a guard sends generateContentRequest)."""
    response = await gemini_client.aio._api_client.async_request(
        "post", f"models/{MODEL}:{method}", body
    )
    parsed: dict[str, Any] = json.loads(response.body or "{}")
    return parsed


async def _rejected(gemini_client: genai.Client, contents: list[Any]) -> errors.ClientError:
    with pytest.raises(errors.ClientError) as caught:
        await gemini_client.aio.models.generate_content(
            model=MODEL, contents=contents, config=CONFIG
        )
    assert (caught.value.code, caught.value.status) == (400, "INVALID_ARGUMENT")
    return caught.value


# typed parsing ------------------------------------------------------------


async def test_thought_and_function_call_parse_with_signatures(
    gemini_server: FakeGeminiServer, gemini_client: genai.Client
) -> None:
    gemini_server.script_response(
        gemini_thought("plan a search"), gemini_function_call("search", {"q": "x"})
    )
    response = await gemini_client.aio.models.generate_content(
        model=MODEL, contents=USER, config=CONFIG
    )

    assert response.candidates
    candidate = response.candidates[0]
    assert candidate.finish_reason == types.FinishReason.STOP
    assert candidate.content is not None
    assert candidate.content.parts is not None
    thought, call = candidate.content.parts
    assert (thought.text, thought.thought) == ("plan a search", True)
    assert isinstance(thought.thought_signature, bytes)
    assert call.function_call is not None
    assert (call.function_call.name, call.function_call.args) == ("search", {"q": "x"})
    assert isinstance(call.thought_signature, bytes)
    assert response.function_calls is not None
    assert response.usage_metadata is not None
    assert response.usage_metadata.prompt_token_count == estimate_tokens(
        gemini_server.requests[-1].body
    )


async def test_round_trip_keeps_signatures_and_is_accepted(
    gemini_server: FakeGeminiServer, gemini_client: genai.Client
) -> None:
    contents = await _call_turn(gemini_server, gemini_client)
    gemini_server.script_response(gemini_text("done"))
    response = await gemini_client.aio.models.generate_content(
        model=MODEL, contents=contents, config=CONFIG
    )
    assert response.text == "done"
    sent = gemini_server.requests[-1].body["contents"][1]["parts"]
    assert all("thoughtSignature" in part for part in sent)


@pytest.mark.parametrize(
    ("parts", "finish", "block", "check"),
    [
        pytest.param([gemini_text("hel")], "MAX_TOKENS", None, "truncated", id="truncated"),
        pytest.param([], "SAFETY", None, "refused", id="refused"),
        pytest.param([], "STOP", "SAFETY", "blocked", id="blocked"),
        pytest.param([], "STOP", None, "empty", id="empty"),
    ],
)
async def test_scripted_finish_shapes(
    gemini_server: FakeGeminiServer,
    gemini_client: genai.Client,
    parts: list[dict[str, Any]],
    finish: str,
    block: str | None,
    check: str,
) -> None:
    gemini_server.script_response(*parts, finish_reason=finish, block_reason=block)
    response = await gemini_client.aio.models.generate_content(model=MODEL, contents="hi")
    if check == "blocked":
        assert not response.candidates
        assert response.prompt_feedback is not None
        assert response.prompt_feedback.block_reason == types.BlockedReason.SAFETY
        return
    assert response.candidates
    candidate = response.candidates[0]
    assert candidate.finish_reason == types.FinishReason(finish)
    if check == "truncated":
        assert response.text == "hel"
    elif check == "refused":
        assert candidate.content is None
    else:
        assert candidate.content is not None
        assert not candidate.content.parts


# countTokens ----------------------------------------------------------------


async def test_sdk_count_tokens_sends_contents_only(
    gemini_server: FakeGeminiServer, gemini_client: genai.Client
) -> None:
    contents = await _call_turn(gemini_server, gemini_client)
    count = await gemini_client.aio.models.count_tokens(model=MODEL, contents=contents)
    request = gemini_server.requests_to("count_tokens")[-1]
    assert set(request.body) == {"contents"}
    assert count.total_tokens == estimate_tokens(request.body)


async def test_raw_count_with_generate_content_request(
    gemini_server: FakeGeminiServer, gemini_client: genai.Client
) -> None:
    await _call_turn(gemini_server, gemini_client)
    generate = gemini_server.requests_to("generate_content")[-1].body
    full = {"generateContentRequest": {"model": f"models/{MODEL}", **generate}}
    answer = await _post(gemini_client, "countTokens", full)
    assert answer["totalTokens"] == estimate_tokens(full)
    assert gemini_server.requests[-1].body["generateContentRequest"]["tools"] == generate["tools"]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        pytest.param(
            {"generateContentRequest": {"contents": [{"role": "user", "parts": [{"text": "x"}]}]}},
            "* GenerateContentRequest.model: unexpected model name format\n",
            id="no-model",
        ),
        pytest.param(
            {"contents": [], "systemInstruction": {"parts": [{"text": "be brief"}]}},
            'Invalid JSON payload received. Unknown name "systemInstruction": Cannot find field.',
            id="top-level-system-instruction",
        ),
    ],
)
async def test_raw_count_rejections(
    gemini_client: genai.Client, body: dict[str, Any], message: str
) -> None:
    with pytest.raises(errors.ClientError) as caught:
        await _post(gemini_client, "countTokens", body)
    assert (caught.value.code, caught.value.message) == (400, message)


async def test_count_tokens_scripted_callable_missing_and_errors(
    gemini_server: FakeGeminiServer, gemini_client: genai.Client
) -> None:
    gemini_server.script_count(321)
    assert (
        await gemini_client.aio.models.count_tokens(model=MODEL, contents="x")
    ).total_tokens == 321

    gemini_server.count_tokens = lambda body: 5
    assert (
        await gemini_client.aio.models.count_tokens(model=MODEL, contents="x")
    ).total_tokens == 5

    gemini_server.script_count(None)
    assert (
        await gemini_client.aio.models.count_tokens(model=MODEL, contents="x")
    ).total_tokens is None

    gemini_server.script_error(500, endpoint="count_tokens")
    with pytest.raises(errors.ServerError) as caught:
        await gemini_client.aio.models.count_tokens(model=MODEL, contents="x")
    assert (caught.value.code, caught.value.status) == (500, "INTERNAL")


# validators, surfaced through the SDK ---------------------------------------


async def test_function_response_count_must_match_calls(
    gemini_server: FakeGeminiServer, gemini_client: genai.Client
) -> None:
    contents = await _call_turn(gemini_server, gemini_client)
    answer = types.Part.from_function_response(name="search", response={"r": 1})
    contents[2] = types.Content(role="user", parts=[answer, answer])
    error = await _rejected(gemini_client, contents)
    assert error.message == MISMATCH

    with pytest.raises(errors.ClientError, match="number of function response parts"):
        await gemini_client.aio.models.count_tokens(model=MODEL, contents=contents)


def _model_parts(contents: list[types.Content]) -> list[types.Part]:
    """The parts of the model turn of a ``_call_turn`` (the thought, the signed call)."""
    parts = contents[1].parts
    assert parts is not None
    return parts


def _alter_args(parts: list[types.Part]) -> None:
    assert parts[1].function_call is not None
    parts[1].function_call.args = {"q": "something else"}


def _move_signature(parts: list[types.Part]) -> None:
    parts[0].thought_signature, parts[1].thought_signature = (
        parts[1].thought_signature,
        parts[0].thought_signature,
    )


@pytest.mark.parametrize(
    "tamper", [_alter_args, _move_signature], ids=["altered_args", "moved_signature"]
)
async def test_altered_args_or_a_moved_signature_are_rejected(
    gemini_server: FakeGeminiServer,
    gemini_client: genai.Client,
    tamper: Callable[[list[types.Part]], None],
) -> None:
    contents = await _call_turn(gemini_server, gemini_client)
    tamper(_model_parts(contents))
    assert (await _rejected(gemini_client, contents)).message == "Corrupted thought signature."


async def test_dropped_signature_is_rejected_only_in_the_current_turn(
    gemini_server: FakeGeminiServer, gemini_client: genai.Client
) -> None:
    contents = await _call_turn(gemini_server, gemini_client)
    _model_parts(contents)[1].thought_signature = None
    error = await _rejected(gemini_client, contents)
    assert error.message is not None
    assert error.message.startswith(
        "Function call is missing a thought_signature in functionCall parts. This is required "
        "for tools to work correctly"
    )
    assert "`default_api:search`" in error.message

    older = [*contents, types.Content(role="model", parts=[types.Part(text="done")]), USER]
    gemini_server.script_response(gemini_text("fine"))
    response = await gemini_client.aio.models.generate_content(
        model=MODEL, contents=older, config=CONFIG
    )
    assert response.text == "fine"


async def test_function_response_without_call_is_rejected(gemini_client: genai.Client) -> None:
    error = await _rejected(gemini_client, [USER, _answer()])
    assert error.message == (
        "Please ensure that function response turn comes immediately after a function call turn."
    )


def test_validators_are_pure_functions() -> None:
    call = gemini_function_call("search", {"q": "x"}, signed=False)
    contents = [
        {"role": "user", "parts": [{"text": "hi"}]},
        {"role": "model", "parts": [call]},
        {"role": "user", "parts": [{"functionResponse": {"name": "search", "response": {}}}]},
    ]
    assert validate_gemini_generate_content_request({"contents": contents}) == []
    assert validate_gemini_count_tokens_request({"contents": contents}) == []
    assert validate_gemini_generate_content_request({"contents": [*contents[:2], contents[0]]}) == [
        MISMATCH
    ]
    assert (
        validate_gemini_count_tokens_request(
            {"generateContentRequest": {"model": f"models/{MODEL}", "contents": contents}}
        )
        == []
    )


def test_skip_marker_is_accepted_only_on_calls_of_the_current_turn() -> None:
    """Gemini documents the marker for function calls the model did not produce."""
    marker = "skip_thought_signature_validator"
    call = {"functionCall": {"name": "search", "args": {}}, "thoughtSignature": marker}
    answer = {"role": "user", "parts": [{"functionResponse": {"name": "search", "response": {}}}]}
    current = [{"role": "user", "parts": [{"text": "hi"}]}, {"role": "model", "parts": [call]}]
    assert validate_gemini_generate_content_request({"contents": [*current, answer]}) == []
    on_text = {"role": "model", "parts": [{"text": "t", "thoughtSignature": marker}]}
    problems = validate_gemini_generate_content_request(
        {"contents": [current[0], on_text, {"role": "user", "parts": [{"text": "more"}]}]}
    )
    assert [str(p) for p in problems] == ["Corrupted thought signature."]


# scripted errors ------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "error_type", "grpc_status"),
    [
        (400, errors.ClientError, "INVALID_ARGUMENT"),
        (429, errors.ClientError, "RESOURCE_EXHAUSTED"),
        (500, errors.ServerError, "INTERNAL"),
        (503, errors.ServerError, "UNAVAILABLE"),
    ],
)
async def test_scripted_errors_raise_the_sdk_error(
    gemini_server: FakeGeminiServer,
    gemini_client: genai.Client,
    status: int,
    error_type: type[errors.APIError],
    grpc_status: str,
) -> None:
    gemini_server.script_error(status)
    with pytest.raises(error_type) as caught:
        await gemini_client.aio.models.generate_content(model=MODEL, contents="hi")
    assert (caught.value.code, caught.value.status) == (status, grpc_status)
    assert len(gemini_server.requests) == 1

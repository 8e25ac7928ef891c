"""The fakes stream: each vendor's events, read by the official SDKs' own stream helpers.

A seeded fake answers the same script with the same ids and signatures, so a
streamed answer can be compared with the non-streamed one of a twin server.
The knobs delay events, cut the connection, end the body early or send the
vendor's error event; the fake records how each stream ended and sees the
client close it.
"""

from __future__ import annotations

import time
from typing import Any

import anthropic
import openai
import pytest
from google.genai import types

from tests._providers import anthropic_sdk, close_gemini, gemini_sdk, openai_sdk
from touba.testing.fakes import (
    FakeAnthropicServer,
    FakeGeminiServer,
    FakeOpenAIServer,
    StreamKnobs,
    anthropic_redacted_thinking,
    anthropic_text,
    anthropic_thinking,
    anthropic_tool_use,
    chat_tool_call,
    gemini_function_call,
    gemini_text,
    gemini_thought,
    openai_function_call,
    openai_reasoning,
    openai_text,
)

MODEL = "model-test"
TEXT = "The order left the warehouse this morning."
SEEDED: dict[str, Any] = {"seed": 3, "secret": b"s" * 32}


def _openai_items() -> list[dict[str, Any]]:
    return [
        openai_reasoning("checking"),
        openai_text(TEXT),
        openai_function_call("lookup", {"q": "A1"}),
    ]


async def test_responses_stream_assembles_into_the_non_streamed_response() -> None:
    include: Any = ["reasoning.encrypted_content"]
    with FakeOpenAIServer(**SEEDED) as plain, FakeOpenAIServer(**SEEDED) as streamed:
        plain.script_response(*_openai_items())
        streamed.script_response(*_openai_items())
        async with openai_sdk(plain) as one, openai_sdk(streamed) as two:
            expected = await one.responses.create(
                model=MODEL, input="x", store=False, include=include
            )
            async with two.responses.stream(
                model=MODEL, input="x", store=False, include=include
            ) as stream:
                texts = [e.delta async for e in stream if e.type == "response.output_text.delta"]
                final = await stream.get_final_response()
    assert "".join(texts) == TEXT
    assert len(texts) > 1
    assert final.output_text == TEXT
    assembled = [item.to_dict(exclude_none=True) for item in final.output]  # no "parsed": None
    assert assembled == [item.to_dict(exclude_none=True) for item in expected.output]
    assert final.usage == expected.usage
    assert streamed.wait_stream_end(0).outcome == "completed"


async def test_chat_completions_stream_assembles_into_the_non_streamed_completion() -> None:
    def script(srv: FakeOpenAIServer) -> None:
        srv.script_chat_completion(TEXT, tool_calls=[chat_tool_call("lookup", {"q": "A1"})])

    with FakeOpenAIServer(**SEEDED) as plain, FakeOpenAIServer(**SEEDED) as streamed:
        script(plain)
        script(streamed)
        async with openai_sdk(plain) as one, openai_sdk(streamed) as two:
            messages: Any = [{"role": "user", "content": "x"}]
            expected = await one.chat.completions.create(model=MODEL, messages=messages)
            chunks = [
                chunk
                async for chunk in await two.chat.completions.create(
                    model=MODEL,
                    messages=messages,
                    stream=True,
                    stream_options={"include_usage": True},
                )
            ]
    pieces = [
        c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content
    ]
    assert "".join(pieces) == TEXT
    assert len(pieces) > 1
    [call] = expected.choices[0].message.tool_calls or []
    opened = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or ()]
    assert opened[0].id == call.id
    assert opened[0].function
    assert opened[0].function.name == "lookup"
    arguments = "".join((d.function.arguments or "") for d in opened if d.function)
    assert arguments == call.function.arguments  # type: ignore[union-attr]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert chunks[-1].choices == []
    assert chunks[-1].usage == expected.usage


async def test_messages_stream_assembles_into_the_non_streamed_message() -> None:
    blocks = [
        anthropic_thinking("checking"),
        anthropic_redacted_thinking(),
        anthropic_text(TEXT),
        anthropic_tool_use("lookup", {"q": "A1", "n": [1, 2.5, None]}),
    ]
    with FakeAnthropicServer(**SEEDED) as plain, FakeAnthropicServer(**SEEDED) as streamed:
        plain.script_response(*blocks)
        streamed.script_response(*blocks)
        async with anthropic_sdk(plain) as one, anthropic_sdk(streamed) as two:
            messages: Any = [{"role": "user", "content": "x"}]
            expected = await one.messages.create(model=MODEL, max_tokens=100, messages=messages)
            async with two.messages.stream(
                model=MODEL, max_tokens=100, messages=messages
            ) as stream:
                texts = [text async for text in stream.text_stream]
                final = await stream.get_final_message()
    assert "".join(texts) == TEXT
    assert len(texts) > 1
    assert [b.to_dict() for b in final.content] == [b.to_dict() for b in expected.content]
    assert (final.stop_reason, final.usage) == (expected.stop_reason, expected.usage)


async def test_gemini_stream_carries_the_non_streamed_parts() -> None:
    parts = [gemini_thought("checking"), gemini_text(TEXT, signed=True), gemini_function_call("f")]
    with FakeGeminiServer(**SEEDED) as plain, FakeGeminiServer(**SEEDED) as streamed:
        plain.script_response(*parts)
        streamed.script_response(*parts)
        one, two = gemini_sdk(plain.base_url), gemini_sdk(streamed.base_url)
        try:
            expected = await one.aio.models.generate_content(model=MODEL, contents="x")
            chunks = [
                chunk
                async for chunk in await two.aio.models.generate_content_stream(
                    model=MODEL, contents="x"
                )
            ]
        finally:
            await close_gemini(one)
            await close_gemini(two)
    streamed_parts = [
        p
        for c in chunks
        for p in c.candidates[0].content.parts or []  # type: ignore[index, union-attr]
    ]
    answer = "".join(p.text or "" for p in streamed_parts if not p.thought)
    assert answer == TEXT
    assert len(chunks) > 3
    signatures = [p.thought_signature for p in streamed_parts if p.thought_signature]
    expected_parts = expected.candidates[0].content.parts or []  # type: ignore[index, union-attr]
    assert signatures == [p.thought_signature for p in expected_parts if p.thought_signature]
    assert chunks[-1].candidates[0].finish_reason == types.FinishReason.STOP  # type: ignore[index]
    assert chunks[-1].usage_metadata == expected.usage_metadata
    assert streamed.requests[0].path.endswith(":streamGenerateContent")


# knobs ------------------------------------------------------------------------------


async def test_event_delay_spaces_the_events(
    openai_server: FakeOpenAIServer, openai_client: openai.AsyncOpenAI
) -> None:
    openai_server.script_response(openai_text(TEXT), stream=StreamKnobs(event_delay=0.02))
    started = time.monotonic()
    stream = await openai_client.responses.create(model=MODEL, input="x", stream=True)
    arrivals = [time.monotonic() async for _ in stream]
    assert len(arrivals) > 6
    # The server waits 0.02 s before each event after the first, so the last one cannot
    # arrive sooner than this after the request, however the client's reads bunch them
    # (gaps between arrivals can be shorter than the delay on a loaded machine).
    assert arrivals[-1] - started >= (len(arrivals) - 1) * 0.02
    record = openai_server.wait_stream_end(0)
    assert (record.outcome, record.events) == ("completed", len(arrivals))


async def test_the_server_knobs_apply_to_every_unscripted_stream() -> None:
    with FakeOpenAIServer(stream_knobs=StreamKnobs(end_after=2)) as srv:
        srv.script_response(openai_text(TEXT))
        async with openai_sdk(srv) as client:
            stream = await client.responses.create(model=MODEL, input="x", stream=True)
            assert len([event async for event in stream]) == 2
        record = srv.wait_stream_end(0)
    assert (record.outcome, record.events) == ("ended", 2)


@pytest.mark.parametrize("after", [0, 3])
async def test_cut_after_breaks_the_body(
    openai_server: FakeOpenAIServer, openai_client: openai.AsyncOpenAI, after: int
) -> None:
    openai_server.script_response(openai_text(TEXT), stream=StreamKnobs(cut_after=after))
    stream = await openai_client.responses.create(model=MODEL, input="x", stream=True)
    received = [0]

    async def read() -> None:
        async for _ in stream:
            received[0] += 1

    with pytest.raises(openai.APIConnectionError):
        await read()
    assert received == [after]
    record = openai_server.wait_stream_end(0)  # the server thread records it after the cut
    assert (record.outcome, record.events) == ("cut", after)


async def test_cut_after_breaks_an_anthropic_body(
    anthropic_server: FakeAnthropicServer, anthropic_client: anthropic.AsyncAnthropic
) -> None:
    anthropic_server.script_response(anthropic_text(TEXT), stream=StreamKnobs(cut_after=2))
    with pytest.raises(anthropic.APIConnectionError):
        async with anthropic_client.messages.stream(
            model=MODEL, max_tokens=10, messages=[{"role": "user", "content": "x"}]
        ) as stream:
            await stream.get_final_message()


async def test_fail_after_sends_the_vendors_error_event(
    anthropic_server: FakeAnthropicServer, anthropic_client: anthropic.AsyncAnthropic
) -> None:
    anthropic_server.script_response(anthropic_text(TEXT), stream=StreamKnobs(fail_after=3))
    with pytest.raises(anthropic.APIStatusError) as raised:
        async with anthropic_client.messages.stream(
            model=MODEL, max_tokens=10, messages=[{"role": "user", "content": "x"}]
        ) as stream:
            await stream.get_final_message()
    assert raised.value.type == "overloaded_error"
    record = anthropic_server.wait_stream_end(0)  # the server thread records it after the error
    assert (record.outcome, record.events) == ("failed", 4)


async def test_inserted_events_are_sent_where_asked(
    openai_server: FakeOpenAIServer, openai_client: openai.AsyncOpenAI
) -> None:
    future = {"type": "response.future_event"}
    openai_server.script_response(
        openai_text(TEXT), stream=StreamKnobs(insert=((1, "response.future_event", future),))
    )
    stream = await openai_client.responses.create(model=MODEL, input="x", stream=True)
    kinds = [event.type async for event in stream]
    assert kinds[:3] == ["response.created", "response.future_event", "response.in_progress"]


async def test_the_fake_sees_the_client_close_a_stream_within_100_ms(
    openai_server: FakeOpenAIServer, openai_client: openai.AsyncOpenAI
) -> None:
    openai_server.script_response(openai_text(TEXT * 5), stream=StreamKnobs(event_delay=0.2))
    stream = await openai_client.responses.create(model=MODEL, input="x", stream=True)
    await stream.__anext__()
    closed = time.monotonic()
    await stream.close()
    record = openai_server.wait_stream_end(timeout=2)
    assert (record.outcome, record.events) == ("client_closed", 1)
    assert record.closed_at is not None
    assert 0 <= record.closed_at - closed < 0.1


async def test_a_seeded_fake_issues_the_same_ids_and_signatures() -> None:
    answers = []
    for _ in range(2):
        with FakeOpenAIServer(**SEEDED) as srv:
            srv.script_response(*_openai_items())
            async with openai_sdk(srv) as client:
                response = await client.responses.create(
                    model=MODEL, input="x", store=False, include=["reasoning.encrypted_content"]
                )
                answers.append([item.to_dict() for item in response.output])
    assert answers[0] == answers[1]
    assert "encrypted_content" in answers[0][0]

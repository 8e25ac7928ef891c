"""ToubaContextPlugin's token guard and the events it records (counts, never content)."""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable, Sequence

import pytest
from google import genai
from google.genai import types
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tests.integrations.adk_plugin._build import (
    callback_context,
    calls,
    model,
    request,
    results,
    user,
)
from touba.errors import ProviderContextCountUnavailable, ProviderContextWindowExceeded
from touba.history import HistoryEvent
from touba.integrations.adk import ToubaContextPlugin
from touba.testing.fakes import FakeGeminiServer

SECRET = "SECRET-ORDER-4242"


def turns(n: int, pad: int = 200) -> list[types.Content]:
    """``n`` earlier turns (input, a tool exchange, a reply), then the newest input."""
    out: list[types.Content] = []
    for t in range(n):
        out += [user(f"q{t} {SECRET}"), calls(f"t{t}"), results(f"t{t}", pad=pad), model(f"a{t}")]
    return [*out, user(f"now {SECRET}")]


def by_bytes(seen: list[int]) -> Callable[[list[types.Content]], Awaitable[int]]:
    async def count(contents: list[types.Content]) -> int:
        seen.append(len(contents))
        return sum(len(c.model_dump_json(exclude_none=True)) for c in contents) // 4

    return count


async def run(plugin: ToubaContextPlugin, contents: Sequence[types.Content]) -> list[types.Content]:
    llm_request = request(contents)
    await plugin.before_model_callback(
        callback_context=await callback_context(), llm_request=llm_request
    )
    return llm_request.contents


async def test_a_request_that_fits_is_counted_once() -> None:
    seen: list[int] = []
    plugin = ToubaContextPlugin(max_tokens=10**6, count_tokens=by_bytes(seen))
    contents = turns(5)
    assert await run(plugin, contents) == contents
    assert seen == [len(contents)]


@pytest.mark.parametrize("n", [1, 2, 5, 17])
@pytest.mark.parametrize("budget", [150, 400, 700, 2000])
async def test_the_guard_drops_the_fewest_oldest_turns_in_few_counts(n: int, budget: int) -> None:
    contents = turns(n)
    counter_seen: list[int] = []
    count = by_bytes(counter_seen)
    # Brute force: the fewest earlier turns dropped (oldest first) for the count to fit.
    expected = None
    for drop in range(n + 1):
        candidate = contents[4 * drop :]
        if await count(list(candidate)) <= budget:
            expected = candidate
            break
    counter_seen.clear()
    plugin = ToubaContextPlugin(max_tokens=budget, count_tokens=count)
    if expected is None:
        with pytest.raises(ProviderContextWindowExceeded):
            await run(plugin, contents)
        return
    assert await run(plugin, contents) == expected
    assert len(counter_seen) <= 2 + math.ceil(math.log2(n + 1))


async def test_the_current_turn_loses_older_exchanges_but_keeps_its_input_and_last() -> None:
    contents = [
        user("q"),
        *(c for k in range(6) for c in (calls(f"t{k}"), results(f"t{k}", pad=300))),
    ]
    seen: list[int] = []
    plugin = ToubaContextPlugin(max_tokens=300, count_tokens=by_bytes(seen))
    window = await run(plugin, contents)
    assert window[0] is contents[0]
    assert window[-1] is contents[-1]
    assert 3 <= len(window) < len(contents)
    assert window[1:] == contents[len(contents) - len(window) + 1 :]


async def test_a_failing_or_wrong_counter_is_refused_typed() -> None:
    async def broken(contents: list[types.Content]) -> int:
        raise OSError("connection reset")

    plugin = ToubaContextPlugin(max_tokens=100, count_tokens=broken)
    with pytest.raises(ProviderContextCountUnavailable) as caught:
        await run(plugin, turns(1))
    assert isinstance(caught.value.__cause__, OSError)
    for wrong in (None, -1, True, "12", 1.5):

        async def bad(contents: list[types.Content], wrong: object = wrong) -> int:
            return wrong  # type: ignore[return-value]

        with pytest.raises(ProviderContextCountUnavailable):
            await run(ToubaContextPlugin(max_tokens=100, count_tokens=bad), turns(1))


async def test_google_genai_count_tokens_through_the_fake_gemini_server() -> None:
    with FakeGeminiServer() as srv:
        client = genai.Client(api_key="test", http_options=types.HttpOptions(base_url=srv.base_url))

        async def count(contents: list[types.Content]) -> int:
            answer = await client.aio.models.count_tokens(
                model="gemini-2.5-flash", contents=list(contents)
            )
            return answer.total_tokens or 0

        contents = turns(8)
        whole = await count(contents)
        plugin = ToubaContextPlugin(max_tokens=whole // 3, count_tokens=count)
        window = await run(plugin, contents)
        assert await count(window) <= whole // 3
        dropped = (len(contents) - len(window)) // 4
        assert dropped >= 1
        one_more_turn = contents[4 * (dropped - 1) :]
        assert await count(one_more_turn) > whole // 3  # no more was dropped than needed
        counts = srv.requests_to("count_tokens")
        assert counts
        assert all(r.status == 200 for r in counts)
        await client.aio.aclose()


async def test_events_give_counts_only() -> None:
    events: list[HistoryEvent] = []
    plugin = ToubaContextPlugin(max_messages=8, on_event=events.append)
    contents = turns(5)
    window = await run(plugin, contents)
    assert len(window) == 9
    trimmed, shown = events
    assert trimmed.kind == "history_trimmed"
    assert shown.kind == "history_window"
    assert (shown.message_count, trimmed.message_count) == (8, 8)
    sent_bytes = sum(len(c.model_dump_json(exclude_none=True, by_alias=True)) for c in window[:-1])
    assert shown.bytes == sent_bytes
    assert trimmed.removed_messages == len(contents) - len(window) == 12
    assert trimmed.removed_exchanges == 3 * 3  # input, exchange and reply of three turns
    every = " ".join(str(e.to_dict()) for e in events)
    assert SECRET not in every
    assert "q0" not in every
    assert "'u'" not in every
    assert "app" not in every
    assert trimmed.session_key == ToubaContextPlugin.session_key("app", "u", "s")
    events.clear()
    await run(plugin, contents[-5:])
    assert [e.kind for e in events] == ["history_window"]  # nothing left out


async def test_token_counts_are_events_too() -> None:
    events: list[HistoryEvent] = []
    seen: list[int] = []
    plugin = ToubaContextPlugin(max_tokens=400, count_tokens=by_bytes(seen), on_event=events.append)
    await run(plugin, turns(6))
    counts = [e for e in events if e.kind == "provider_context_count"]
    assert len(counts) == len(seen) >= 2
    assert counts[0].fits is False
    assert counts[-1].window == 400
    assert any(e.fits for e in counts)


async def test_an_async_or_failing_callback(caplog: pytest.LogCaptureFixture) -> None:
    got: list[str] = []

    async def record(event: HistoryEvent) -> None:
        got.append(event.kind)

    await run(ToubaContextPlugin(on_event=record), turns(1))
    assert got == ["history_window"]

    def broken(event: HistoryEvent) -> None:
        raise RuntimeError(SECRET)

    with caplog.at_level(logging.WARNING, logger="touba.integrations.adk"):
        window = await run(ToubaContextPlugin(on_event=broken), turns(1))
    assert len(window) == 5
    assert "RuntimeError" in caplog.text
    assert SECRET not in caplog.text


async def test_span_events_on_the_current_span_without_content() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with provider.get_tracer("test").start_as_current_span("call_llm"):
        await run(ToubaContextPlugin(max_messages=4), turns(3))
    (span,) = exporter.get_finished_spans()
    names = [e.name for e in span.events]
    assert names == ["touba.history_trimmed", "touba.history_window"]
    window = span.events[1].attributes or {}
    assert window["touba.message_count"] == 4
    assert SECRET not in str([dict(e.attributes or {}) for e in span.events])
    provider.shutdown()


async def test_a_tool_loop_is_settled_in_two_counts_from_the_previous_cut() -> None:
    seen: list[int] = []
    count = by_bytes(seen)
    plugin = ToubaContextPlugin(max_tokens=400, count_tokens=count)
    context = await callback_context()
    contents = [user("q")]
    costs = []
    for k in range(14):  # the loop grows by one exchange per model call
        contents += [calls(f"t{k}"), results(f"t{k}", pad=300)]
        expected = None
        for drop in range(k + 1):  # brute force: fewest older exchanges dropped
            candidate = [contents[0], *contents[1 + 2 * drop :]]
            if await count(candidate) <= 400:
                expected = candidate
                break
        seen.clear()
        llm_request = request(contents)
        await plugin.before_model_callback(callback_context=context, llm_request=llm_request)
        assert llm_request.contents == expected
        costs.append(len(seen))
    cutting = [c for c, k in zip(costs, range(14), strict=True) if k >= 4]
    assert max(cutting[1:]) <= 2, costs
    # A wrong guess (another conversation under the same session) is only a guess.
    small = [user("q"), calls("x"), results("x")]
    seen.clear()
    llm_request = request(small)
    await plugin.before_model_callback(callback_context=context, llm_request=llm_request)
    assert llm_request.contents == small

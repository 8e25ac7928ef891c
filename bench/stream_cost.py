"""What streaming through touba costs over iterating the SDK's own stream.

Every vendor streams from its loopback fake (instant, kept-alive connections,
validators off) through its official SDK, side by side in one process:

- ``ttft``: time to the first text piece, median of ``--rounds`` runs: the
  SDK's own stream (to its first event, and to its first text event) against
  ``Runtime.stream`` (to the first ``TextDelta``: the invocation, the history
  step and the provider's assembly included);
- ``per delta``: a reply of 1,000 text pieces read to its end, SDK stream
  against ``Runtime.stream``, the difference divided by 1,000;
- ``concurrent``: 200 ``Runtime.stream`` at once on one vendor, their events
  spaced by the fake: memory per open stream (tracemalloc, KiB) and whether a
  consumer that does not read for a while holds the others back.

Benchmarks are not tests: nothing here asserts a time.

    .venv/bin/python bench/stream_cost.py [--rounds 200] [--vendors openai,anthropic,...]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
import tracemalloc
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import openai
from google import genai
from google.genai import types

if __package__ in (None, ""):  # run as a script: bench/ is a package of the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from touba import TextDelta
from touba.providers import DecisionProvider
from touba.providers.anthropic import create_anthropic_decision_provider
from touba.providers.compatible import create_openai_compatible_decision_provider
from touba.providers.gemini import create_gemini_decision_provider
from touba.providers.openai import create_openai_decision_provider
from touba.runtime import Program, Runtime
from touba.testing.fakes import (
    FakeAnthropicServer,
    FakeGeminiServer,
    FakeOpenAIServer,
    FakeProviderServer,
    StreamKnobs,
    anthropic_text,
    gemini_text,
    openai_text,
)
from touba.testing.fakes._sse import PIECE

SHORT = "The order left the warehouse this morning."
LONG = "x" * (PIECE * 1_000)  # 1,000 text pieces
MESSAGES: Any = [{"role": "user", "content": "Where is my order?"}]


@dataclass
class Vendor:
    """One vendor: its fake, how to script a reply, its SDK stream and a provider."""

    name: str
    server: FakeProviderServer
    script: Callable[[str, StreamKnobs | None], None]
    sdk_stream: Callable[[], Awaitable[AsyncIterator[Any]]]
    is_text: Callable[[Any], bool]
    provider: DecisionProvider
    close: Callable[[], Awaitable[None]]


def _openai(name: str) -> Vendor:
    srv = FakeOpenAIServer(keep_alive=True, validate=False).start()
    client = openai.AsyncOpenAI(base_url=srv.base_url + "/v1", api_key="k", max_retries=0)
    if name == "openai":

        def script(text: str, knobs: StreamKnobs | None) -> None:
            srv.script_response(openai_text(text), stream=knobs)

        async def sdk() -> AsyncIterator[Any]:
            return await client.responses.create(model="m", input="x", stream=True)

        provider = create_openai_decision_provider(model="m", client=client)
        return Vendor(
            name,
            srv,
            script,
            sdk,
            lambda e: e.type == "response.output_text.delta",
            provider,
            client.close,
        )

    def chat(text: str, knobs: StreamKnobs | None) -> None:
        srv.script_chat_completion(text, stream=knobs)

    async def chat_sdk() -> AsyncIterator[Any]:
        return await client.chat.completions.create(
            model="m", messages=MESSAGES, stream=True, stream_options={"include_usage": True}
        )

    compatible = create_openai_compatible_decision_provider(
        model="m", base_url=srv.base_url + "/v1"
    )

    async def close() -> None:
        await client.close()
        await compatible.aclose()

    return Vendor(
        name,
        srv,
        chat,
        chat_sdk,
        lambda c: bool(c.choices and c.choices[0].delta.content),
        compatible,
        close,
    )


def _anthropic() -> Vendor:
    srv = FakeAnthropicServer(keep_alive=True, validate=False).start()
    client = anthropic.AsyncAnthropic(base_url=srv.base_url, api_key="k", max_retries=0)

    def script(text: str, knobs: StreamKnobs | None) -> None:
        srv.script_response(anthropic_text(text), stream=knobs)

    async def sdk() -> AsyncIterator[Any]:
        return await client.messages.create(
            model="m", max_tokens=100, messages=MESSAGES, stream=True
        )

    provider = create_anthropic_decision_provider(model="m", client=client)
    return Vendor(
        "anthropic",
        srv,
        script,
        sdk,
        lambda e: e.type == "content_block_delta",
        provider,
        client.close,
    )


def _gemini() -> Vendor:
    srv = FakeGeminiServer(keep_alive=True, validate=False).start()
    options = types.HttpOptions(
        base_url=srv.base_url, retry_options=types.HttpRetryOptions(attempts=1)
    )
    client = genai.Client(api_key="k", http_options=options)

    def script(text: str, knobs: StreamKnobs | None) -> None:
        srv.script_response(gemini_text(text), stream=knobs)

    async def sdk() -> AsyncIterator[Any]:
        return await client.aio.models.generate_content_stream(model="m", contents="x")

    async def close() -> None:
        await client.aio.aclose()
        client.close()

    provider = create_gemini_decision_provider(model="m", client=client)
    return Vendor("gemini", srv, script, sdk, lambda c: bool(c.text), provider, close)


def _runtime(provider: DecisionProvider) -> Runtime:
    program = Program()
    program.agent("support", provider=provider)
    return Runtime(program)


async def _sdk_times(vendor: Vendor) -> tuple[float, float]:
    """Seconds to the SDK stream's first event and to its first text event."""
    vendor.script(SHORT, None)
    started = time.perf_counter()
    first = text = 0.0
    async for event in await vendor.sdk_stream():
        now = time.perf_counter() - started
        first = first or now
        if not text and vendor.is_text(event):
            text = now
    return first, text


async def _touba_ttft(vendor: Vendor, runtime: Runtime) -> float:
    vendor.script(SHORT, None)
    started = time.perf_counter()
    found = 0.0
    async with runtime.stream("support", input="Where is my order?") as stream:
        async for event in stream:
            if not found and isinstance(event, TextDelta):
                found = time.perf_counter() - started
    return found


async def _read_long(vendor: Vendor, runtime: Runtime | None) -> float:
    vendor.script(LONG, None)
    started = time.perf_counter()
    if runtime is None:
        async for _ in await vendor.sdk_stream():
            pass
    else:
        async with runtime.stream("support", input="x") as stream:
            async for _ in stream:
                pass
    return time.perf_counter() - started


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:7.2f}"


async def bench_vendor(vendor: Vendor, rounds: int) -> None:
    runtime = _runtime(vendor.provider)
    for _ in range(5):  # warm the connections and the caches
        await _sdk_times(vendor)
        await _touba_ttft(vendor, runtime)
    sdk_first, sdk_text, touba = [], [], []
    for _ in range(rounds):
        first, text = await _sdk_times(vendor)
        sdk_first.append(first)
        sdk_text.append(text)
        touba.append(await _touba_ttft(vendor, runtime))
    long_rounds = max(5, rounds // 10)
    sdk_long = [await _read_long(vendor, None) for _ in range(long_rounds)]
    touba_long = [await _read_long(vendor, runtime) for _ in range(long_rounds)]
    median = statistics.median
    per_delta = (median(touba_long) - median(sdk_long)) / 1_000
    print(
        f"{vendor.name:<11} ttft ms: sdk first event {_ms(median(sdk_first))}, "
        f"sdk first text {_ms(median(sdk_text))}, touba TextDelta {_ms(median(touba))} "
        f"(+{_ms(median(touba) - median(sdk_first)).strip()} over the first event)   "
        f"per delta: {per_delta * 1e6:6.1f} us over the SDK stream"
    )


async def bench_concurrent(vendor: Vendor, streams: int) -> None:
    """``streams`` at once, one of them read slowly: memory per stream, no blocking."""
    runtime = _runtime(vendor.provider)
    pieces = "y" * (PIECE * 50)
    knobs = StreamKnobs(event_delay=0.005)
    for _ in range(streams):
        vendor.script(pieces, knobs)
    finished: dict[int, float] = {}
    reading: set[int] = set()
    sample: list[tuple[int, int]] = []

    async def consume(index: int) -> None:
        async with runtime.stream("support", input="x") as stream:
            async for _ in stream:
                reading.add(index)
                if index == 0 and len(finished) < streams - 1:
                    await asyncio.sleep(0.05)  # the slow consumer, until the others are done
        reading.discard(index)
        finished[index] = time.perf_counter()

    async def measure() -> None:  # every 50 ms; the sample with the most open streams counts
        while len(finished) < streams:
            await asyncio.sleep(0.05)
            sample.append((tracemalloc.get_traced_memory()[0], len(reading)))

    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    started = time.perf_counter()
    await asyncio.gather(measure(), *(consume(i) for i in range(streams)))
    tracemalloc.stop()
    others = [finished[i] - started for i in range(1, streams)]
    used, open_streams = max(sample, key=lambda s: s[1])
    kib = (used - base) / max(open_streams, 1) / 1024
    print(
        f"{vendor.name:<11} {streams} concurrent streams ({open_streams} open when measured): "
        f"{kib:6.1f} KiB per open stream; the others done in {max(others):5.2f} s, "
        f"the slow consumer in {finished[0] - started:5.2f} s"
    )


async def run(rounds: int, names: list[str]) -> None:
    makers = {
        "openai": lambda: _openai("openai"),
        "compatible": lambda: _openai("compatible"),
        "anthropic": _anthropic,
        "gemini": _gemini,
    }
    for name in names:
        vendor = makers[name]()
        try:
            await bench_vendor(vendor, rounds)
            if name == names[0]:
                await bench_concurrent(vendor, 200)
        finally:
            await vendor.close()
            vendor.server.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--vendors", default="openai,compatible,anthropic,gemini")
    args = parser.parse_args()
    asyncio.run(run(args.rounds, args.vendors.split(",")))


if __name__ == "__main__":
    main()

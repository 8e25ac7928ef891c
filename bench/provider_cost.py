"""Per-decision cost of the vendor providers: count requests and touba's own overhead.

Every provider runs against its loopback fake (which answers instantly)
through its official SDK, side by side in one process, on conversations
retaining 10, 100 and 1,000 exchanges (seeded into a MemoryHistoryStore, then
driven by real decisions until the window holds only real ones). The history
bounds keep the window at ``n = K + 1`` exchanges (``K + 8`` for the last
scenario) whatever the retained size; with the guard on, its token window is
calibrated on the fake's own count so that:

- ``fits``: everything fits (one count request per decision);
- ``sliding``: ``K`` exchanges fit, so each new exchange pushes the oldest one
  out of the guard window (the common case: two count requests);
- ``drop 8``: the history window holds 8 exchanges more than fit, so the guard
  drops 8 units per decision.

The compatible provider has no guard (``none``). Per row: count requests per
decision in a running conversation (the guard remembers its last cut) and
right after a restart (a new provider object: the cut is predicted from the
first count), against SPEC section 4's bound ``2 + ceil(log2(n))``; the median
wall time of a decision; the time spent inside the fake's request handler
(validation, token count, reply) and the wall time less it (``net``: touba
plus the SDK and loopback HTTP); ``own``, the wall time less the wire's SDK
calls (render, guard, history step, checks); and the ratios of ``net`` and
``own`` to the 10-exchange conversation. Benchmarks are not tests: nothing
here asserts a time; a request the fake rejects stops the run.

    .venv/bin/python bench/provider_cost.py [--rounds 30] [--providers openai,anthropic,...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anthropic
import openai
from google import genai
from google.genai import types

if __package__ in (None, ""):  # run as a script: bench/ is a package of the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.history_cost import pending_record
from touba.history import (
    CapabilityCall,
    ConversationIdentity,
    DecisionMessage,
    HistoryConfig,
    HistoryEvent,
    MemoryHistoryStore,
)
from touba.history._common import MiB
from touba.history._model import ResultMessage, message_to_dict
from touba.providers import (
    CapabilitySpec,
    ContextConfig,
    DecisionProvider,
    DecisionRequest,
    Observation,
)
from touba.providers._anthropic_post import send_message
from touba.providers.anthropic import AnthropicWire, create_anthropic_decision_provider
from touba.providers.compatible import create_openai_compatible_decision_provider
from touba.providers.gemini import GeminiWire, create_gemini_decision_provider
from touba.providers.openai import OpenAIWire, create_openai_decision_provider
from touba.testing.fakes import (
    FakeAnthropicServer,
    FakeGeminiServer,
    FakeOpenAIServer,
    FakeProviderServer,
    anthropic_tool_use,
    chat_tool_call,
    gemini_function_call,
    openai_function_call,
)
from touba.testing.fakes._server import Reply

SIZES = (10, 100, 1_000)
K = 6  # exchanges the guard window holds in the sliding scenarios
MANY = 8  # extra exchanges in the history window of the "drop 8" scenario
MAX_OUTPUT = 256
NAMESPACE = "bench"
LOOKUP = CapabilitySpec(
    "lookup_order",
    "Find an order",
    {"type": "object", "properties": {"order_id": {"type": "string"}}, "required": ["order_id"]},
)


# fakes that time their own handler ---------------------------------------------------


class _Timed(FakeProviderServer):
    """Adds the time spent in the request handler, and keeps the last request as sent."""

    handler_seconds: float = 0.0
    last: tuple[str, dict[str, str], bytes] | None = None

    def _handle(self, method: str, raw_path: str, headers: dict[str, str], raw: bytes) -> Reply:
        started = time.perf_counter()
        self.last = (raw_path, headers, raw)
        try:
            return super()._handle(method, raw_path, headers, raw)
        finally:
            self.handler_seconds += time.perf_counter() - started


class TimedOpenAI(_Timed, FakeOpenAIServer):
    pass


class TimedAnthropic(_Timed, FakeAnthropicServer):
    pass


class TimedGemini(_Timed, FakeGeminiServer):
    pass


# vendors -------------------------------------------------------------------------------

Factory = Callable[[HistoryConfig, ContextConfig | None], DecisionProvider]


@dataclass
class Vendor:
    """One provider: its fake, a factory, and how to script one call decision."""

    name: str
    server: _Timed
    factory: Factory
    script: Callable[[int], None]
    close: Callable[[], Awaitable[None]]
    guarded: bool = True

    @property
    def count_endpoint(self) -> str:
        return self.server.count_endpoint


def _call(step: int) -> tuple[str, dict[str, str]]:
    return f"b{step:06d}", {"order_id": f"B{step:06d}"}


async def _openai(server: TimedOpenAI) -> Vendor:
    client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="sk-b", max_retries=0)

    def factory(history: HistoryConfig, context: ContextConfig | None) -> DecisionProvider:
        return create_openai_decision_provider(
            model="gpt-bench",
            history=history,
            context=context,
            max_output_tokens=MAX_OUTPUT,
            client=client,
        )

    def script(step: int) -> None:
        call_id, arguments = _call(step)
        server.script_response(openai_function_call("lookup_order", arguments, call_id=call_id))

    return Vendor("openai", server, factory, script, client.close)


async def _anthropic(server: TimedAnthropic) -> Vendor:
    client = anthropic.AsyncAnthropic(base_url=server.base_url, api_key="sk-b", max_retries=0)

    def factory(history: HistoryConfig, context: ContextConfig | None) -> DecisionProvider:
        return create_anthropic_decision_provider(
            model="claude-bench",
            history=history,
            context=context,
            max_output_tokens=MAX_OUTPUT,
            client=client,
        )

    def script(step: int) -> None:
        server.script_response(anthropic_tool_use("lookup_order", _call(step)[1]))

    return Vendor("anthropic", server, factory, script, client.close)


async def _gemini(server: TimedGemini) -> Vendor:
    client = genai.Client(
        api_key="bench-key",
        http_options=types.HttpOptions(
            base_url=server.base_url, retry_options=types.HttpRetryOptions(attempts=1)
        ),
    )

    def factory(history: HistoryConfig, context: ContextConfig | None) -> DecisionProvider:
        return create_gemini_decision_provider(
            model="gemini-bench",
            history=history,
            context=context,
            max_output_tokens=MAX_OUTPUT,
            client=client,
        )

    def script(step: int) -> None:
        server.script_response(gemini_function_call("lookup_order", _call(step)[1]))

    async def close() -> None:
        await client.aio.aclose()
        client.close()

    return Vendor("gemini", server, factory, script, close)


async def _compatible(server: TimedOpenAI) -> Vendor:
    providers: list[DecisionProvider] = []

    def factory(history: HistoryConfig, context: ContextConfig | None) -> DecisionProvider:
        provider = create_openai_compatible_decision_provider(
            model="local-bench",
            base_url=server.base_url + "/v1",
            history=history,
            max_output_tokens=MAX_OUTPUT,
        )
        providers.append(provider)
        return provider

    def script(step: int) -> None:
        call_id, arguments = _call(step)
        server.script_chat_completion(
            tool_calls=[chat_tool_call("lookup_order", arguments, id=call_id)]
        )

    async def close() -> None:
        for provider in providers:
            await provider.aclose()

    return Vendor("compatible", server, factory, script, close, guarded=False)


# conversations -------------------------------------------------------------------------


def _seed_record(identity: ConversationIdentity, exchanges: int) -> dict[str, Any]:
    """``exchanges`` complete exchanges (neutral: no provider data), then one pending call."""
    rows = []
    for n in range(exchanges):
        call = CapabilityCall(f"call-{n:06d}", "lookup_order", {"order_id": f"A{n:06d}"})
        result = ResultMessage(call.call_id, call.name, call.arguments, "ok", {"n": f"{n:06d}"})
        rows.append([message_to_dict(DecisionMessage(calls=(call,))), message_to_dict(result)])
    return pending_record(identity, rows)


@dataclass
class Conversation:
    """One conversation of one provider, decided again and again."""

    vendor: Vendor
    scenario: str
    size: int
    window: int  # exchanges in the history window (before the guard)
    history: HistoryConfig
    context: ContextConfig | None
    provider: DecisionProvider
    invocation: str
    pending: CapabilityCall = field(
        default_factory=lambda: CapabilityCall("pending", "lookup_order", {"order_id": "P"})
    )
    step: int = 0
    counts: list[int] = field(default_factory=list)
    cold: list[int] = field(default_factory=list)  # counts right after a restart
    wall: list[float] = field(default_factory=list)
    fake: list[float] = field(default_factory=list)
    io: list[float] = field(default_factory=list)
    events: list[HistoryEvent] = field(default_factory=list)
    io_seconds: float = 0.0

    def __post_init__(self) -> None:
        self.instrument()

    def restart(self) -> None:
        """A new provider object over the same store, as a new process would build."""
        self.provider = self.vendor.factory(self.history, self.context)
        self.instrument()

    def instrument(self) -> None:
        """Time the wire's count and generate calls (SDK, loopback HTTP, fake, parse)."""
        wire = self.provider._wire
        for name in ("count", "generate"):
            method = getattr(wire, name)

            async def timed(body: dict[str, Any], _method: Any = method) -> Any:
                started = time.perf_counter()
                try:
                    return await _method(body)
                finally:
                    self.io_seconds += time.perf_counter() - started

            setattr(wire, name, timed)

    async def decide(self, record: bool = True, cold: bool = False) -> float:
        """One decision; its wall time (the provider's ``decide`` only, not the scripting)."""
        server = self.vendor.server
        observation = Observation(
            self.pending.call_id,
            self.pending.name,
            self.pending.arguments,
            "ok",
            {"n": f"{self.step:06d}"},
        )
        self.step += 1
        self.vendor.script(self.step)
        before_count = len(server.requests_to(self.vendor.count_endpoint))
        before_fake, before_io = server.handler_seconds, self.io_seconds
        started = time.perf_counter()
        decision = await self.provider.decide(
            DecisionRequest(
                run_id="run",
                invocation_id=self.invocation,
                agent_ref="agent",
                instructions="Answer questions about orders.",
                input="Where are my orders?",
                capabilities=(LOOKUP,),
                observations=(observation,),
            )
        )
        elapsed = time.perf_counter() - started
        (self.pending,) = decision.calls
        if cold:
            self.cold.append(len(server.requests_to(self.vendor.count_endpoint)) - before_count)
        elif record:
            self.wall.append(elapsed)
            self.fake.append(server.handler_seconds - before_fake)
            self.io.append(self.io_seconds - before_io)
            self.counts.append(len(server.requests_to(self.vendor.count_endpoint)) - before_count)
        return elapsed


async def _seed(store: MemoryHistoryStore, identity: ConversationIdentity, exchanges: int) -> None:
    record = _seed_record(identity, exchanges)

    async def put(_: dict[str, Any] | None) -> tuple[dict[str, Any], None]:
        return record, None

    await store.transact(identity.key, put)


def _identity(provider: DecisionProvider, invocation: str) -> ConversationIdentity:
    return ConversationIdentity(
        NAMESPACE, provider.provider, provider.model, "native", "run", invocation, "agent"
    )


async def _conversation(
    vendor: Vendor,
    store: MemoryHistoryStore,
    scenario: str,
    size: int,
    window: int,
    context: ContextConfig | None,
) -> Conversation:
    events: list[HistoryEvent] = []
    history = HistoryConfig(
        store=store,
        namespace=NAMESPACE,
        max_messages=2 * window,
        max_bytes=4 * MiB,
        max_retained_bytes=256 * MiB,
        on_event=events.append,
    )
    provider = vendor.factory(history, context)
    invocation = f"{scenario}-{size}"
    await _seed(store, _identity(provider, invocation), size)
    conversation = Conversation(
        vendor, scenario, size, window, history, context, provider, invocation
    )
    conversation.events = events
    return conversation


async def _calibrate(vendor: Vendor, store: MemoryHistoryStore) -> ContextConfig:
    """A token window holding ``K`` exchanges of real decisions, but not ``K + 1``."""
    huge = ContextConfig(10**9, input_token_multiplier=1, safety_margin_tokens=0)
    probe = await _conversation(vendor, store, "probe", 20, K + 1, huge)
    for _ in range(K + 3):  # a window of real decisions only
        await probe.decide(record=False)
    over = _last_count(probe.events)
    probe.provider = vendor.factory(
        HistoryConfig(
            store=store,
            namespace=NAMESPACE,
            max_messages=2 * K,
            max_retained_bytes=256 * MiB,
            on_event=probe.events.append,
        ),
        huge,
    )
    await probe.decide(record=False)
    fitting = _last_count(probe.events)
    middle = (fitting + over) // 2
    return ContextConfig(middle + MAX_OUTPUT, input_token_multiplier=1, safety_margin_tokens=0)


def _last_count(events: list[HistoryEvent]) -> int:
    count = [e.count for e in events if e.kind == "provider_context_count"][-1]
    assert count is not None
    return count


# running -------------------------------------------------------------------------------


async def _vendors(names: list[str]) -> list[Vendor]:
    makers: Mapping[str, Callable[[], Awaitable[Vendor]]] = {
        "openai": lambda: _openai(TimedOpenAI(keep_alive=True).start()),
        "anthropic": lambda: _anthropic(TimedAnthropic(keep_alive=True).start()),
        "gemini": lambda: _gemini(TimedGemini(keep_alive=True).start()),
        "compatible": lambda: _compatible(TimedOpenAI(keep_alive=True).start()),
    }
    unknown = set(names) - set(makers)
    if unknown:
        raise SystemExit(f"unknown provider(s): {', '.join(sorted(unknown))}")
    return [await makers[name]() for name in names]


async def _run(names: list[str], rounds: int, report: Callable[[str], None]) -> None:
    vendors = await _vendors(names)
    conversations: list[Conversation] = []
    try:
        for vendor in vendors:
            store = MemoryHistoryStore(max_sessions=64, max_store_bytes=1024 * MiB)
            plans: list[tuple[str, int, ContextConfig | None]]
            if vendor.guarded:
                tight = await _calibrate(vendor, store)
                roomy = ContextConfig(10**9, input_token_multiplier=1, safety_margin_tokens=0)
                plans = [
                    ("fits", K + 1, roomy),
                    ("sliding", K + 1, tight),
                    ("drop 8", K + MANY, tight),
                ]
            else:
                plans = [("none", K + 1, None)]
            conversations.extend(
                [
                    await _conversation(vendor, store, scenario, size, window, context)
                    for scenario, window, context in plans
                    for size in SIZES
                ]
            )
        for conversation in conversations:  # warm up: the window holds real decisions only
            for _ in range(K + MANY + 2):
                await conversation.decide(record=False)
        for _ in range(rounds):  # side by side, interleaved
            for conversation in conversations:
                await conversation.decide()
        for conversation in conversations:  # no remembered cut: the first count predicts it
            for _ in range(3):
                conversation.restart()
                await conversation.decide(cold=True)
        for vendor in vendors:
            rejected = [r for r in vendor.server.requests if r.status != 200]
            if rejected:
                raise SystemExit(f"{vendor.name}: the fake rejected {len(rejected)} request(s)")
    finally:
        for vendor in vendors:
            await vendor.close()
            vendor.server.close()
    _table(conversations, rounds, report)


def _table(conversations: list[Conversation], rounds: int, report: Callable[[str], None]) -> None:
    report(
        f"\n{rounds} decisions per row, K={K}, n = exchanges in the window before the guard.\n"
        "Count requests per decision: median and worst in a running conversation, worst of 3 "
        "decisions right after a restart (cold: no remembered cut), bound 2 + ceil(log2 n).\n"
        "Median ms per decision: wall; fake = inside the fake's handler; net = wall - fake; "
        "own = wall - the wire's SDK calls (render, guard, history step, checks).\n"
        "Ratios: to the same provider and guard at 10 retained exchanges."
    )
    header = (
        f"{'provider':<11}{'guard':<8}{'retained':>9}{'n':>4}{'counts':>7}{'worst':>6}"
        f"{'cold':>5}{'bound':>6}{'wall':>8}{'fake':>6}{'net':>8}{'ratio':>6}{'own':>6}"
        f"{'ratio':>6}"
    )
    report(header)
    report("-" * len(header))
    base: dict[tuple[str, str], tuple[float, float]] = {}
    for c in conversations:
        net = statistics.median(w - f for w, f in zip(c.wall, c.fake, strict=True))
        own = statistics.median(w - i for w, i in zip(c.wall, c.io, strict=True))
        net_base, own_base = base.setdefault((c.vendor.name, c.scenario), (net, own))
        bound = 2 + math.ceil(math.log2(c.window))
        worst, cold = max(c.counts), max(c.cold)
        report(
            f"{c.vendor.name:<11}{c.scenario:<8}{c.size:>9,}{c.window:>4}"
            f"{statistics.median(c.counts):>7.0f}{worst:>6}{cold:>5}{bound:>6}"
            f"{statistics.median(c.wall) * 1e3:>8.2f}{statistics.median(c.fake) * 1e3:>6.2f}"
            f"{net * 1e3:>8.2f}{net / net_base:>6.2f}{own * 1e3:>6.2f}{own / own_base:>6.2f}"
            + (" over the bound!" if max(worst, cold) > bound else "")
        )


# touba against a raw HTTP post of the same body -------------------------------------------

RAW_WINDOW = 20  # exchanges in the window: the 20-exchange body


async def _raw_run(names: list[str], rounds: int, report: Callable[[str], None]) -> None:
    """Per provider: a touba decision (no guard) against a raw post of the body it sent."""
    import httpx2

    vendors = await _vendors(names)
    http = httpx2.AsyncClient(timeout=30)
    Times = list[float]
    rows: list[tuple[str, Times, Times, Times, Times, Times, Times]] = []
    try:
        for vendor in vendors:
            store = MemoryHistoryStore(max_sessions=8, max_store_bytes=1024 * MiB)
            conversation = await _conversation(vendor, store, "raw", 100, RAW_WINDOW, None)
            for _ in range(RAW_WINDOW + 2):  # the window holds real decisions only
                await conversation.decide(record=False)
            server = vendor.server
            touba: list[float] = []
            touba_fake: list[float] = []
            wire: list[float] = []
            raw: list[float] = []
            raw_fake: list[float] = []
            sdk: list[float] = []
            for _ in range(rounds):
                before, io = server.handler_seconds, conversation.io_seconds
                touba.append(await conversation.decide(record=False))
                touba_fake.append(server.handler_seconds - before)
                wire.append(conversation.io_seconds - io)
                assert server.last is not None
                path, headers, body = server.last
                sent = {k: v for k, v in headers.items() if k not in ("host", "content-length")}
                vendor.script(conversation.step + 1_000_000)
                before = server.handler_seconds
                started = time.perf_counter()
                response = await http.post(server.base_url + path, content=body, headers=sent)
                json.loads(response.content)
                raw.append(time.perf_counter() - started)
                raw_fake.append(server.handler_seconds - before)
                if response.status_code != 200:
                    raise SystemExit(f"{vendor.name}: the raw post got {response.status_code}")
                vendor.script(conversation.step + 2_000_000)
                sendable = json.loads(body)  # untimed: the wire is handed a built body too
                started = time.perf_counter()
                json.loads(await _sdk_post(conversation.provider, sendable))
                sdk.append(time.perf_counter() - started)
            rows.append((vendor.name, touba, touba_fake, wire, raw, raw_fake, sdk))
    finally:
        await http.aclose()
        for vendor in vendors:
            await vendor.close()
            vendor.server.close()
    report(
        f"\ntouba against a raw HTTP post (httpx2, keep-alive) of the very bytes touba's SDK call "
        f"sent: no guard, a {RAW_WINDOW}-exchange window, history in RAM, {rounds} interleaved "
        "rounds, median ms.\nraw = the post and json.loads of the answer; sdk = the same body "
        "through the request the wire makes of the SDK client (its low-level post; Gemini's "
        "async_request) and json.loads, nothing of touba's; wire = touba's call of the vendor "
        "(that request and touba's parse of the answer); decide = the whole decision (history "
        "step, render, wire, checks). Ratios over raw; wire/sdk is touba's share of the wire."
    )
    header = (
        f"{'provider':<11}{'raw':>7}{'sdk':>7}{'sdk/raw':>8}{'wire':>7}{'wire/raw':>9}"
        f"{'wire/sdk':>9}{'decide':>8}{'decide/raw':>11}{'(fake)':>8}"
    )
    report(header)
    report("-" * len(header))
    for name, touba, touba_fake, wire, raw, raw_fake, sdk in rows:
        wall_t, wall_r = statistics.median(touba), statistics.median(raw)
        wire_t, sdk_t = statistics.median(wire), statistics.median(sdk)
        fake = statistics.median(raw_fake + touba_fake)
        report(
            f"{name:<11}{wall_r * 1e3:>7.2f}{sdk_t * 1e3:>7.2f}{sdk_t / wall_r:>8.2f}"
            f"{wire_t * 1e3:>7.2f}{wire_t / wall_r:>9.2f}{wire_t / sdk_t:>9.2f}"
            f"{wall_t * 1e3:>8.2f}{wall_t / wall_r:>11.2f}{fake * 1e3:>8.2f}"
        )


async def _sdk_post(provider: DecisionProvider, body: dict[str, Any]) -> bytes | str:
    """The SDK request touba's wire makes for a generation, with ``body``: the answer's text."""
    wire: Any = provider._wire
    if isinstance(wire, AnthropicWire):
        return await send_message(wire._client, body, {}, wire._request_options)
    if isinstance(wire, GeminiWire):
        response = await wire._api.async_request("post", f"{wire._resource}:generateContent", body)
        return str(response.body)
    if isinstance(wire, OpenAIWire):
        client, path, options = wire._generation_client, "/responses", wire._request_options
    else:
        client, path = wire._sdk_client(), "/chat/completions"
        options = wire._call_options
    text: str = await client.post(path, body=body, cast_to=str, options=options)
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--providers", default="openai,anthropic,gemini,compatible")
    parser.add_argument(
        "--only-raw", action="store_true", help="only the table against a raw HTTP post"
    )
    args = parser.parse_args()
    names = args.providers.split(",")
    if not args.only_raw:
        asyncio.run(_run(names, args.rounds, print))
    asyncio.run(_raw_run(names, max(args.rounds, 30), print))


if __name__ == "__main__":
    main()

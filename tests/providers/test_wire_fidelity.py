"""Wire fidelity, fuzzed: random scenarios through every provider, never a rejected request.

For each provider x decision_interface x continuity, hypothesis draws scenarios
of 1-8 decisions: each scripted model response mixes the vendor's opaque items
(OpenAI reasoning items with or without encrypted content, Anthropic thinking
and redacted_thinking blocks, also on a fake binding signatures to their
prefix, Gemini thoughts and thought signatures, reasoning_content of a
compatible server) with text and 0-4 parallel calls or a final answer; each
call's observation is ok (tiny to ~20 KB), error or denied, possibly with
projected arguments and in any order. History bounds are random (so the
window trims), a deterministic summariser and the context guard (with the
fake's token count) come and go, prior chat turns arrive with and without
tool traces, and between decisions the process "restarts": a new provider
object over the same store (SQLite reopened from its file), or history lost
(a fresh MemoryHistoryStore) with the pending observations sent as data.

Property, for every scenario:

- every request the fake received (generations and counts) was answered 2xx
  (every other decision is streamed, and replayed like the others):
  its validator, which refuses what the real API refuses, never objected.
  The one accepted exception is the limitation documented in
  ``touba.providers.anthropic``: with ``thinking.type == "enabled"`` on a
  prefix-binding model, a trim inside a tool loop must replay the stale
  continuation blocks and the API answers 400; the test checks that this is
  exactly what the rejected request shows;
- calls and results stay paired in every request; the current observations
  are sent as the results of their calls in the native interface, and as data
  (never as results of invented calls) once history was lost; stored
  exchanges pair too, and ``opaque_refs`` stores neither opaque data nor raw
  arguments;
- no scripted secret marker appears in any HistoryEvent (nor in the message
  of an expected refusal).

Expected refusals (``DecisionHistoryLimitExceeded``,
``ProviderContextWindowExceeded``, the limitation above) end a scenario;
any other exception fails it. Hypothesis prints the scenario, and ``note``s
what each decision did.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import json
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

import anthropic
import pytest
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st

from tests._providers import anthropic_sdk, close_gemini, gemini_sdk, openai_sdk
from touba.errors import (
    AgentDecisionProviderUnavailable,
    DecisionHistoryLimitExceeded,
    ProviderContextCountUnavailable,
    ProviderContextWindowExceeded,
)
from touba.history import (
    HistoryConfig,
    HistoryEvent,
    MemoryHistoryStore,
    SummaryRequest,
    conversation_key,
)
from touba.history.sqlite import SqliteHistoryStore
from touba.providers import (
    CapabilitySpec,
    ContextConfig,
    DecisionProvider,
    DecisionRequest,
    Observation,
    TraceCall,
    Turn,
)
from touba.providers._anthropic_wire import prefix_digest
from touba.providers._memo import ExchangeMemo
from touba.providers.anthropic import AnthropicWire, create_anthropic_decision_provider
from touba.providers.compatible import create_openai_compatible_decision_provider
from touba.providers.gemini import create_gemini_decision_provider
from touba.providers.openai import create_openai_decision_provider
from touba.testing.fakes import (
    FakeAnthropicServer,
    FakeGeminiServer,
    FakeOpenAIServer,
    RecordedRequest,
    anthropic_redacted_thinking,
    anthropic_text,
    anthropic_thinking,
    anthropic_tool_use,
    gemini_function_call,
    gemini_text,
    gemini_thought,
    openai_function_call,
    openai_reasoning,
    openai_text,
)
from touba.testing.fakes._anthropic_rules import check_messages

# Per provider x interface x continuity (16 combinations): the suite stays under a minute.
# TOUBA_FUZZ_EXAMPLES=500 runs a deeper search.
EXAMPLES = int(os.environ.get("TOUBA_FUZZ_EXAMPLES", "20"))
NAMESPACE = "fuzz"
RUN, INVOCATION, AGENT = "run-1", "inv-1", "agent"
INSTRUCTIONS = "Answer questions about orders with the capabilities."
INPUT = "Where is my order?"
CAPABILITIES = (
    CapabilitySpec(
        "lookup",
        "Look an order up",
        {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]},
    ),
    CapabilitySpec(
        "note",
        "Write a note",
        {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
    ),
)
ARGUMENT = {"lookup": "q", "note": "text"}
ENABLED = {"type": "enabled", "budget_tokens": 1024}
ADAPTIVE = {"type": "adaptive"}
PREFIX_MISMATCH = "bound to a different conversation"

_examples = itertools.count()

Interface = Literal["native", "structured"]
Continuity = Literal["inline", "opaque_refs"]
Status = Literal["ok", "error", "denied"]


# scenarios -----------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    """What the runtime did with one call."""

    status: Status
    size: int = 0  # filler bytes of an ok result
    projected: bool = False  # the runtime's projection differs from the model's arguments

    def __repr__(self) -> str:
        size = f"({self.size})" if self.status == "ok" else ""
        return f"{self.status}{size}{'/projected' if self.projected else ''}"


@dataclass(frozen=True)
class Step:
    """One decision: the scripted response, then what happens to its calls.

    ``layout`` lists the response's items in order, in the vendor's terms (see
    the ``script`` method of each vendor); ``calls == 0`` is a final answer.
    ``restart`` happens after the observations, before the next decision.
    """

    layout: tuple[str, ...]
    calls: int
    outcomes: tuple[Outcome, ...]
    reverse: bool
    restart: Literal["reopen", "lose"] | None


@dataclass(frozen=True)
class Guard:
    room: int  # input tokens the window leaves beyond max_output_tokens and the margin
    multiplier: float
    margin: int


@dataclass(frozen=True)
class PriorTurn:
    replies: int
    trace: tuple[tuple[Status, ...], ...]  # statuses of each decision's calls
    odd_ids: bool  # call ids Anthropic must map to its id alphabet


@dataclass(frozen=True)
class Scenario:
    steps: tuple[Step, ...]
    max_messages: int
    max_bytes: int
    summarize: bool
    guard: Guard | None
    prior: tuple[PriorTurn, ...]
    store: Literal["memory", "sqlite"]
    thinking: Literal["enabled", "adaptive"] | None = None  # Anthropic only
    preserved: bool = False  # Anthropic only: signatures bind their prefix


outcomes = st.builds(
    Outcome,
    status=st.sampled_from(["ok", "ok", "error", "denied"]),
    size=st.sampled_from([0, 40, 40, 400, 400, 1_500, 3_000, 20_000]),
    projected=st.booleans(),
)
prior_turns = st.builds(
    PriorTurn,
    replies=st.integers(0, 2),
    trace=st.lists(
        st.lists(st.sampled_from(["ok", "error", "denied"]), max_size=3).map(tuple),
        max_size=2,
    ).map(tuple),
    odd_ids=st.booleans(),
)


def _layout(
    draw: st.DrawFn,
    vendor: str,
    interface: Interface,
    calls: int,
    thinking: str | None,
) -> tuple[str, ...]:
    """The items of one scripted response, as the vendor's ``script`` reads them."""
    out: list[str] = []
    maybe = st.booleans()
    if vendor == "openai":
        reasoning = st.sampled_from([(), ("rs",), ("rs_unencrypted",)])
        if interface == "structured":
            return (*draw(reasoning), "json")
        if calls == 0 or draw(maybe):
            out += [*draw(reasoning), "text"]
        for _ in range(calls):
            out += [*draw(reasoning), "call"]
        return tuple(out)
    if vendor == "anthropic":
        # Thinking blocks come first (enabled: always); with thinking on, more may be
        # interleaved between tool uses.
        if thinking is not None:
            kinds = st.sampled_from(["thinking", "redacted"])
            out += draw(st.lists(kinds, min_size=int(thinking == "enabled"), max_size=2))
        lead = bool(out)
        if interface == "structured":
            return (*out, *(["text"] if draw(maybe) else []), "json")
        if calls == 0 or draw(maybe):
            out.append("text")
        for _ in range(calls):
            if lead and draw(maybe):
                out.append("thinking")
            out.append("call")
        return tuple(out)
    if vendor == "gemini":
        out += draw(st.lists(st.sampled_from(["thought", "thought_unsigned"]), max_size=2))
        if interface == "structured":
            return (*out, draw(st.sampled_from(["json", "json_signed"])))
        if calls == 0:
            return (*out, draw(st.sampled_from(["text", "text_signed"])))
        if draw(maybe):
            out.insert(0, "ids")
        if draw(maybe):
            out.append("text")
        first = draw(st.sampled_from(["call_signed", "call_signed", "call"]))
        return (*out, first, *["call"] * (calls - 1))
    # compatible
    if draw(maybe):
        out.append("reasoning_content")
    if interface == "structured":
        return (*out, "json")
    if calls == 0 or draw(maybe):
        out.append("text")
    return (*out, *(draw(st.sampled_from(["call", "call_without_id"])) for _ in range(calls)))


@st.composite
def scenarios(
    draw: st.DrawFn, vendor: str, interface: Interface, continuity: Continuity
) -> Scenario:
    thinking: Literal["enabled", "adaptive"] | None = None
    if vendor == "anthropic":
        # enabled + opaque_refs is refused at construction (a documented
        # ConfigurationError), so it is not drawn. With thinking on, the structured
        # interface offers its decision tool with tool_choice auto, never forced.
        allowed = [None, "adaptive"]
        if continuity == "inline":
            allowed.append("enabled")
        thinking = draw(st.sampled_from(allowed))
    count = draw(st.integers(1, 8))
    steps = []
    for index in range(count):
        last = index == count - 1
        calls = draw(st.sampled_from([1, 1, 2, 3, 4] if not last else [0, 0, 1, 2, 3, 4]))
        steps.append(
            Step(
                layout=_layout(draw, vendor, interface, calls, thinking),
                calls=calls,
                outcomes=tuple(draw(outcomes) for _ in range(calls)),
                reverse=draw(st.booleans()),
                restart=None if last else draw(st.sampled_from([None, None, "reopen", "lose"])),
            )
        )
    guard = None
    if vendor != "compatible":
        guard = draw(
            st.none()
            | st.builds(
                Guard,
                room=st.integers(500, 5_000),
                multiplier=st.sampled_from([1.0, 1.2]),
                margin=st.sampled_from([0, 64, 512]),
            )
        )
    return Scenario(
        steps=tuple(steps),
        max_messages=draw(st.integers(3, 16)),
        max_bytes=draw(st.sampled_from([262_144, 60_000, 30_000, 12_000, 5_000])),
        summarize=draw(st.booleans()),
        guard=guard,
        prior=tuple(draw(st.lists(prior_turns, max_size=3))),
        store=draw(st.sampled_from(["memory", "sqlite"])),
        thinking=thinking,
        preserved=vendor == "anthropic" and draw(st.booleans()),
    )


# what a scenario sends -----------------------------------------------------------


@dataclass
class Marks:
    """Per-example markers: a secret the model "writes", and unique ids."""

    example: int
    secret: str = field(init=False)

    def __post_init__(self) -> None:
        self.secret = f"S3CR3T{self.example:06d}"

    def call(self, step: int, index: int) -> tuple[str, dict[str, Any]]:
        name = CAPABILITIES[(step + index) % 2].name
        return name, {ARGUMENT[name]: f"{self.secret}/{step}/{index}"}

    def call_id(self, step: int, index: int) -> str:
        return f"c{self.example}_{step}_{index}"

    def structured(self, step: int, calls: int) -> dict[str, Any]:
        if calls == 0:
            return {"action": "final", "output": f"{self.secret} done"}
        made = [self.call(step, i) for i in range(calls)]
        return {"action": "call", "calls": [{"name": n, "arguments": a} for n, a in made]}

    def text(self, step: int, what: str) -> str:
        return f"{self.secret} {what} {step}"

    def token(self, step: int, index: int) -> str:
        """Carried by one observation, to find where it was sent."""
        return f"obs{self.example}x{step}x{index}"


def observation(marks: Marks, step: int, index: int, call: Any, outcome: Outcome) -> Observation:
    token = marks.token(step, index)
    arguments = dict(call.arguments)
    if outcome.projected:
        arguments = dict.fromkeys(arguments, f"projected-{token}")
    if outcome.status == "ok":
        result = {"token": token, "secret": marks.secret, "data": "x" * outcome.size}
        return Observation(call.call_id, call.name, arguments, "ok", result)
    return Observation(
        call.call_id, call.name, arguments, outcome.status, error=f"{outcome.status} {token}"
    )


def prior_turn(marks: Marks, number: int, spec: PriorTurn) -> Turn:
    trace = tuple(
        tuple(
            TraceCall(
                call_id=(f"tr:{number}/{g}.{i}" if spec.odd_ids else f"tr{number}_{g}_{i}")
                + f"_{marks.example}",
                name=CAPABILITIES[i % 2].name,
                arguments={ARGUMENT[CAPABILITIES[i % 2].name]: f"earlier {number}"},
                status=status,
                result={"earlier": number} if status == "ok" else None,
                error=None if status == "ok" else f"{status} earlier",
            )
            for i, status in enumerate(group)
        )
        for g, group in enumerate(spec.trace)
    )
    replies = tuple(f"reply {number}.{r}" for r in range(spec.replies))
    return Turn(user=f"earlier question {number}", replies=replies, trace=trace)


async def summarize(request: SummaryRequest) -> str:
    """Deterministic, bounded, and quoting the turns (so it may carry the secret)."""
    head = f"{len(request.turns)} exchanges, previous: {request.previous_summary is not None}. "
    return (head + json.dumps(request.turns, ensure_ascii=True))[: request.max_bytes]


# vendors -------------------------------------------------------------------------


class ResettableMixin:
    """One fake per test function, emptied between examples (queues and records).

    The fakes have no public reset: this empties their private reply queues
    and records under their own lock (a scenario ended by a refusal may leave
    a scripted reply behind). Their ledger (issued signatures) is kept, as a
    real API keeps honouring what it issued.
    """

    def reset(self: Any) -> None:
        with self._lock:
            for queue in self._queues.values():
                queue.clear()
            self._requests.clear()


class OpenAIServer(ResettableMixin, FakeOpenAIServer):
    pass


class AnthropicServer(ResettableMixin, FakeAnthropicServer):
    pass


class GeminiServer(ResettableMixin, FakeGeminiServer):
    pass


Resettable = OpenAIServer | AnthropicServer | GeminiServer


class Vendor:
    """How one provider is built against its fake, scripted, and read on the wire."""

    name: ClassVar[str]
    generation: ClassVar[str]
    max_output_tokens: ClassVar[int] = 256

    def server(self) -> Resettable:
        raise NotImplementedError

    async def open(self, srv: Any) -> Any:
        """The SDK client for this example (None: the provider builds its own)."""
        return None

    async def close(self, client: Any) -> None:
        """Close what ``open`` returned."""
        if client is not None:
            await client.close()

    def create(
        self,
        srv: Any,
        client: Any,
        interface: Interface,
        history: HistoryConfig,
        context: ContextConfig | None,
        scenario: Scenario,
    ) -> DecisionProvider:
        return self.build(
            client,
            decision_interface=interface,
            history=history,
            context=context,
            max_output_tokens=self.max_output_tokens,
            **self.options(scenario),
        )

    def build(self, client: Any, **options: Any) -> DecisionProvider:
        """This vendor's decision provider on ``client``, with the example's options."""
        raise NotImplementedError

    def options(self, scenario: Scenario) -> dict[str, Any]:
        """What a scenario adds to the provider's options (Anthropic: its thinking)."""
        return {}

    def script(self, srv: Any, marks: Marks, number: int, step: Step) -> None:
        raise NotImplementedError

    def problems(self, body: dict[str, Any]) -> list[str]:
        """What is wrong in a generation or count body beyond the fake's validator:
        calls and results not paired one for one, empty messages."""
        raise NotImplementedError

    def results(self, body: dict[str, Any]) -> list[str]:
        """The serialised result elements (what answers a call) of a generation body."""
        raise NotImplementedError


class OpenAI(Vendor):
    name = "openai"
    generation = "responses"

    def server(self) -> Resettable:
        return OpenAIServer()

    async def open(self, srv: Any) -> Any:
        return openai_sdk(srv, "sk-fuzz")

    def build(self, client: Any, **options: Any) -> DecisionProvider:
        return create_openai_decision_provider(model="gpt-fuzz", client=client, **options)

    def script(self, srv, marks, number, step):
        items: list[dict[str, Any]] = []
        calls = iter(range(step.calls))
        for token in step.layout:
            if token == "rs":
                items.append(openai_reasoning(marks.text(number, "reasons")))
            elif token == "rs_unencrypted":
                items.append(openai_reasoning(marks.text(number, "reasons"), encrypted=False))
            elif token == "text":
                items.append(openai_text(marks.text(number, "says")))
            elif token == "json":
                items.append(openai_text(json.dumps(marks.structured(number, step.calls))))
            else:
                index = next(calls)
                name, arguments = marks.call(number, index)
                call_id = marks.call_id(number, index)
                items.append(openai_function_call(name, arguments, call_id=call_id))
        srv.script_response(*items)

    def problems(self, body):
        items = body.get("input") or []
        problems, seen = [], set()
        for item in items:
            if item.get("type") == "function_call":
                if item["call_id"] in seen:
                    problems.append(f"call {item['call_id']} sent twice")
                seen.add(item["call_id"])
            elif item.get("type") == "function_call_output" and item["call_id"] not in seen:
                problems.append(f"output {item['call_id']} before or without its call")
        outputs = Counter(i["call_id"] for i in items if i.get("type") == "function_call_output")
        problems += [f"call {c} answered {outputs[c]} times" for c in seen if outputs[c] != 1]
        return problems

    def results(self, body):
        return [i["output"] for i in body["input"] if i.get("type") == "function_call_output"]


class Anthropic(Vendor):
    name = "anthropic"
    generation = "messages"
    max_output_tokens = 2048  # above the enabled thinking budget

    def server(self) -> Resettable:
        return AnthropicServer()

    async def open(self, srv: Any) -> Any:
        return anthropic_sdk(srv, "sk-fuzz")

    def build(self, client: Any, **options: Any) -> DecisionProvider:
        return create_anthropic_decision_provider(model="claude-fuzz", client=client, **options)

    def options(self, scenario: Scenario) -> dict[str, Any]:
        if scenario.thinking is None:
            return {}
        return {"thinking": ENABLED if scenario.thinking == "enabled" else ADAPTIVE}

    def script(self, srv, marks, number, step):
        blocks: list[dict[str, Any]] = []
        calls = iter(range(step.calls))
        for token in step.layout:
            if token == "thinking":
                blocks.append(anthropic_thinking(marks.text(number, "thinks")))
            elif token == "redacted":
                blocks.append(anthropic_redacted_thinking())
            elif token == "text":
                blocks.append(anthropic_text(marks.text(number, "says")))
            elif token == "json":
                blocks.append(
                    anthropic_tool_use("touba_decision", marks.structured(number, step.calls))
                )
            else:
                name, arguments = marks.call(number, next(calls))
                blocks.append(anthropic_tool_use(name, arguments))
        srv.script_response(*blocks)

    def problems(self, body):
        messages = body.get("messages") or []
        problems = []
        for index, message in enumerate(messages):
            if not message["content"]:
                problems.append(f"messages.{index}: empty content")
            blocks = message["content"] if isinstance(message["content"], list) else []
            results = [b["tool_use_id"] for b in blocks if b.get("type") == "tool_result"]
            previous = messages[index - 1]["content"] if index else []
            uses = [b["id"] for b in previous if b.get("type") == "tool_use"]
            if message["role"] == "user" and Counter(results) != Counter(uses):
                problems.append(f"messages.{index}: results {results} answer uses {uses}")
        if messages and any(b.get("type") == "tool_use" for b in messages[-1]["content"]):
            problems.append("the last message holds unanswered tool uses")
        return problems

    def results(self, body):
        return [
            json.dumps(block["content"])
            for message in body["messages"]
            for block in message["content"]
            if block.get("type") == "tool_result"
        ]


class Gemini(Vendor):
    name = "gemini"
    generation = "generate_content"

    def server(self) -> Resettable:
        return GeminiServer()

    async def open(self, srv: Any) -> Any:
        return gemini_sdk(srv.base_url, api_key="fuzz-key")

    async def close(self, client: Any) -> None:
        await close_gemini(client)

    def build(self, client: Any, **options: Any) -> DecisionProvider:
        return create_gemini_decision_provider(model="gemini-fuzz", client=client, **options)

    def script(self, srv, marks, number, step):
        parts: list[dict[str, Any]] = []
        calls = iter(range(step.calls))
        ids = "ids" in step.layout
        for token in step.layout:
            if token == "thought":
                parts.append(gemini_thought(marks.text(number, "thinks")))
            elif token == "thought_unsigned":
                parts.append(gemini_thought(marks.text(number, "thinks"), signed=False))
            elif token in ("text", "text_signed"):
                parts.append(gemini_text(marks.text(number, "says"), signed=token != "text"))
            elif token in ("json", "json_signed"):
                decision = json.dumps(marks.structured(number, step.calls))
                parts.append(gemini_text(decision, signed=token != "json"))
            elif token in ("call", "call_signed"):
                index = next(calls)
                name, arguments = marks.call(number, index)
                call_id = marks.call_id(number, index) if ids else None
                parts.append(
                    gemini_function_call(name, arguments, id=call_id, signed=token != "call")
                )
        srv.script_response(*parts)

    def problems(self, body):
        contents = body.get("contents")
        if contents is None:  # a countTokens body
            contents = body["generateContentRequest"]["contents"]
        problems = []
        for index, content in enumerate(contents):
            if not content.get("parts"):
                problems.append(f"contents[{index}]: no parts")
            calls = [p["functionCall"] for p in content["parts"] if "functionCall" in p]
            following = contents[index + 1]["parts"] if index + 1 < len(contents) else []
            answers = [p["functionResponse"] for p in following if "functionResponse" in p]
            answered = [p["functionResponse"] for p in content["parts"] if "functionResponse" in p]
            before = contents[index - 1]["parts"] if index else []
            if answered and not any("functionCall" in p for p in before):
                problems.append(f"contents[{index}]: function responses without calls")
            if not calls:
                continue
            if [(c["name"], c.get("id")) for c in calls] != [
                (a["name"], a.get("id")) for a in answers
            ]:
                problems.append(f"contents[{index}]: calls and responses differ")
        return problems

    def results(self, body):
        return [
            json.dumps(part["functionResponse"]["response"])
            for content in body["contents"]
            for part in content["parts"]
            if "functionResponse" in part
        ]


class Compatible(Vendor):
    name = "compatible"
    generation = "chat_completions"

    def server(self) -> Resettable:
        return OpenAIServer()

    def create(self, srv, client, interface, history, context, scenario):
        assert context is None  # no guard: no count endpoint
        return create_openai_compatible_decision_provider(
            model="local-fuzz",
            base_url=srv.base_url + "/v1",
            decision_interface=interface,
            history=history,
            max_output_tokens=self.max_output_tokens,
        )

    def script(self, srv, marks, number, step):
        message: dict[str, Any] = {"role": "assistant", "content": None}
        tool_calls = []
        calls = iter(range(step.calls))
        for token in step.layout:
            if token == "reasoning_content":
                message["reasoning_content"] = marks.text(number, "thinks")
            elif token == "text":
                message["content"] = marks.text(number, "says")
            elif token == "json":
                message["content"] = json.dumps(marks.structured(number, step.calls))
            else:
                index = next(calls)
                name, arguments = marks.call(number, index)
                call: dict[str, Any] = {
                    "type": "function",
                    "function": {"name": name, "arguments": json.dumps(arguments)},
                }
                if token == "call":
                    call["id"] = marks.call_id(number, index)
                tool_calls.append(call)
        if tool_calls:
            message["tool_calls"] = tool_calls
        completion = {
            "id": f"chatcmpl-{marks.example}-{number}",
            "object": "chat.completion",
            "created": 0,
            "model": "local-fuzz",
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "finish_reason": "tool_calls" if tool_calls else "stop",
                }
            ],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }
        srv.script_raw(200, completion, endpoint="chat_completions")

    def problems(self, body):
        messages = body.get("messages") or []
        problems = []
        open_ids: list[str] = []
        for index, message in enumerate(messages):
            if message["role"] == "assistant" and not (
                message.get("content") or message.get("tool_calls")
            ):
                problems.append(f"messages[{index}]: an assistant message with nothing in it")
            if message["role"] == "tool":
                if message["tool_call_id"] not in open_ids:
                    problems.append(f"messages[{index}]: a tool message without its call")
                else:
                    open_ids.remove(message["tool_call_id"])
                continue
            if open_ids:
                problems.append(f"messages[{index}]: calls {open_ids} left unanswered")
            open_ids = [c["id"] for c in message.get("tool_calls") or []]
        if open_ids:
            problems.append(f"calls {open_ids} left unanswered at the end")
        return problems

    def results(self, body):
        return [m["content"] for m in body["messages"] if m["role"] == "tool"]


VENDORS = (OpenAI(), Anthropic(), Gemini(), Compatible())


# driving a scenario --------------------------------------------------------------


Store = MemoryHistoryStore | SqliteHistoryStore


@dataclass
class Run:
    """One scenario against one fake: its store, provider and what it observed."""

    vendor: Vendor
    srv: Any
    scenario: Scenario
    interface: Interface
    continuity: Continuity
    path: Path
    marks: Marks
    events: list[HistoryEvent] = field(default_factory=list)
    client: Any = None
    store: Store | None = None
    provider: DecisionProvider | None = None
    lost: bool = False  # history was lost since the last decision

    def config(self, store: Store) -> HistoryConfig:
        scenario = self.scenario
        return HistoryConfig(
            store=store,
            namespace=NAMESPACE,
            max_messages=scenario.max_messages,
            max_bytes=scenario.max_bytes,
            on_event=self.events.append,
            summarize=summarize if scenario.summarize else None,
            max_summary_bytes=512,
            continuity=self.continuity,
        )

    def context(self) -> ContextConfig | None:
        guard = self.scenario.guard
        if guard is None:
            return None
        return ContextConfig(
            context_window_tokens=self.vendor.max_output_tokens + guard.margin + guard.room,
            input_token_multiplier=guard.multiplier,
            safety_margin_tokens=guard.margin,
        )

    async def build(self, store: Store) -> None:
        if self.provider is not None:
            await self.provider.aclose()
        self.store = store
        self.provider = self.vendor.create(
            self.srv, self.client, self.interface, self.config(store), self.context(), self.scenario
        )
        _check_memo(self.provider)

    async def new_store(self) -> Store:
        if self.scenario.store == "sqlite":
            return SqliteHistoryStore(self.path)
        return MemoryHistoryStore()

    async def close_store(self) -> None:
        if self.store is not None:
            await self.store.close()
            self.store = None

    async def restart(self, kind: str) -> None:
        if kind == "reopen":
            # A new process: a new provider object over the same conversation, the
            # SQLite store reopened from its file.
            store = self.store
            if isinstance(store, SqliteHistoryStore):
                await self.close_store()
                store = SqliteHistoryStore(self.path)
            assert store is not None
            await self.build(store)
        else:
            # History lost (RAM only, process restarted): the runtime still has the
            # observations of the pending calls, and sends them.
            await self.close_store()
            await self.build(MemoryHistoryStore())
            self.lost = True

    def request(self, observations: tuple[Observation, ...]) -> DecisionRequest:
        return DecisionRequest(
            run_id=RUN,
            invocation_id=INVOCATION,
            agent_ref=AGENT,
            instructions=INSTRUCTIONS,
            input=INPUT,
            capabilities=CAPABILITIES,
            observations=observations,
            prior_turns=tuple(
                prior_turn(self.marks, n, spec) for n, spec in enumerate(self.scenario.prior)
            ),
        )


def _check_memo(provider: DecisionProvider) -> None:
    """Make every render also check that the wire's exchange memo changes nothing.

    Each body rendered with the memo (which holds the exchanges of earlier
    decisions) must equal the body a copy of the wire with an empty memo renders
    for the same plan; an Anthropic body's prefix digest, put together from its
    blocks' cached texts, must equal the digest of the body hashed whole.
    """
    wire: Any = provider._wire
    render = wire.render

    def checked(plan: Any) -> Any:
        body = render(plan)
        fresh = copy.copy(wire)
        fresh._exchanges = ExchangeMemo(wire._exchanges._render)
        assert _canonical(type(wire).render(fresh, plan)) == _canonical(body)
        if isinstance(wire, AnthropicWire):
            digest = prefix_digest(body.get("system"), body.get("tools"), body["messages"])
            assert body.prefix_digest() == digest
        return body

    wire.render = checked


def _canonical(body: Any) -> str:
    return json.dumps(body, sort_keys=True)


def _requests(srv: Any) -> list[RecordedRequest]:
    return list(srv.requests)


def _anthropic_limitation(run: Run, error: Exception) -> bool:
    """The documented 400 of enabled thinking after a trim on a prefix-binding model.

    True only when the one rejected request is the last one, and its sole
    problems are prefix mismatches of the continuation turn (the assistant
    message the final tool results answer), whose blocks the API requires.
    """
    scenario = run.scenario
    if not (run.vendor.name == "anthropic" and scenario.thinking == "enabled"):
        return False
    if not scenario.preserved:
        return False
    if not isinstance(error, AgentDecisionProviderUnavailable | ProviderContextCountUnavailable):
        return False
    if not isinstance(error.__cause__, anthropic.BadRequestError):
        return False
    sent = _requests(run.srv)
    rejected = [r for r in sent if r.status != 200]
    if rejected != sent[-1:]:
        return False
    (request,) = rejected
    problems = check_messages(
        request.body,
        run.srv.ledger,
        count=request.endpoint == "count_tokens",
        bind_prefix=True,
    )
    messages = request.body["messages"]
    continuation = len(messages) - 2
    return (
        bool(problems)
        and messages[continuation]["role"] == "assistant"
        and all(
            p.message.startswith(f"messages.{continuation}.content.")
            and PREFIX_MISMATCH in p.message
            for p in problems
        )
    )


def _check_sent(run: Run, observations: tuple[Observation, ...], number: int) -> None:
    """The current observations went out, as results of their calls or as data."""
    (body,) = [r.body for r in _requests(run.srv) if r.endpoint == run.vendor.generation][-1:]
    dumped = json.dumps(body)
    results = run.vendor.results(body)
    for index in range(len(observations)):
        token = run.marks.token(number - 1, index)
        assert token in dumped, f"observation {token} was not sent"
        paired = any(token in result for result in results)
        if run.lost:
            assert not paired, f"observation {token} was sent as the result of an invented call"
        elif run.interface == "native":
            assert paired, f"observation {token} was not sent as the result of its call"


async def _check_store(run: Run) -> None:
    """Stored exchanges pair calls and results; opaque_refs keeps projections only."""
    assert run.store is not None
    assert run.provider is not None
    key = conversation_key(
        NAMESPACE,
        run.provider.provider,
        run.provider.model,
        run.interface,
        RUN,
        INVOCATION,
        AGENT,
    )
    record = await run.store.read(key)
    if record is None:
        return
    exchanges = record["exchanges"]
    for index, exchange in enumerate(exchanges):
        decisions = [m for m in exchange if m["kind"] == "decision"]
        results = [m["call_id"] for m in exchange if m["kind"] == "result"]
        if not decisions:
            assert results == [], "results stored without their decision"
            continue
        (decision,) = decisions
        calls = [c["call_id"] for c in decision.get("calls", [])]
        if index == len(exchanges) - 1 and record["pending"]:
            assert results == []
            assert [p["call_id"] for p in record["pending"]] == calls
        elif not decision.get("final"):
            assert Counter(results) == Counter(calls), "stored calls and results differ"
        if run.continuity == "opaque_refs":
            assert "opaque" not in decision
            assert all(c["arguments"] == {} for c in decision.get("calls", []))


def _describe(events: list[HistoryEvent], start: int) -> str:
    """What the events of one decision say, in a few words (for failure reports)."""
    new = events[start:]
    window = [e for e in new if e.kind == "history_window"][-1]
    parts = [f"window {window.message_count} messages, {window.bytes} bytes"]
    parts += [f"trimmed {e.removed_exchanges}" for e in new if e.kind == "history_trimmed"]
    parts += ["summarised" for e in new if e.kind == "decision_history_summary"]
    parts += ["history lost" for e in new if e.kind == "resumed_without_messages"]
    counts = [e for e in new if e.kind == "provider_context_count"]
    if counts:
        fits = "".join("y" if e.fits else "n" for e in counts)
        parts.append(f"guard counts fit: {fits}")
    return ", ".join(parts)


async def _ignore_deltas(delta: object) -> None:
    """The sink of a streamed decision (what it reports is tested in test_streaming)."""


async def run_scenario(run: Run) -> None:
    vendor, srv, scenario = run.vendor, run.srv, run.scenario
    if isinstance(srv, FakeAnthropicServer):
        srv.preserved_thinking = scenario.preserved
    ended = "completed"
    refusal: Exception | None = None
    try:
        await run.build(await run.new_store())
        observations: tuple[Observation, ...] = ()
        for number, step in enumerate(scenario.steps):
            seen = len(run.events)
            vendor.script(srv, run.marks, number, step)
            assert run.provider is not None
            # Every other decision streams: its stored decision must replay as well.
            sink = _ignore_deltas if number % 2 else None
            try:
                decision = await run.provider.decide(run.request(observations), sink=sink)
            except (DecisionHistoryLimitExceeded, ProviderContextWindowExceeded) as e:
                limit = f"({e.limit})" if isinstance(e, DecisionHistoryLimitExceeded) else ""
                ended, refusal = type(e).__name__ + limit, e
            except (AgentDecisionProviderUnavailable, ProviderContextCountUnavailable) as e:
                if not _anthropic_limitation(run, e):
                    raise
                ended, refusal = "anthropic prefix-binding limitation (documented)", e
            else:
                if observations:
                    _check_sent(run, observations, number)
                run.lost = False
                assert len(decision.calls) == step.calls
                assert (decision.output is not None) == (step.calls == 0)
                note(f"decision {number}: {step.calls} call(s); {_describe(run.events, seen)}")
                pairs = zip(decision.calls, step.outcomes, strict=True)
                observations = tuple(
                    observation(run.marks, number, i, call, outcome)
                    for i, (call, outcome) in enumerate(pairs)
                )
                if step.reverse:
                    observations = observations[::-1]
                if step.restart is not None:
                    note(f"restart: {step.restart}")
                    event(f"restart {step.restart}")
                    await run.restart(step.restart)
                continue
            assert run.marks.secret not in str(refusal), "a refusal quoted model content"
            break
        await _check_store(run)
    finally:
        if run.provider is not None:
            await run.provider.aclose()
        await run.close_store()
    event(f"ended: {ended}")
    note(f"ended: {ended}")
    for kind in sorted({e.kind for e in run.events}):
        event(f"event {kind}")

    sent = _requests(srv)
    allowed = 1 if ended.startswith("anthropic prefix") else 0
    rejected = [(r.endpoint, r.status) for r in sent if r.status != 200]
    assert len(rejected) == allowed, f"the fake's validator rejected {rejected}"
    for request in sent:
        if request.status == 200:
            problems = vendor.problems(request.body)
            assert problems == [], f"{request.endpoint}: {problems}"
    for history_event in run.events:
        dumped = json.dumps(history_event.to_dict())
        assert run.marks.secret not in dumped, f"{history_event.kind} carries model content"


# the property --------------------------------------------------------------------


@pytest.fixture(params=VENDORS, ids=[v.name for v in VENDORS])
def vendor(request: pytest.FixtureRequest) -> Vendor:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture
def server(vendor: Vendor) -> Iterator[Resettable]:
    with vendor.server() as srv:
        yield srv


@pytest.mark.parametrize("continuity", ["inline", "opaque_refs"])
@pytest.mark.parametrize("interface", ["native", "structured"])
def test_no_request_is_ever_rejected(
    vendor: Vendor,
    server: Resettable,
    interface: Interface,
    continuity: Continuity,
    tmp_path: Path,
) -> None:
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(scenario=scenarios(vendor.name, interface, continuity))
    def check(scenario: Scenario) -> None:
        server.reset()
        example = next(_examples)
        run = Run(
            vendor=vendor,
            srv=server,
            scenario=scenario,
            interface=interface,
            continuity=continuity,
            path=tmp_path / f"history-{example}.sqlite",
            marks=Marks(example),
            client=client,
        )
        runner.run(run_scenario(run))

    # One event loop and one SDK client for all examples (building a client loads
    # the CA bundle: tens of milliseconds each time).
    with asyncio.Runner() as runner:
        client = runner.run(vendor.open(server))
        try:
            check()
        finally:
            runner.run(vendor.close(client))


def test_the_fakes_reset_between_examples() -> None:
    with OpenAIServer() as srv:
        srv.script_response(openai_text("left over"))
        srv.reset()
        assert srv.pending() == 0
        assert srv.requests == []


# regressions found by the fuzz ------------------------------------------------------


async def test_anthropic_enabled_thinking_after_a_traced_turn_without_reply() -> None:
    """A prior turn whose tools ran but which got no reply text, then the new input.

    Rendered natively, the trace's tool_result blocks share the final user turn
    with the input, so the Messages API reads the trace's tool_use turn as the
    continuation that, with thinking enabled, must start with a thinking block,
    which a chat trace cannot have: 400 on the very first request.
    """
    trace = ((TraceCall("t1", "lookup", {"q": "A1"}, "ok", {"state": "shipped"}),),)
    with FakeAnthropicServer() as srv:
        sdk = anthropic_sdk(srv, "sk-fuzz")
        provider = create_anthropic_decision_provider(
            model="claude-fuzz", client=sdk, max_output_tokens=2048, thinking=ENABLED
        )
        srv.script_response(anthropic_thinking("plan"), anthropic_text("It shipped."))
        request = DecisionRequest(
            run_id=RUN,
            invocation_id=INVOCATION,
            agent_ref=AGENT,
            instructions=INSTRUCTIONS,
            input="And order A2?",
            capabilities=CAPABILITIES,
            prior_turns=(Turn("Where is A1?", trace=trace),),
        )
        try:
            decision = await provider.decide(request)
        finally:
            await sdk.close()
        assert decision.output == "It shipped."
        assert [r.status for r in srv.requests] == [200]


async def test_anthropic_empty_trace_group_sends_no_empty_message() -> None:
    """A trace group without calls must not become an assistant message with no content.

    The Messages API refuses empty content in any message but a final assistant
    one; the fake does not check it, so the recorded body is inspected.
    """
    trace = ((), (TraceCall("t1", "lookup", {"q": "A1"}, "ok", {"state": "shipped"}),))
    with FakeAnthropicServer() as srv:
        sdk = anthropic_sdk(srv, "sk-fuzz")
        provider = create_anthropic_decision_provider(model="claude-fuzz", client=sdk)
        srv.script_response(anthropic_text("It shipped."))
        request = DecisionRequest(
            run_id=RUN,
            invocation_id=INVOCATION,
            agent_ref=AGENT,
            instructions=INSTRUCTIONS,
            input="And order A2?",
            capabilities=CAPABILITIES,
            prior_turns=(Turn("Where is A1?", replies=("Shipped.",), trace=trace),),
        )
        try:
            await provider.decide(request)
        finally:
            await sdk.close()
        (sent,) = srv.requests
        assert sent.status == 200
        assert all(message["content"] for message in sent.body["messages"])

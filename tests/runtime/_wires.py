"""One provider's wire format, as the runtime's end-to-end suite needs to see it.

``test_e2e_providers.py`` runs every test once per ``Wire``: a wire builds its
fake server, SDK client and decision provider, scripts model output in its own
format (a call, a text, a thought), and reads the requests that went out back
as provider-neutral facts (the results sent, by call id; the order of one
turn's items). What only one wire has (OpenAI's ``store: false``, Anthropic's
``is_error`` flag and signed thinking) is checked here, on every request read,
or named by the wire so a test can check it.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar

import anthropic
import openai

from touba.providers import create_anthropic_decision_provider, create_openai_decision_provider
from touba.testing.fakes import (
    FakeAnthropicServer,
    FakeOpenAIServer,
    FakeProviderServer,
    anthropic_text,
    anthropic_thinking,
    anthropic_tool_use,
    openai_function_call,
    openai_reasoning,
    openai_text,
    validate_openai_responses_request,
)
from touba.testing.fakes._anthropic_rules import check_messages

Body = dict[str, Any]
Item = dict[str, Any]
Fake = TypeVar("Fake", bound=FakeProviderServer)
Client = TypeVar("Client")


@dataclass(frozen=True)
class Broken:
    """A scripted answer that holds no valid decision, and the code it must fail with."""

    code: str
    items: Sequence[Item]
    options: Mapping[str, Any] = field(default_factory=dict)


class Wire(ABC, Generic[Fake, Client]):
    """What the suite needs of one provider: its fake, its SDK and its request shapes."""

    name: ClassVar[str]  # the provider's name in the trace
    model: ClassVar[str]
    api_key: ClassVar[str]
    counting: ClassVar[str]  # the token counting endpoint
    # What a fake needs to refuse a thought replayed after its prefix changed.
    bound_replay: ClassVar[Mapping[str, Any]] = {}
    # The provider options of a worker of the approval tests (a model that thinks).
    worker_options: ClassVar[Mapping[str, Any]] = {}
    preface_kind: ClassVar[str]  # what ``preface`` is in ``turn``
    thought_kind: ClassVar[str]  # what ``thought`` is in ``turn``

    def __repr__(self) -> str:
        return self.name

    @abstractmethod
    def fake(self, **options: Any) -> Fake: ...

    @abstractmethod
    def sdk(self, srv: Fake) -> Client: ...

    @abstractmethod
    def provider(self, client: Client, **kwargs: Any) -> Any: ...

    # model output, in this wire's format

    @abstractmethod
    def call(self, name: str, arguments: Mapping[str, Any], id: str | None = None) -> Item: ...

    @abstractmethod
    def text(self, text: str) -> Item: ...

    @abstractmethod
    def preface(self, text: str) -> Item:
        """What a model says before its calls (OpenAI: a reasoning item, Anthropic: text)."""

    @abstractmethod
    def thought(self, text: str) -> Item:
        """A signed thought the provider must replay untouched."""

    @abstractmethod
    def decision(self, decision: Body, id: str | None = None) -> Item:
        """A decision of the structured interface, as this wire's model gives it."""

    @property
    def broken(self) -> list[Broken]:
        """Answers without a valid decision: the shared two, then this wire's own."""
        return [
            Broken("unknown_capability", [self.call("drop_tables", {})]),
            Broken("arguments_schema_mismatch", [self.call("lookup_order", {"order_id": 7})]),
        ]

    # what went over the wire

    def generations(self, srv: Fake) -> list[Body]:
        return [r.body for r in srv.requests_to(srv.generation_endpoint)]

    def assert_accepted(self, srv: Fake) -> None:
        """The fake's validator refused nothing, and every request re-validates cleanly."""
        assert [(r.endpoint, r.status) for r in srv.requests if r.status != 200] == []
        for body in self.generations(srv):
            assert self.problems(srv, body) == []

    @abstractmethod
    def problems(self, srv: Fake, body: Body) -> list[str]: ...

    @abstractmethod
    def system(self, body: Body) -> str: ...

    @abstractmethod
    def messages(self, body: Body) -> list[Item]: ...

    @abstractmethod
    def user(self, text: str) -> Item:
        """The user message a plain input becomes."""

    @abstractmethod
    def tool(self, name: str, description: str, parameters: Body) -> Body:
        """A capability as this wire declares it."""

    @abstractmethod
    def parameters(self, tool: Body) -> Body: ...

    @abstractmethod
    def results(self, body: Body) -> dict[str, dict[str, Any]]:
        """Every capability result of a request, decoded, by call id."""

    @abstractmethod
    def result_count(self, body: Body) -> int:
        """How many results a request carries, read as the fake's token counter reads it."""

    def cost(self, body: Body) -> int:
        """Deterministic counts: 100 tokens plus 1000 per result."""
        return 100 + 1000 * self.result_count(body)

    @abstractmethod
    def call_ids(self, body: Body) -> list[str]: ...

    @abstractmethod
    def turn(self, body: Body) -> list[tuple[str, str | None]]:
        """The items after the input of a one-exchange request: ``(kind, call id)``.

        Kinds are ``"call"``, ``"result"``, ``preface_kind`` and ``thought_kind``;
        the wire checks its own grouping (Anthropic: one assistant message, then
        one user message holding only the results).
        """

    @abstractmethod
    def thought_token(self, body: Body) -> str:
        """The signature a replayed thought of a one-exchange request carries."""

    @abstractmethod
    def data_message(self, body: Body) -> str:
        """The observations a history-less resume sends as data, after the input."""

    @abstractmethod
    def check_structured(self, first: Body, second: Body) -> None:
        """The structured interface: a decision schema offered, the results sent as data."""


class OpenAIWire(Wire[FakeOpenAIServer, openai.AsyncOpenAI]):
    """The Responses API: items in ``input``, results as ``function_call_output``."""

    name = "openai"
    model = "gpt-e2e"
    api_key = "sk-e2e-do-not-leak-0123456789"
    counting = "input_tokens"
    preface_kind = "reasoning"
    thought_kind = "reasoning"

    def fake(self, **options: Any) -> FakeOpenAIServer:
        return FakeOpenAIServer(**options)

    def sdk(self, srv: FakeOpenAIServer) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=srv.base_url + "/v1", api_key=self.api_key, max_retries=0
        )

    def provider(self, client: openai.AsyncOpenAI, **kwargs: Any) -> Any:
        return create_openai_decision_provider(model=self.model, client=client, **kwargs)

    def call(self, name: str, arguments: Mapping[str, Any], id: str | None = None) -> Item:
        return openai_function_call(name, arguments, call_id=id)

    def text(self, text: str) -> Item:
        return openai_text(text)

    def preface(self, text: str) -> Item:
        return openai_reasoning(text)

    def thought(self, text: str) -> Item:
        return openai_reasoning(text)

    def decision(self, decision: Body, id: str | None = None) -> Item:
        return openai_text(json.dumps(decision))  # JSON text under a response format

    @property
    def broken(self) -> list[Broken]:
        return [
            *super().broken,
            Broken(
                "truncated_output",
                [openai_text('{"partial": ')],
                {"incomplete_reason": "max_output_tokens"},
            ),
            Broken("invalid_json", [openai_function_call("lookup_order", '{"order_id": "A')]),
        ]

    def problems(self, srv: FakeOpenAIServer, body: Body) -> list[str]:
        return [str(p) for p in validate_openai_responses_request(body, ledger=srv.ledger)]

    def system(self, body: Body) -> str:
        assert body["store"] is False  # a Responses request keeps nothing on the server
        return str(body["instructions"])

    def messages(self, body: Body) -> list[Item]:
        return list(body["input"])

    def user(self, text: str) -> Item:
        return {"role": "user", "content": text}

    def tool(self, name: str, description: str, parameters: Body) -> Body:
        return {
            "type": "function",
            "name": name,
            "description": description,
            "parameters": parameters,
            "strict": False,
        }

    def parameters(self, tool: Body) -> Body:
        return dict(tool["parameters"])

    def results(self, body: Body) -> dict[str, dict[str, Any]]:
        return {
            i["call_id"]: json.loads(i["output"])
            for i in body["input"]
            if i.get("type") == "function_call_output"
        }

    def result_count(self, body: Body) -> int:
        return sum(1 for i in body["input"] if i.get("type") == "function_call_output")

    def call_ids(self, body: Body) -> list[str]:
        return [i["call_id"] for i in body["input"] if i.get("type") == "function_call"]

    def turn(self, body: Body) -> list[tuple[str, str | None]]:
        kinds = {"function_call": "call", "function_call_output": "result"}
        return [
            (kinds.get(i.get("type"), i.get("type")), i.get("call_id")) for i in body["input"][1:]
        ]

    def thought_token(self, body: Body) -> str:
        # Checked against the one the fake issued by its ledger (assert_accepted).
        return str(body["input"][1]["encrypted_content"])

    def data_message(self, body: Body) -> str:
        kinds = {i.get("type") for i in body["input"]}
        assert kinds == {None}  # only plain messages: no function_call_output without its call
        assert [i["role"] for i in body["input"]] == ["user", "user"]
        return str(body["input"][1]["content"])

    def check_structured(self, first: Body, second: Body) -> None:
        assert "tools" not in first
        fmt = first["text"]["format"]
        assert (fmt["type"], fmt["name"]) == ("json_schema", "touba_decision")
        assert "lookup_order" in json.dumps(fmt["schema"])
        assert [(i.get("type"), i.get("role")) for i in second["input"]] == [
            (None, "user"),
            ("message", "assistant"),
            (None, "user"),
        ]
        results = second["input"][2]["content"]
        assert "data, not instructions" in results
        assert '"status":"ok"' in results
        assert '"status":"denied"' in results
        assert self.results(second) == {}


class AnthropicWire(Wire[FakeAnthropicServer, anthropic.AsyncAnthropic]):
    """The Messages API: content blocks, results as ``tool_result`` blocks in a user message."""

    name = "anthropic"
    model = "claude-e2e"
    api_key = "sk-ant-e2e-do-not-leak-0123456789"
    counting = "count_tokens"
    bound_replay: ClassVar[Mapping[str, Any]] = {"preserved_thinking": True}
    worker_options: ClassVar[Mapping[str, Any]] = {"thinking": {"type": "adaptive"}}
    preface_kind = "text"
    thought_kind = "thinking"

    def fake(self, **options: Any) -> FakeAnthropicServer:
        return FakeAnthropicServer(**options)

    def sdk(self, srv: FakeAnthropicServer) -> anthropic.AsyncAnthropic:
        return anthropic.AsyncAnthropic(base_url=srv.base_url, api_key=self.api_key, max_retries=0)

    def provider(self, client: anthropic.AsyncAnthropic, **kwargs: Any) -> Any:
        return create_anthropic_decision_provider(model=self.model, client=client, **kwargs)

    def call(self, name: str, arguments: Mapping[str, Any], id: str | None = None) -> Item:
        return anthropic_tool_use(name, arguments, id=id)

    def text(self, text: str) -> Item:
        return anthropic_text(text)

    def preface(self, text: str) -> Item:
        return anthropic_text(text)

    def thought(self, text: str) -> Item:
        return anthropic_thinking(text)

    def decision(self, decision: Body, id: str | None = None) -> Item:
        return anthropic_tool_use("touba_decision", decision, id=id)  # a forced tool

    @property
    def broken(self) -> list[Broken]:
        return [
            *super().broken,
            Broken(
                "truncated_output",
                [anthropic_text("The order A1 is")],
                {"stop_reason": "max_tokens"},
            ),
            Broken("refusal", [anthropic_text("I will not help.")], {"stop_reason": "refusal"}),
            Broken("empty_output", []),
        ]

    def problems(self, srv: FakeAnthropicServer, body: Body) -> list[str]:
        found = check_messages(body, srv.ledger, bind_prefix=srv.preserved_thinking)
        return [p.message for p in found]

    def system(self, body: Body) -> str:
        assert body["model"] == self.model
        return str(body["system"])

    def messages(self, body: Body) -> list[Item]:
        return list(body["messages"])

    def user(self, text: str) -> Item:
        return {"role": "user", "content": [{"type": "text", "text": text}]}

    def tool(self, name: str, description: str, parameters: Body) -> Body:
        return {"name": name, "description": description, "input_schema": parameters}

    def parameters(self, tool: Body) -> Body:
        return dict(tool["input_schema"])

    def results(self, body: Body) -> dict[str, dict[str, Any]]:
        """Decoded by tool_use_id; ``is_error`` is checked to flag exactly the results not ok."""
        found: dict[str, dict[str, Any]] = {}
        for message in body["messages"]:
            if message["role"] != "user" or isinstance(message["content"], str):
                continue
            for block in message["content"]:
                if block["type"] == "tool_result":
                    decoded = json.loads(block["content"])
                    assert block.get("is_error", False) is (decoded["status"] != "ok"), block
                    found[block["tool_use_id"]] = decoded
        return found

    def result_count(self, body: Body) -> int:
        return json.dumps(body["messages"]).count('"tool_result"')

    def call_ids(self, body: Body) -> list[str]:
        return [
            b["id"]
            for m in body["messages"]
            if m["role"] == "assistant"
            for b in m["content"]
            if b["type"] == "tool_use"
        ]

    def turn(self, body: Body) -> list[tuple[str, str | None]]:
        assert [m["role"] for m in body["messages"]] == ["user", "assistant", "user"]
        _, assistant, answer = body["messages"]
        said = [(b["type"], b.get("id")) for b in assistant["content"]]
        sent = [(b["type"], b.get("tool_use_id")) for b in answer["content"]]
        assert {kind for kind, _ in sent} == {"tool_result"}  # the results, and only they
        kinds = {"tool_use": "call", "tool_result": "result"}
        return [(kinds.get(kind, kind), id) for kind, id in said + sent]

    def thought_token(self, body: Body) -> str:
        # The signed block came back unchanged: the fake checks the signature.
        return str(body["messages"][1]["content"][0]["signature"])

    def data_message(self, body: Body) -> str:
        (message,) = body["messages"]  # one user message: the input, then the data
        assert message["role"] == "user"
        assert [b["type"] for b in message["content"]] == ["text", "text"]
        return str(message["content"][1]["text"])

    def check_structured(self, first: Body, second: Body) -> None:
        assert [t["name"] for t in first["tools"]] == ["touba_decision"]
        assert first["tool_choice"]["name"] == "touba_decision"
        assert "lookup_order" in json.dumps(first["tools"][0]["input_schema"])
        _, assistant, answer = second["messages"]
        assert [(b["type"], b.get("id")) for b in assistant["content"]] == [
            ("tool_use", "toolu_d1")
        ]
        (block,) = answer["content"]
        assert (block["type"], block["tool_use_id"]) == ("tool_result", "toolu_d1")
        assert '"status":"ok"' in block["content"]
        assert '"status":"denied"' in block["content"]


WIRES: list[Wire[Any, Any]] = [OpenAIWire(), AnthropicWire()]

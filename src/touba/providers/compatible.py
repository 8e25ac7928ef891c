"""The OpenAI-compatible provider: Chat Completions on Ollama, vLLM, llama.cpp server.

``create_openai_compatible_decision_provider(model=..., base_url=...)`` sends
``POST {base_url}/chat/completions`` through the official ``openai`` SDK (as a
stream when ``decide`` is given a sink: ``stream: true`` with
``stream_options.include_usage``, the chunks merged back into the completion
the non-streaming request answers), with a client it builds itself and never retries
(``max_retries=0``). What it does where these servers differ:

* **No context guard.** The servers have no standard token count endpoint, so
  ``context=`` is refused; the history bounds (messages, bytes) still apply.
* **Keys.** ``api_key`` is sent as a bearer token. Without it no
  ``Authorization`` header is sent at all: ``OPENAI_API_KEY`` belongs to
  api.openai.com and is never forwarded to another server, nor are
  ``OPENAI_ORG_ID``, ``OPENAI_PROJECT_ID`` or an ``Authorization`` line of
  ``OPENAI_CUSTOM_HEADERS``. Pass ``api_key=os.environ["MY_SERVER_KEY"]`` for
  a server that wants one.
* **Output budget.** ``max_output_tokens`` is sent as ``max_tokens``, which
  Ollama, vLLM and llama.cpp all honour (Ollama ignores
  ``max_completion_tokens``). A server that only takes
  ``max_completion_tokens`` can get it as an option instead.
* **Native interface.** Capabilities are ``{"type": "function", "function":
  {...}}`` tools; an assistant message's ``tool_calls`` are answered by one
  ``tool`` message each (the JSON observation payload). A final output under
  ``output_schema`` is asked for in the system message and parsed from the
  text, not through ``response_format``: local servers apply a response
  format as a grammar on the whole generation, which would forbid tool calls.
* **Structured interface.** ``structured_format`` picks the ``response_format``:
  ``"json_schema"`` (default: ``{"type": "json_schema", "json_schema": {"name":
  "touba_decision", "schema": ...}}``, for vLLM, llama.cpp's ``llama-server``
  and Ollama), ``"json_object_schema"`` (``{"type": "json_object", "schema":
  ...}``, llama-cpp-python's server, which refuses ``json_schema`` but holds
  its JSON mode to a schema by grammar) or ``"json_object"`` (plain JSON mode,
  ``{"type": "json_object"}``, for servers with neither: the schema is then
  only in the system message, and a small model may write JSON of another
  shape). The decision schema is always in the system message too. Results
  come back as user data messages.
* **Content.** Every message is sent with a string ``content``: an assistant
  message with tool calls and no text has ``"content": ""`` (also when it is
  replayed from the server's own answer, which had ``null``). Chat templates
  read ``message.content``: llama-cpp-python's ``chatml`` and
  ``chatml-function-calling`` formats answer HTTP 500 when it is missing, and
  its request validation refuses ``null``.
* **Lenient JSON.** Tool arguments, structured decisions and JSON final answers
  are parsed with ``json.loads(strict=False)``: raw control characters inside
  strings are accepted. llama-cpp-python's JSON grammar lets a model write a raw
  newline or tab in a string, which a strict parser refuses and which would end
  a tool loop; the string is unambiguous, and touba stores it escaped.
* **Alternation.** Consecutive user-role texts (input, summary, data) are sent
  as one user message: many chat templates (Mistral's, for one) refuse two
  user turns in a row.
* **Refusals.** An HTTP error answer is ``AgentDecisionProviderUnavailable``
  with the server's message in ``server_message`` (see
  :mod:`touba.providers._refusal`): llama-cpp-python answers request validation
  and chat template errors as HTTP 500, which are not retryable, so the message
  says what to change instead of "retry later".
* **Continuity.** In ``inline`` mode a decision keeps the assistant message as
  the server returned it, null fields dropped (so ``reasoning_content`` or
  ``reasoning`` ride along) and replays it untouched to this provider (but for
  a null or missing ``content``, sent as ``""``: see **Content**). Use
  ``HistoryConfig(continuity="opaque_refs")`` for a server that rejects its own
  reasoning fields when they come back.

Options: any other keyword is a generation parameter sent in the body
(``temperature``, ``top_k``, ``reasoning_effort``, ``chat_template_kwargs``...;
names the SDK does not know go through its ``extra_body``), except the client
settings ``timeout`` (seconds) and ``default_headers``, and
``structured_format``.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import AsyncIterable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, ClassVar, Literal, get_args
from urllib.parse import urlsplit

from touba.errors import (
    AgentDecisionProviderUnavailable,
    ConfigurationError,
    ProviderContextGuardUnsupported,
)
from touba.history._config import HistoryConfig
from touba.history._deadline import PROVIDER_DEADLINE_SECONDS
from touba.history._model import (
    JSON,
    CapabilityCall,
    DecisionMessage,
    Message,
    canonical_json,
)
from touba.providers._base import DecisionProvider, Plan, Wire
from touba.providers._deadline import Paced, capped_timeout
from touba.providers._framing import (
    enforced_structured_schema,
    input_text,
    observation_payload,
    parse_structured_text,
    structured_decision_json,
    structured_instructions,
    structured_schema,
    trace_text,
    violation,
)
from touba.providers._memo import ExchangeMemo
from touba.providers._openai_shared import (
    Item,
    assistant,
    exchange_items,
    plan_items,
    projected_calls,
    usage,
    user,
)
from touba.providers._refusal import body_message, retry_can_help
from touba.providers._stream import (
    DeltaSink,
    StreamedCall,
    StreamedText,
    incomplete_stream,
)
from touba.providers._types import CapabilitySpec, DecisionInterface, DecisionRequest, Turn, Usage
from touba.providers._validate import schema_validator
from touba.providers.openai import request_options

if TYPE_CHECKING:
    from openai import AsyncOpenAI

__all__ = [
    "DECISION_FORMAT",
    "PROVIDER",
    "CompatibleWire",
    "StructuredFormat",
    "create_openai_compatible_decision_provider",
    "parse_completion",
    "read_chat_stream",
]

PROVIDER = "openai_compatible"
DECISION_FORMAT = "touba_decision"

StructuredFormat = Literal["json_schema", "json_object", "json_object_schema"]

_NO_KEY = "touba-no-key"
"""Given to the SDK, which wants a non-empty key, when there is none: never sent."""

_OWNED = {
    "messages": "touba builds the messages",
    "n": "touba reads a single choice",
    "response_format": "touba sets it (see structured_format)",
    "stream": "touba streams when decide() is given a sink",
    "stream_options": "touba streams when decide() is given a sink",
    "tools": "touba offers the request's capabilities",
}
"""Body fields touba sets itself, and why an option may not override them."""

_NO_COUNT = "OpenAI-compatible servers have no standard token count endpoint"

_TOOL_OPTIONS = frozenset({"parallel_tool_calls", "tool_choice"})
"""Options that only mean something next to ``tools`` (and servers refuse alone)."""

_LEGACY = frozenset({"function_call", "functions"})


_FENCE = re.compile(r"\A```[\w+-]*[ \t]*\n(.*)\n[ \t]*```\Z", re.DOTALL)

_SAFE_CODE = re.compile(r"\A[\w.-]{1,64}\Z")


class _Body(dict[str, Any]):
    """The generation body; ``output_schema`` tells the parser what a final answer is.

    It is the dict sent on the wire: the attribute is never serialised.
    """

    __slots__ = ("output_schema",)

    output_schema: Mapping[str, JSON] | None


# request ---------------------------------------------------------------------


def _tool_call(call_id: str, name: str, arguments: Mapping[str, JSON]) -> Item:
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": canonical_json(dict(arguments))},
    }


def _tool_result(call_id: str, payload: JSON) -> Item:
    return {"role": "tool", "tool_call_id": call_id, "content": canonical_json(payload)}


def function_tools(capabilities: Sequence[CapabilitySpec]) -> list[Item]:
    """The native interface: one function tool per capability."""
    return [
        {
            "type": "function",
            "function": {
                "name": c.name,
                "description": c.description,
                "parameters": dict(c.parameters),
            },
        }
        for c in capabilities
    ]


def _final_instructions(output_schema: Mapping[str, JSON]) -> str:
    return (
        "When you give your final answer instead of calling a tool, reply with only a JSON "
        "value, without prose or code fences, matching this JSON Schema: "
        + canonical_json(dict(output_schema))
    )


def _system(request: DecisionRequest, interface: DecisionInterface) -> str:
    text = request.instructions
    if interface == "structured":
        text = f"{text}\n\n{structured_instructions(request.capabilities, request.output_schema)}"
    elif request.output_schema is not None:
        text = f"{text}\n\n{_final_instructions(request.output_schema)}"
    return text.strip()


def _turn_messages(turn: Turn, interface: DecisionInterface) -> list[Item]:
    """An earlier chat turn; its trace as complete call/result pairs (or data)."""
    out = [user(turn.user)]
    if turn.trace and interface == "structured":
        out.append(user(trace_text(turn.trace)))
    else:
        for group in turn.trace:
            if not group:
                continue
            calls = [_tool_call(c.call_id, c.name, c.arguments) for c in group]
            out.append({"role": "assistant", "content": "", "tool_calls": calls})
            out.extend(_tool_result(c.call_id, observation_payload(c)) for c in group)
    if turn.replies:
        out.append(assistant("\n\n".join(turn.replies)))
    return out


def _replayable(decision: DecisionMessage, interface: DecisionInterface) -> Item | None:
    """The assistant message this provider returned, if it can go back as it is.

    Only this provider's own message, whose tool calls are exactly the
    decision's calls (another provider's data is never sent).
    """
    message = decision.opaque
    if decision.provider != PROVIDER or not isinstance(message, dict):
        return None
    if message.get("role") != "assistant":
        return None
    calls = message.get("tool_calls") or []
    if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
        return None
    expected = [c.call_id for c in decision.calls] if interface == "native" else []
    if [c.get("id") for c in calls] != expected:
        return None
    replay = dict(message)
    if replay.get("content") is None:
        replay["content"] = ""  # never null nor missing (see the module notes)
    return replay


def _decision_messages(
    decision: DecisionMessage,
    interface: DecisionInterface,
    projected: Mapping[str, Mapping[str, JSON]],
) -> list[Item]:
    replay = _replayable(decision, interface)
    if replay is not None:
        return [replay]
    # From the neutral fields (opaque_refs continuity, another provider's
    # decision): the runtime's projected arguments wherever an observation
    # gives them, never the model's raw ones.
    calls = projected_calls(decision, projected)
    if interface == "structured":
        return [assistant(structured_decision_json(replace(decision, calls=calls)))]
    out: Item = {"role": "assistant"}
    if decision.text is not None:
        out["content"] = decision.text
    elif decision.final:
        out["content"] = input_text(decision.output)
    out.setdefault("content", "")  # never missing (see the module notes)
    if calls:
        out["tool_calls"] = [_tool_call(c.call_id, c.name, c.arguments) for c in calls]
    return [out]


def _exchange_messages(exchange: Sequence[Message], interface: DecisionInterface) -> list[Item]:
    return exchange_items(exchange, interface, _decision_messages, _tool_result)


def _merge_user_texts(messages: list[Item]) -> list[Item]:
    """One user message for consecutive user texts (strict chat templates)."""
    out: list[Item] = []
    for message in messages:
        previous = out[-1] if out else None
        if (
            previous is not None
            and message.get("role") == "user"
            and previous.get("role") == "user"
            and isinstance(message.get("content"), str)
            and isinstance(previous.get("content"), str)
        ):
            out[-1] = user(f"{previous['content']}\n\n{message['content']}")
        else:
            out.append(message)
    return out


def chat_messages(plan: Plan, memo: ExchangeMemo[list[Item]] | None = None) -> list[Item]:
    """System, prior turns, the invocation input, the summary, then the exchanges (each
    taken from ``memo`` when it rendered that very exchange before)."""
    system = _system(plan.request, plan.interface)
    messages: list[Item] = [{"role": "system", "content": system}] if system else []
    messages.extend(plan_items(plan, memo, _turn_messages, _exchange_messages))
    return _merge_user_texts(messages)


# response --------------------------------------------------------------------


def _unfenced(text: str) -> str:
    """The text inside one surrounding Markdown code fence, if that is all there is."""
    match = _FENCE.match(text.strip())
    return match.group(1) if match else text


def _parse_call(raw: Any, index: int, total: int) -> tuple[CapabilityCall, Item]:
    """One ``tool_calls`` entry; also returns it with an id when the server gave none."""
    where = f"tool call {index + 1} of {total}"
    if not isinstance(raw, dict) or not isinstance(raw.get("function"), dict):
        raise violation(f"{where} has no function object", "bad_call")
    kind = raw.get("type", "function")
    if kind != "function":
        raise violation(
            f"{where} has type {kind!r}; touba offers function tools only", "unexpected_tool_call"
        )
    function = raw["function"]
    name, arguments = function.get("name"), function.get("arguments")
    if not isinstance(name, str) or not name:
        raise violation(f"{where} has no function name", "bad_call")
    if isinstance(arguments, str):
        if not arguments.strip():
            arguments = "{}"  # some servers send "" for a call without arguments
        try:
            value = json.loads(arguments, strict=False)  # see Lenient JSON above
        except json.JSONDecodeError as e:
            raise violation(
                f"the arguments the model wrote for {name!r} ({where}) are not valid JSON "
                f"({e.msg} at char {e.pos}); small local models often write malformed tool "
                "calls: try a model tuned for tool use, a lower temperature, or "
                "decision_interface='structured'",
                "invalid_json",
            ) from e
    else:
        value = arguments
    if not isinstance(value, dict):
        raise violation(f"the arguments for {name!r} ({where}) are not a JSON object", "bad_call")
    call_id = raw.get("id")
    if not isinstance(call_id, str) or not call_id:
        # The server issued no id; one is needed to pair the result with the call.
        call_id = f"call_{uuid.uuid4().hex[:24]}"
        raw = {**raw, "id": call_id}
    return CapabilityCall(call_id, name, value), raw


def _final_output(text: str, output_schema: Mapping[str, JSON]) -> JSON:
    """The native final answer when ``output_schema`` asks for JSON."""
    try:
        return json.loads(_unfenced(text), strict=False)
    except json.JSONDecodeError as e:
        if schema_validator(output_schema, "output_schema").is_valid(text.strip()):
            return text.strip()  # a plain text answer to a string schema
        raise violation(
            f"the final answer is not valid JSON ({e.msg} at char {e.pos}) but output_schema "
            "asks for a JSON value; small local models often add prose around it: try "
            "decision_interface='structured' or a model that follows formats better",
            "invalid_json",
        ) from e


def _check_finish(finish: Any, message: Mapping[str, Any]) -> None:
    if finish == "length":
        raise violation(
            "the model stopped at the output token limit before its decision was complete; "
            "raise max_output_tokens (thinking models spend tokens on reasoning first) or "
            "check the server's context size",
            "truncated_output",
        )
    if finish == "content_filter":
        raise violation("the server's content filter blocked the answer", "blocked")
    refusal = message.get("refusal")
    if isinstance(refusal, str) and refusal.strip():
        raise violation("the model refused to answer", "refusal")


def parse_completion(
    data: Any, *, interface: DecisionInterface, output_schema: Mapping[str, JSON] | None
) -> tuple[DecisionMessage, Usage]:
    """A chat completion into a neutral decision keeping the assistant message.

    Raises :class:`AgentDecisionProviderSchemaViolation` when the answer holds
    no valid decision (messages name what failed, never the content), and
    :class:`AgentDecisionProviderUnavailable` when it is not a chat completion.
    """
    choices = data.get("choices") if isinstance(data, Mapping) else None
    choice = choices[0] if isinstance(choices, list) and choices else None
    message = choice.get("message") if isinstance(choice, Mapping) else None
    if not isinstance(choice, Mapping) or not isinstance(message, Mapping):
        raise AgentDecisionProviderUnavailable(
            "the server's answer is not a chat completion (no choices[0].message); check "
            "that base_url points to an OpenAI-compatible API, usually ending in /v1"
        )
    _check_finish(choice.get("finish_reason"), message)
    kept: Item = {k: v for k, v in message.items() if v is not None}
    kept["role"] = "assistant"
    raw_calls = message.get("tool_calls") or []
    if not isinstance(raw_calls, list):
        raise violation("the message's tool_calls is not a list", "bad_call")
    if not raw_calls:
        kept.pop("tool_calls", None)  # an empty list sent back is refused by strict servers
    content = message.get("content")
    text = content if isinstance(content, str) and content.strip() else None
    if interface == "structured":
        if raw_calls:
            raise violation(
                "the model called a tool although the structured interface offers none",
                "unexpected_tool_call",
            )
        decision = parse_structured_text(
            _unfenced(text) if text is not None else None, strict=False
        )
    elif raw_calls:
        parsed = [_parse_call(raw, i, len(raw_calls)) for i, raw in enumerate(raw_calls)]
        kept["tool_calls"] = [item for _, item in parsed]
        decision = DecisionMessage(text=text, calls=tuple(call for call, _ in parsed))
    elif text is None:
        reasoned = any(isinstance(message.get(k), str) for k in ("reasoning_content", "reasoning"))
        hint = (
            " (it wrote only reasoning: raise max_output_tokens or check the server's "
            "reasoning parser)"
            if reasoned
            else ""
        )
        raise violation(f"the model returned neither tool calls nor text{hint}", "empty_output")
    elif output_schema is None:
        decision = DecisionMessage(text=text, output=text, final=True)
    else:
        decision = DecisionMessage(output=_final_output(text, output_schema), final=True)
    counted = usage(data, "prompt_tokens", "completion_tokens")
    return replace(decision, provider=PROVIDER, opaque=kept), counted


# streaming ---------------------------------------------------------------------


def _merge_call(calls: dict[int, Item], position: int, raw: Any) -> tuple[int, Item, bool]:
    """Fold one ``delta.tool_calls`` entry into ``calls`` (by its ``index``); whether
    it named the call for the first time."""
    if not isinstance(raw, Mapping):
        raise violation("a streamed tool call is not an object", "bad_call")
    index = raw.get("index", position)
    if not isinstance(index, int) or isinstance(index, bool):
        raise violation("a streamed tool call has no integer index", "bad_call")
    call = calls.setdefault(index, {})
    named = False
    if isinstance(raw.get("id"), str) and raw["id"]:
        call["id"] = raw["id"]
    if isinstance(raw.get("type"), str):
        call["type"] = raw["type"]
    function = raw.get("function")
    if isinstance(function, Mapping):
        target = call.setdefault("function", {})
        name, arguments = function.get("name"), function.get("arguments")
        if isinstance(name, str) and name and "name" not in target:
            target["name"] = name
            named = True
        if isinstance(arguments, str):
            target["arguments"] = target.get("arguments", "") + arguments
    return index, call, named


async def read_chat_stream(events: AsyncIterable[Any], sink: DeltaSink) -> dict[str, Any]:
    """Chat Completions chunks (``stream: true``) merged into the completion body the
    non-streaming request answers, for :func:`parse_completion`.

    The first choice's deltas are joined: string fields concatenated (``content``,
    ``reasoning_content``...), ``tool_calls`` merged by index, the rest kept;
    ``usage`` comes from the last chunk (``stream_options.include_usage``).
    Content pieces and named tool calls go to ``sink`` as they arrive. A stream
    without a ``finish_reason`` is a schema violation.
    """
    texts: dict[str, list[str]] = {}
    lists: dict[str, list[Any]] = {}
    others: dict[str, Any] = {}
    calls: dict[int, Item] = {}
    started = 0
    finish: Any = None
    found_usage: Any = None
    async for chunk in events:
        if not isinstance(chunk, Mapping):
            continue
        if isinstance(chunk.get("usage"), Mapping):
            found_usage = chunk["usage"]
        for choice in chunk.get("choices") or ():
            if not isinstance(choice, Mapping) or choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta")
            for key, value in delta.items() if isinstance(delta, Mapping) else ():
                if key == "tool_calls" and isinstance(value, list):
                    for position, raw in enumerate(value):
                        _, call, named = _merge_call(calls, position, raw)
                        if named:
                            await sink(
                                StreamedCall(started, call["function"]["name"], call.get("id"))
                            )
                            started += 1
                elif key == "role" or value is None:
                    continue
                elif isinstance(value, str):
                    texts.setdefault(key, []).append(value)
                    if key == "content" and value:
                        await sink(StreamedText(value))
                elif isinstance(value, list):
                    lists.setdefault(key, []).extend(value)
                else:
                    others[key] = value
            if choice.get("finish_reason") is not None:
                finish = choice["finish_reason"]
    if finish is None:
        raise incomplete_stream(
            "OpenAI-compatible",
            "a local server may end a running stream when another request arrives "
            "(llama-cpp-python does unless started with --interrupt_requests False)",
        )
    message: Item = {"role": "assistant", **others, **lists}
    # a field whose deltas were all empty ("content": "" first, then tool calls) is absent
    message.update({key: "".join(parts) for key, parts in texts.items() if any(parts)})
    message.setdefault("content", None)
    if calls:
        message["tool_calls"] = [calls[index] for index in sorted(calls)]
    completion: dict[str, Any] = {
        "choices": [{"index": 0, "message": message, "finish_reason": finish}]
    }
    if found_usage is not None:
        completion["usage"] = found_usage
    return completion


# the wire ----------------------------------------------------------------------


def _display_url(base_url: str) -> str:
    """``base_url`` without credentials or query, for error messages."""
    parts = urlsplit(base_url)
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    return f"{parts.scheme}://{host}{parts.path}"


def _status_hint(status: int, retryable: bool) -> str:
    if status in (401, 403):
        return "pass api_key= (or default_headers=) as the server expects"
    if status == 404:
        return (
            "check that base_url ends where the API starts (usually /v1) and that the model "
            "is available on the server"
        )
    if status in (400, 422):
        return (
            "the server refused the request: check that the model supports tool calling and "
            "the server enables it (vLLM --enable-auto-tool-choice, llama.cpp --jinja), that "
            "the prompt fits its context size, and for decision_interface='structured' try "
            "structured_format='json_object_schema' (llama-cpp-python) or 'json_object'"
        )
    if status == 429:
        return "the server is rate limiting or busy: retry later"
    if not retryable and status < 500:
        return "the server refused the request (see its message): a retry will not help"
    if not retryable:
        return (
            "the server could not take this request (a request validation or chat template "
            "error, see its message): the same request fails again, so a retry will not help; "
            "check that the server's chat format supports tool calls, and for "
            "decision_interface='structured' the structured_format it accepts "
            "(llama-cpp-python: 'json_object_schema')"
        )
    if status < 500:
        return "the server timed out or saw a conflict: retry later"
    return "the server is overloaded or failed: retry later"


class CompatibleWire(Wire):
    """Chat Completions through ``openai.AsyncOpenAI``, built on first use."""

    provider: ClassVar[str] = PROVIDER
    streams: ClassVar[bool] = True

    def __init__(
        self,
        *,
        model: str,
        interface: DecisionInterface,
        base_url: str,
        api_key: str | None,
        max_output_tokens: int | None,
        structured_format: StructuredFormat,
        options: Mapping[str, Any],
        timeout: float | None,
        headers: Mapping[str, str],
    ) -> None:
        super().__init__(model=model, interface=interface)
        self._base_url = base_url
        self._api_key = api_key
        self._max_output_tokens = max_output_tokens
        self._structured_format = structured_format
        self._options = dict(options)
        self._timeout = timeout
        self._headers = dict(headers)
        self._client: AsyncOpenAI | None = None
        self._call_options: dict[str, Any] | None = None  # built once (see generate)
        self._exchanges: ExchangeMemo[list[Item]] = ExchangeMemo(_exchange_messages)

    def __repr__(self) -> str:  # never shows the key
        return f"CompatibleWire(model={self.model!r}, base_url={_display_url(self._base_url)!r})"

    def check_guard(self) -> None:
        """Wire.check_guard: always ProviderContextGuardUnsupported (no count endpoint)."""
        raise ProviderContextGuardUnsupported(f"{_NO_COUNT}: the context guard cannot count")

    def render(self, plan: Plan) -> dict[str, Any]:
        """Wire.render: a Chat Completions body (``messages``, ``tools`` or ``response_format``)."""
        request = plan.request
        body = _Body(model=self.model, messages=chat_messages(plan, self._exchanges))
        body.output_schema = request.output_schema
        if plan.interface == "native":
            if request.capabilities:
                body["tools"] = function_tools(request.capabilities)
        elif self._structured_format == "json_object":
            body["response_format"] = {"type": "json_object"}
        elif self._structured_format == "json_object_schema":  # held by the server's grammar
            schema = enforced_structured_schema(request.capabilities, request.output_schema)
            body["response_format"] = {"type": "json_object", "schema": schema}
        else:
            schema = structured_schema(request.capabilities, request.output_schema)
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": DECISION_FORMAT, "schema": schema},
            }
        if self._max_output_tokens is not None:
            body["max_tokens"] = self._max_output_tokens
        for key, value in self._options.items():
            if key not in _TOOL_OPTIONS or "tools" in body:
                body[key] = value
        return body

    async def count(self, body: dict[str, Any]) -> int:
        """Wire.count: always ProviderContextGuardUnsupported (no standard count endpoint)."""
        raise ProviderContextGuardUnsupported(f"{_NO_COUNT}: the context guard cannot count")

    def _sdk_client(self) -> AsyncOpenAI:
        if self._client is None:
            import openai

            headers = dict(self._headers)
            if self._api_key is not None:
                # Explicit, so an Authorization line of OPENAI_CUSTOM_HEADERS cannot win.
                headers["Authorization"] = f"Bearer {self._api_key}"
            self._client = openai.AsyncOpenAI(
                base_url=self._base_url,
                api_key=self._api_key or _NO_KEY,
                max_retries=0,
                # its own timeout (the SDK's default without one), at most the deadline
                timeout=capped_timeout(
                    self._timeout if self._timeout is not None else openai.DEFAULT_TIMEOUT,
                    self.deadline_seconds,
                ),
                default_headers=headers,
            )
        return self._client

    def _request_headers(self) -> dict[str, Any]:
        """Per request: drop what the SDK would take from OPENAI_* variables."""
        from openai import Omit

        given = {name.lower() for name in self._headers}
        dropped = ["OpenAI-Organization", "OpenAI-Project"]
        if self._api_key is None:
            dropped.append("Authorization")
        return {name: Omit() for name in dropped if name.lower() not in given}

    async def generate(
        self, body: dict[str, Any], sink: DeltaSink | None = None
    ) -> tuple[DecisionMessage, Usage]:
        """Wire.generate: ``POST {base_url}/chat/completions``; SDK errors become touba's.

        With ``sink``: ``stream: true`` (usage included), read through the SDK's
        ``AsyncStream`` and merged by :func:`read_chat_stream`.
        """
        import openai

        where = _display_url(self._base_url)
        if self._call_options is None:  # the same for every request of this wire
            # the typed method's auth scope: the API key only, never an admin key
            self._call_options = {**request_options(), "headers": self._request_headers()}
        options: Any = self._call_options
        try:
            # The rendered body as it is, through the client's low-level post: the typed
            # chat.completions.create would transform it again into the same JSON.
            if sink is None:
                text = await self._sdk_client().post(
                    "/chat/completions",
                    body=dict(body),
                    cast_to=str,
                    options=options,
                )
            else:
                stream = await self._sdk_client().post(
                    "/chat/completions",
                    body={**body, "stream": True, "stream_options": {"include_usage": True}},
                    cast_to=object,
                    options=options,
                    stream=True,
                    stream_cls=openai.AsyncStream[object],
                )
                async with stream:  # closed on any exit, a cancelled decide included
                    data: Any = await read_chat_stream(Paced(stream), sink)
        except openai.APIStatusError as e:
            code = getattr(e, "code", None)
            safe = isinstance(code, str | int) and _SAFE_CODE.match(str(code))
            shown = f", code {code}" if safe else ""
            said = body_message(e.body)
            retryable = retry_can_help(e.status_code, said, getattr(e, "type", None))
            raise AgentDecisionProviderUnavailable(
                f"the OpenAI-compatible server at {where} answered HTTP {e.status_code}{shown}; "
                f"{_status_hint(e.status_code, retryable)}; nothing was stored",
                status_code=e.status_code,
                server_message=said,
                retryable=retryable,
            ) from e
        except openai.APITimeoutError as e:
            raise AgentDecisionProviderUnavailable(
                f"the OpenAI-compatible server at {where} did not answer in time; raise the "
                "timeout option or check the server; nothing was stored"
            ) from e
        except openai.APIConnectionError as e:
            raise AgentDecisionProviderUnavailable(
                f"could not reach the OpenAI-compatible server at {where}; check that it is "
                "running and that base_url is right; nothing was stored"
            ) from e
        except openai.APIResponseValidationError as e:
            raise AgentDecisionProviderUnavailable(
                f"the openai SDK failed talking to {where} ({type(e).__name__}); nothing was stored"
            ) from e
        except openai.APIError as e:  # an error event inside the stream
            said = body_message(e.body)
            retryable = retry_can_help(500, said, getattr(e, "type", None))
            hint = "retry later" if retryable else _status_hint(500, retryable)
            raise AgentDecisionProviderUnavailable(
                f"the OpenAI-compatible server at {where} sent an error while streaming; {hint}; "
                "nothing was stored",
                server_message=said,
                retryable=retryable,
            ) from e
        except openai.OpenAIError as e:
            raise AgentDecisionProviderUnavailable(
                f"the openai SDK failed talking to {where} ({type(e).__name__}); nothing was stored"
            ) from e
        if sink is None:
            try:
                data = json.loads(text)
            except ValueError:
                data = None  # parse_completion names what is missing
        output_schema = body.output_schema if isinstance(body, _Body) else None
        return parse_completion(data, interface=self.interface, output_schema=output_schema)

    async def aclose(self) -> None:
        """Close the SDK client this wire built (if it built one)."""
        client, self._client = self._client, None
        if client is not None:
            await client.close()


# the factory -------------------------------------------------------------------


def _check_options(
    options: dict[str, Any], interface: DecisionInterface, max_output_tokens: int | None
) -> None:
    for key in options:
        if key in _OWNED:
            raise ConfigurationError(f"{key!r} cannot be given as an option: {_OWNED[key]}")
        if key in _LEGACY:
            raise ConfigurationError(
                f"{key!r} is the legacy function-calling API; touba sends tools itself"
            )
        if key in ("extra_body", "extra_headers", "extra_query"):
            raise ConfigurationError(
                f"{key!r} is not an option: pass server-specific body fields directly as "
                "keyword options (e.g. top_k=20), and headers as default_headers="
            )
        if key in _TOOL_OPTIONS and interface == "structured":
            raise ConfigurationError(
                f"{key!r} needs tools, and decision_interface='structured' sends none"
            )
    if "max_tokens" in options:
        raise ConfigurationError(
            "pass max_output_tokens=, which touba sends as max_tokens, instead of max_tokens"
        )
    if "max_completion_tokens" in options and max_output_tokens is not None:
        raise ConfigurationError(
            "give either max_output_tokens (sent as max_tokens) or max_completion_tokens"
        )


def _check_headers(headers: Any, api_key: str | None) -> dict[str, str]:
    if headers is None:
        return {}
    if not isinstance(headers, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in headers.items()
    ):
        raise ConfigurationError("default_headers must be a mapping of str to str")
    if api_key is not None and any(k.lower() == "authorization" for k in headers):
        raise ConfigurationError(
            "give the key either as api_key= or as an Authorization header, not both"
        )
    return dict(headers)


def _check_timeout(timeout: Any) -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
        raise ConfigurationError(f"timeout must be a positive number of seconds, got {timeout!r}")
    return float(timeout)


def _check_base_url(base_url: Any) -> str:
    parts = urlsplit(base_url) if isinstance(base_url, str) else None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigurationError(
            "base_url must be the server's http(s) API root, e.g. http://localhost:11434/v1 "
            "(Ollama), http://localhost:8000/v1 (vLLM) or http://localhost:8080/v1 (llama.cpp)"
        )
    return base_url  # type: ignore[no-any-return]


def create_openai_compatible_decision_provider(
    *,
    model: str,
    base_url: str,
    api_key: str | None = None,
    decision_interface: DecisionInterface = "native",
    history: HistoryConfig | bool | None = None,
    max_output_tokens: int | None = None,
    deadline_seconds: float = PROVIDER_DEADLINE_SECONDS,
    **options: Any,
) -> DecisionProvider:
    """A provider speaking Chat Completions to an OpenAI-compatible server.

    See the module docstring for keys, options and the choices made where
    servers differ. There is no context guard: ``context=`` is refused.

    ``deadline_seconds`` (default 120) bounds each request: no answer within it (for a
    stream, no event within it) is ``AgentDecisionProviderUnavailable``, retryable.
    """
    if "context" in options:
        raise ConfigurationError(
            f"context= is not supported by create_openai_compatible_decision_provider: "
            f"{_NO_COUNT} (Ollama, vLLM, llama.cpp), so the context guard cannot count the "
            "request; bound history with HistoryConfig(max_messages=..., max_bytes=...) and "
            "the server's own context size instead"
        )
    if "client" in options:
        raise ConfigurationError(
            "create_openai_compatible_decision_provider builds its own client from base_url "
            "and api_key (client= is not accepted); for api.openai.com with your own client "
            "use create_openai_decision_provider"
        )
    try:
        import openai  # noqa: F401
    except ImportError as e:
        raise ImportError(
            'the OpenAI-compatible provider needs the openai SDK: pip install "touba[openai]"'
        ) from e
    if not isinstance(model, str) or not model:
        raise ConfigurationError("model must be a non-empty str (the server's model name)")
    base_url = _check_base_url(base_url)
    if api_key is not None and (not isinstance(api_key, str) or not api_key):
        raise ConfigurationError("api_key must be a non-empty str, or None for no key")
    if decision_interface not in get_args(DecisionInterface):
        raise ConfigurationError(
            f"decision_interface must be 'native' or 'structured', got {decision_interface!r}"
        )
    structured_format = options.pop("structured_format", "json_schema")
    if structured_format not in get_args(StructuredFormat):
        raise ConfigurationError(
            "structured_format must be 'json_schema', 'json_object' or 'json_object_schema', "
            f"got {structured_format!r}"
        )
    if structured_format != "json_schema" and decision_interface != "structured":
        raise ConfigurationError("structured_format applies to decision_interface='structured'")
    timeout = _check_timeout(options.pop("timeout", None))
    headers = _check_headers(options.pop("default_headers", None), api_key)
    _check_options(options, decision_interface, max_output_tokens)
    wire = CompatibleWire(
        model=model,
        interface=decision_interface,
        base_url=base_url,
        api_key=api_key,
        max_output_tokens=max_output_tokens,
        structured_format=structured_format,
        options=options,
        timeout=timeout,
        headers=headers,
    )
    return DecisionProvider(
        wire,
        history=history,
        max_output_tokens=max_output_tokens,
        deadline_seconds=deadline_seconds,
    )

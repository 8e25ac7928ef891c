"""The Anthropic Messages wire format: pure conversion, no SDK, no I/O.

``render_messages`` turns a :class:`~touba.providers._base.Plan` into the
``messages`` array; ``parse_message`` turns a response body back into a
neutral :class:`DecisionMessage`; ``prefix_digest`` fingerprints what a
decision's thinking blocks were produced after (see ``anthropic.py`` for the
replay rule this enables).

Wire rules kept here: ``tool_use`` blocks live in the assistant message and
every ``tool_result`` comes first in the next user message; consecutive user
contents merge into one message (tool results first); the first message is a
user message and the last one too (no prefill); our own opaque content is
replayed exactly, thinking blocks included, unless its prefix went stale.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
from collections.abc import AsyncIterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from touba.errors import ConfigurationError
from touba.history._model import (
    DataMessage,
    DecisionMessage,
    Message,
    ResultMessage,
    SummaryMessage,
    canonical_json,
)
from touba.providers._framing import (
    data_text,
    input_text,
    invalid_json,
    observation_payload,
    parse_structured,
    results_text,
    structured_decision_json,
    summary_text,
    trace_text,
    violation,
)
from touba.providers._memo import ExchangeMemo
from touba.providers._stream import (
    DeltaSink,
    StreamedCall,
    StreamedText,
    ignore_event,
    incomplete_stream,
)
from touba.providers._types import CapabilityCall, DecisionInterface, TraceCall, Turn
from touba.providers._validate import schema_validator

__all__ = [
    "DECISION_TOOL",
    "PROVIDER",
    "parse_message",
    "exchange_memo",
    "prefix_digest",
    "read_message_stream",
    "render_messages",
]

PROVIDER = "anthropic"
DECISION_TOOL = "touba_decision"
"""The one tool of the structured interface (forced with ``tool_choice`` unless thinking is on)."""

ThinkingMode = Literal["enabled", "adaptive", "disabled"] | None

_THINKING = frozenset({"thinking", "redacted_thinking"})
_TOOL_ID = re.compile(r"^[a-zA-Z0-9_-]+$")
_TRUNCATED = frozenset({"max_tokens", "model_context_window_exceeded"})
_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)


# prefix digests ----------------------------------------------------------------


def _feed(digest: Any, value: Any) -> None:
    """Key order is not meaningful (stores such as PostgreSQL JSONB reorder it)."""
    digest.update(_digest_text(value).encode("utf-8"))
    digest.update(b"\n")


def _digest_text(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


def _message_text(message: dict[str, Any], texts: Mapping[int, str]) -> str:
    """:func:`_digest_text` of a message, from the known texts of its blocks.

    A message is ``{"role": ..., "content": [blocks]}``; sorted, ``content``
    comes first, and the default separators put ``", "`` between the items,
    so the text is put together from each block's own text (``texts``, by the
    block's id, for blocks a memo entry keeps alive) without serialising them
    again. Anything else is serialised whole.
    """
    content, role = message.get("content"), message.get("role")
    if len(message) != 2 or type(content) is not list or type(role) is not str:
        return _digest_text(message)
    blocks = ", ".join([texts.get(id(block)) or _digest_text(block) for block in content])
    return f'{{"content": [{blocks}], "role": {_ROLES.get(role) or _digest_text(role)}}}'


_ROLES = {role: _digest_text(role) for role in ("user", "assistant")}


def _hasher(system: Any, tools: Any) -> Any:
    digest = hashlib.sha256()
    _feed(digest, system)
    _feed(digest, tools)
    return digest


def prefix_digest(system: Any, tools: Any, messages: Sequence[Any]) -> str:
    """What a block generated after ``messages`` is bound to: system, tools, messages."""
    digest = _hasher(system, tools)
    for message in messages:
        _feed(digest, message)
    return "sha256:" + str(digest.hexdigest())


# rendering --------------------------------------------------------------------


def wire_id(call_id: str) -> str:
    """A call id the API accepts (``^[a-zA-Z0-9_-]+$``), stable for one id."""
    if _TOOL_ID.match(call_id):
        return call_id
    return "toolu_" + hashlib.sha256(call_id.encode("utf-8")).hexdigest()[:24]


def _text(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def _tool_result(call_id: str, content: str, *, error: bool = False) -> dict[str, Any]:
    block: dict[str, Any] = {"type": "tool_result", "tool_use_id": call_id, "content": content}
    if error:
        block["is_error"] = True
    return block


def _result_block(result: ResultMessage | TraceCall) -> dict[str, Any]:
    return _tool_result(
        wire_id(result.call_id),
        canonical_json(observation_payload(result)),
        error=result.status != "ok",
    )


@dataclass
class _Bound:
    """An assistant message replayed from our opaque content."""

    prefix: str | None
    fallback: list[dict[str, Any]]


@dataclass
class _Builder:
    """Messages in order, merging consecutive user contents (tool results first)."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    bound: dict[int, _Bound] = field(default_factory=dict)

    def user(self, blocks: list[dict[str, Any]]) -> None:
        if not blocks:
            return
        if self.messages and self.messages[-1]["role"] == "user":
            blocks = self.messages.pop()["content"] + blocks
        results = [b for b in blocks if b.get("type") == "tool_result"]
        others = [b for b in blocks if b.get("type") != "tool_result"]
        self.messages.append({"role": "user", "content": results + others})

    def assistant(self, blocks: list[dict[str, Any]], bound: _Bound | None = None) -> None:
        if not self.messages or self.messages[-1]["role"] != "user":
            raise ConfigurationError(
                "the Anthropic Messages API needs a user message before each assistant turn; "
                "pass DecisionRequest.input (the invocation input is sent first)"
            )
        if bound is not None:
            self.bound[len(self.messages)] = bound
        self.messages.append({"role": "assistant", "content": blocks})


def _turn(builder: _Builder, turn: Turn, *, trace_as_data: bool) -> None:
    builder.user([_text(turn.user)] if turn.user else [])
    if turn.trace and trace_as_data:
        builder.user([_text(trace_text(turn.trace))])
    elif turn.trace:
        for group in (g for g in turn.trace if g):  # no empty assistant message
            builder.assistant(
                [
                    {
                        "type": "tool_use",
                        "id": wire_id(c.call_id),
                        "name": c.name,
                        "input": dict(c.arguments),
                    }
                    for c in group
                ]
            )
            builder.user([_result_block(c) for c in group])
    if turn.replies:
        builder.assistant([_text("\n\n".join(turn.replies))])


def _neutral(
    decision: DecisionMessage,
    interface: DecisionInterface,
    projected: Mapping[str, Mapping[str, Any]],
) -> list[dict[str, Any]]:
    """A decision from its neutral fields (no opaque data of ours to replay)."""
    calls = tuple(
        CapabilityCall(c.call_id, c.name, dict(projected.get(c.call_id, c.arguments)))
        for c in decision.calls
    )
    if interface == "structured":
        return [_text(structured_decision_json(replace(decision, calls=calls)))]
    blocks: list[dict[str, Any]] = []
    if decision.text:
        blocks.append(_text(decision.text))
    elif decision.final:
        blocks.append(_text(input_text(decision.output)))
    blocks.extend(
        {"type": "tool_use", "id": wire_id(c.call_id), "name": c.name, "input": dict(c.arguments)}
        for c in calls
    )
    return blocks


def _opaque_content(decision: DecisionMessage) -> list[dict[str, Any]] | None:
    opaque = decision.opaque
    if decision.provider != PROVIDER or not isinstance(opaque, Mapping):
        return None
    content = opaque.get("content")
    if not isinstance(content, list) or not content:
        return None
    if not all(isinstance(block, Mapping) for block in content):
        return None
    return copy.deepcopy(content)


@dataclass(frozen=True)
class _Rendered:
    """One exchange rendered: the builder calls it makes, and its blocks' digest texts."""

    ops: tuple[tuple[str, list[dict[str, Any]], _Bound | None], ...]
    texts: dict[int, str]


def _exchange(exchange: tuple[Message, ...], interface: DecisionInterface) -> _Rendered:
    decision: DecisionMessage | None = None
    content: list[dict[str, Any]] | None = None
    results = [m for m in exchange if isinstance(m, ResultMessage)]
    projected = {r.call_id: r.arguments for r in results}
    ops: list[tuple[str, list[dict[str, Any]], _Bound | None]] = []
    for message in exchange:
        if isinstance(message, DataMessage):
            ops.append(("user", [_text(data_text(message))], None))
        elif isinstance(message, SummaryMessage):  # never inside an exchange; kept total
            ops.append(("user", [_text(summary_text(message))], None))
        elif isinstance(message, DecisionMessage):
            decision = message
            fallback = _neutral(message, interface, projected)
            content = _opaque_content(message)
            if content is None:
                ops.append(("assistant", fallback, None))
            else:
                prefix = message.opaque.get("prefix")
                bound = _Bound(prefix if isinstance(prefix, str) else None, fallback)
                ops.append(("assistant", content, bound))
    if results and interface == "native":
        ops.append(("user", [_result_block(r) for r in results], None))
    elif results:
        uses = [b for b in content or () if b.get("type") == "tool_use"]
        text = results_text(results)
        if decision is None or not uses:
            ops.append(("user", [_text(text)], None))
        else:
            # Our structured decision was a call of the decision tool: its results answer it.
            ops.append(("user", [_tool_result(str(b.get("id")), text) for b in uses[:1]], None))
            ignored = [_tool_result(str(b.get("id")), "[touba: ignored]") for b in uses[1:]]
            ops.append(("user", ignored, None))
    texts: dict[int, str] = {}
    for _, blocks, binding in ops:
        for block in [*blocks, *(binding.fallback if binding is not None else ())]:
            texts[id(block)] = _digest_text(block)
    return _Rendered(tuple(ops), texts)


def exchange_memo() -> ExchangeMemo[_Rendered]:
    """A wire's memo of rendered exchanges (see :mod:`touba.providers._memo`)."""
    return ExchangeMemo(_exchange)


def _continuation(messages: list[dict[str, Any]]) -> int | None:
    """Index of the final assistant message when the last user message answers its tools."""
    if len(messages) < 2 or messages[-2]["role"] != "assistant":
        return None
    last = messages[-1]["content"]
    if any(b.get("type") == "tool_result" for b in last):
        return len(messages) - 2
    return None


def _strip_stale(
    builder: _Builder, system: Any, tools: Any, thinking: ThinkingMode, texts: Mapping[int, str]
) -> tuple[list[dict[str, Any]], str]:
    """Drop thinking blocks whose prefix changed since they were produced.

    A thinking block is valid only after exactly the prefix it was generated
    with; once any earlier content differs, it and every later block are
    invalid (the running digest changes with each stripped message too). The
    one exception is the assistant turn a tool-use continuation answers with
    ``thinking.type == "enabled"``: the API requires it to start with its
    thinking block, so it is kept (see the module docstring of anthropic.py).
    """
    messages = builder.messages
    continuation = _continuation(messages)
    digest = _hasher(system, tools)
    for index, message in enumerate(messages):
        bound = builder.bound.get(index)
        if bound is not None:
            current = "sha256:" + str(digest.hexdigest())
            required = index == continuation and thinking == "enabled"
            if bound.prefix != current and not required:
                kept = [b for b in message["content"] if b.get("type") not in _THINKING]
                message["content"] = kept or bound.fallback
        digest.update(_message_text(message, texts).encode("utf-8"))
        digest.update(b"\n")
    return messages, "sha256:" + str(digest.hexdigest())


def render_messages(
    *,
    prior_turns: Sequence[Turn],
    request_input: Any,
    summary: SummaryMessage | None,
    exchanges: Sequence[_Rendered],
    interface: DecisionInterface,
    system: Any,
    tools: Any,
    thinking: ThinkingMode,
) -> tuple[list[dict[str, Any]], str]:
    """The ``messages`` array, in SPEC order, valid for the Messages API, and its
    :func:`prefix_digest` (computed on the way: the array is hashed once).

    ``exchanges`` are the window's, rendered (see :func:`exchange_memo`)."""
    builder = _Builder()
    # With thinking enabled, the tool_use turn that the final user turn's tool_result
    # blocks answer must start with a thinking block, which a chat trace lacks: traced
    # turns after the last reply (whose results would join the new input) go as data.
    replied = max((i for i, t in enumerate(prior_turns) if t.replies), default=-1)
    for index, turn in enumerate(prior_turns):
        trailing = thinking == "enabled" and index > replied
        _turn(builder, turn, trace_as_data=interface == "structured" or trailing)
    if request_input is not None and request_input != "":
        builder.user([_text(input_text(request_input))])
    if summary is not None:
        builder.user([_text(summary_text(summary))])
    texts: dict[int, str] = {}
    for rendered in exchanges:
        for role, blocks, bound in rendered.ops:
            if role == "user":
                builder.user(blocks)
            else:
                builder.assistant(list(blocks), bound)
        texts.update(rendered.texts)
    if not builder.messages:
        raise ConfigurationError(
            "nothing to send: the Messages API needs a user message; pass DecisionRequest.input"
        )
    if builder.messages[-1]["role"] != "user":
        raise ConfigurationError(
            "the conversation ends with a final decision and no new input or observation, "
            "which the Messages API would read as a prefill; start a new invocation"
        )
    return _strip_stale(builder, system, tools, thinking, texts)


# parsing ----------------------------------------------------------------------


def _final_output(text: str, output_schema: Mapping[str, Any] | None) -> Any:
    """The native interface's final answer: text, or JSON when a schema is asked."""
    if output_schema is None:
        return text
    stripped = text.strip()
    fenced = _FENCE.match(stripped)
    try:
        return json.loads(fenced.group(1) if fenced else stripped)
    except json.JSONDecodeError as e:
        if schema_validator(output_schema, "output_schema").is_valid(text):
            return text  # a plain string answer to a string schema
        raise invalid_json("the final answer", e) from e


def _calls(content: list[dict[str, Any]]) -> tuple[CapabilityCall, ...]:
    calls = []
    for block in content:
        if block.get("type") != "tool_use":
            continue
        call_id, name, arguments = block.get("id"), block.get("name"), block.get("input")
        if not isinstance(call_id, str) or not isinstance(name, str):
            raise violation("a tool_use block has no id or name", "malformed_response")
        if not isinstance(arguments, dict):
            raise violation(f"the input of {name!r} is not a JSON object", "bad_call")
        calls.append(CapabilityCall(call_id, name, arguments))
    return tuple(calls)


def parse_message(
    data: Any,
    *,
    interface: DecisionInterface,
    output_schema: Mapping[str, Any] | None,
    prefix: str,
) -> DecisionMessage:
    """A Messages API response body into a neutral decision (opaque: its content)."""
    content = data.get("content") if isinstance(data, Mapping) else None
    if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
        raise violation("the response has no content list", "malformed_response")
    stop = data.get("stop_reason")
    if stop == "refusal":
        raise violation("the model refused to answer (stop_reason refusal)", "refusal")
    if stop in _TRUNCATED:
        raise violation(
            f"the answer was cut off (stop_reason {stop}); raise max_output_tokens",
            "truncated_output",
        )
    texts = [
        b["text"] for b in content if b.get("type") == "text" and isinstance(b.get("text"), str)
    ]
    text = "".join(texts) if texts else None
    calls = _calls(content)
    if interface == "structured":
        decisions = [c for c in calls if c.name == DECISION_TOOL]
        if not decisions:
            code = "empty_output" if not (text and text.strip()) else "missing_decision"
            raise violation(f"the model did not call the {DECISION_TOOL} tool", code)
        message = parse_structured(decisions[0].arguments, text=text)
    elif calls:
        message = DecisionMessage(text=text, calls=calls)
    elif text is None or not text.strip():
        raise violation("the model returned neither tool calls nor text", "empty_output")
    else:
        message = DecisionMessage(text=text, output=_final_output(text, output_schema), final=True)
    return replace(message, provider=PROVIDER, opaque={"content": content, "prefix": prefix})


# streaming ---------------------------------------------------------------------

_PASSED = frozenset({"ping", "content_block_stop"})


def _tool_input(raw: str, name: object) -> Any:
    """A tool_use block's input, from its joined ``input_json_delta`` pieces."""
    if not raw.strip():
        return {}
    try:
        return json.loads(raw)
    except json.JSONDecodeError as e:
        raise invalid_json(f"the streamed input of tool {str(name)[:64]!r}", e) from e


def _apply_delta(block: dict[str, Any], delta: Mapping[str, Any], pieces: list[str]) -> str | None:
    """Fold one ``content_block_delta`` into ``block``; the text to report, if any."""
    kind = delta.get("type")
    if kind == "text_delta" and isinstance(delta.get("text"), str):
        block["text"] = block.get("text", "") + delta["text"]
        return str(delta["text"])
    if kind == "input_json_delta" and isinstance(delta.get("partial_json"), str):
        pieces.append(delta["partial_json"])
    elif kind == "thinking_delta" and isinstance(delta.get("thinking"), str):
        block["thinking"] = block.get("thinking", "") + delta["thinking"]
    elif kind == "signature_delta" and isinstance(delta.get("signature"), str):
        block["signature"] = block.get("signature", "") + delta["signature"]
    elif kind == "citations_delta" and isinstance(delta.get("citation"), Mapping):
        block.setdefault("citations", []).append(dict(delta["citation"]))
    else:
        ignore_event(PROVIDER, f"content_block_delta/{kind}")
    return None


async def read_message_stream(events: AsyncIterable[Any], sink: DeltaSink) -> dict[str, Any]:
    """Messages API SSE events (``stream: true``) assembled into the message body the
    non-streaming request answers, for :func:`parse_message`.

    ``message_start`` gives the message, each ``content_block_start`` a block
    its deltas complete (text, tool input JSON, thinking and its signature,
    citations), ``message_delta`` the stop reason and final usage. Text pieces
    and started tool uses go to ``sink``. A stream without ``message_stop``, or
    a tool input that is not valid JSON, is a schema violation; unknown event
    and delta types are ignored (the SDK raises ``error`` events itself).
    """
    message: dict[str, Any] | None = None
    blocks: dict[int, dict[str, Any]] = {}
    inputs: dict[int, list[str]] = {}
    calls = 0
    async for event in events:
        kind = event.get("type") if isinstance(event, Mapping) else None
        if kind == "message_start" and isinstance(event.get("message"), Mapping):
            message = copy.deepcopy(dict(event["message"]))
        elif kind == "content_block_start" and isinstance(event.get("content_block"), Mapping):
            index = event.get("index")
            if not isinstance(index, int) or message is None:
                raise violation("a content block started outside a message", "malformed_response")
            block = copy.deepcopy(dict(event["content_block"]))
            blocks[index] = block
            if block.get("type") == "tool_use":
                inputs[index] = []
                name, call_id = block.get("name"), block.get("id")
                await sink(
                    StreamedCall(
                        calls,
                        name if isinstance(name, str) else "",
                        call_id if isinstance(call_id, str) else None,
                    )
                )
                calls += 1
        elif kind == "content_block_delta" and isinstance(event.get("delta"), Mapping):
            index = event.get("index")
            if not isinstance(index, int) or index not in blocks:
                raise violation("a content delta names no started block", "malformed_response")
            text = _apply_delta(blocks[index], event["delta"], inputs.setdefault(index, []))
            if text:
                await sink(StreamedText(text))
        elif kind == "message_delta" and message is not None:
            delta = event.get("delta")
            if isinstance(delta, Mapping):
                message.update(delta)
            usage = event.get("usage")
            if isinstance(usage, Mapping):
                message["usage"] = {**(message.get("usage") or {}), **usage}
        elif kind == "message_stop" and message is not None:
            for index, block in blocks.items():
                if block.get("type") == "tool_use":
                    block["input"] = _tool_input("".join(inputs[index]), block.get("name"))
            message["content"] = [blocks[index] for index in sorted(blocks)]
            return message
        elif kind not in _PASSED:
            ignore_event(PROVIDER, kind)
    raise incomplete_stream("Anthropic Messages")

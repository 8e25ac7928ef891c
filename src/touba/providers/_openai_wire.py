"""The OpenAI Responses API wire format, as pure functions over plain JSON.

A :class:`~touba.providers._base.Plan` becomes the ``input`` items of
``POST /v1/responses``; a response body becomes a neutral
:class:`DecisionMessage` whose ``opaque`` holds every output item untouched
(reasoning items with their ``encrypted_content``, messages, function calls
with their ids), so the next request replays them exactly, in order, each
reasoning item still directly before the item that follows it.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from touba.errors import AgentDecisionProviderUnavailable
from touba.history._model import (
    JSON,
    CapabilityCall,
    DecisionMessage,
    Message,
    canonical_json,
)
from touba.providers._base import Plan
from touba.providers._framing import (
    invalid_json,
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
    ignore_event,
    incomplete_stream,
)
from touba.providers._types import CapabilitySpec, DecisionInterface, DecisionRequest, Turn, Usage

__all__ = [
    "COUNT_FIELDS",
    "DECISION_FORMAT",
    "ENCRYPTED_REASONING",
    "OUTPUT_FORMAT",
    "PROVIDER",
    "count_body",
    "function_tools",
    "exchange_memo",
    "input_items",
    "instructions",
    "parse_response",
    "read_response_stream",
    "strict_schema",
    "text_format",
]

PROVIDER = "openai"
ENCRYPTED_REASONING = "reasoning.encrypted_content"
DECISION_FORMAT = "touba_decision"
OUTPUT_FORMAT = "touba_output"

COUNT_FIELDS = frozenset(
    {
        "conversation",
        "input",
        "instructions",
        "model",
        "parallel_tool_calls",
        "personality",
        "previous_response_id",
        "reasoning",
        "text",
        "tool_choice",
        "tools",
        "truncation",
    }
)
"""The parameters ``POST /v1/responses/input_tokens`` accepts (it refuses any other)."""


# request ---------------------------------------------------------------------


def function_tools(capabilities: Sequence[CapabilitySpec]) -> list[Item]:
    """The native interface: one function tool per capability (not strict mode:
    capability schemas need not follow its subset; touba validates arguments)."""
    return [
        {
            "type": "function",
            "name": c.name,
            "description": c.description,
            "parameters": dict(c.parameters),
            "strict": False,
        }
        for c in capabilities
    ]


def text_format(request: DecisionRequest, interface: DecisionInterface) -> Item | None:
    """``text.format``: the structured decision, or (native) the final output's schema.

    The native final output is wrapped as ``{"output": ...}`` so any
    ``output_schema`` (not only objects) can be asked for.
    """
    if interface == "structured":
        schema = structured_schema(request.capabilities, request.output_schema)
        strict = strict_schema(schema)
        return {
            "type": "json_schema",
            "name": DECISION_FORMAT,
            "schema": schema if strict is None else strict,
            "strict": strict is not None,
        }
    if request.output_schema is None:
        return None
    return {
        "type": "json_schema",
        "name": OUTPUT_FORMAT,
        "description": "The final answer, in `output`, when no function is called.",
        "schema": {
            "type": "object",
            "properties": {"output": dict(request.output_schema)},
            "required": ["output"],
        },
        "strict": False,
    }


_STRICT_KEYWORDS = frozenset(
    {
        "type",
        "properties",
        "required",
        "additionalProperties",
        "items",
        "anyOf",
        "enum",
        "const",
        "description",
        "title",
        "$ref",
        "$defs",
        "pattern",
        "format",
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
        "multipleOf",
        "minItems",
        "maxItems",
    }
)
_STRICT_FORMATS = frozenset(
    {"date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uuid"}
)


def strict_schema(schema: Mapping[str, Any]) -> dict[str, Any] | None:
    """``schema`` in the dialect of OpenAI's strict mode, or None when it has no
    equivalent there.

    Strict mode wants every object closed (``additionalProperties: false``)
    with all its properties required, and knows a subset of the keywords.
    touba only closes objects (what the model may write then still matches
    ``schema``); a schema with an optional property, an open object, a
    schema-less value (``{}``) or a keyword strict mode lacks stays non-strict,
    because making it strict would change what it accepts (optional turned
    nullable means ``null`` where ``schema`` wants the key absent). Capability
    tools are never strict (see :func:`function_tools`).
    """

    def convert(node: Any) -> Any:
        if not isinstance(node, Mapping) or not node or set(node) - _STRICT_KEYWORDS:
            raise _NotStrict
        if not {"type", "anyOf", "$ref", "enum", "const"} & set(node):
            raise _NotStrict
        if "format" in node and node["format"] not in _STRICT_FORMATS:
            raise _NotStrict
        out = dict(node)
        kinds = node.get("type")
        if kinds == "object" or (isinstance(kinds, list) and "object" in kinds):
            properties = node.get("properties")
            if not isinstance(properties, Mapping) or node.get("additionalProperties", False):
                raise _NotStrict
            if set(node.get("required", ())) != set(properties):
                raise _NotStrict
            out["properties"] = {k: convert(v) for k, v in properties.items()}
            out["required"] = list(properties)
            out["additionalProperties"] = False
        if "items" in node:
            out["items"] = convert(node["items"])
        if "anyOf" in node:
            out["anyOf"] = [convert(v) for v in node["anyOf"]]
        if "$defs" in node:
            out["$defs"] = {k: convert(v) for k, v in node["$defs"].items()}
        return out

    try:
        converted: dict[str, Any] = convert(schema)
    except _NotStrict:
        return None
    return converted


class _NotStrict(Exception):
    pass


def instructions(request: DecisionRequest, interface: DecisionInterface) -> str:
    text = request.instructions
    if interface == "structured":
        text = f"{text}\n\n{structured_instructions(request.capabilities, request.output_schema)}"
    return text.strip()


def _call(call_id: str, name: str, arguments: Mapping[str, JSON]) -> Item:
    return {
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": canonical_json(dict(arguments)),
    }


def _output(call_id: str, payload: JSON) -> Item:
    return {"type": "function_call_output", "call_id": call_id, "output": canonical_json(payload)}


def _turn_items(turn: Turn, interface: DecisionInterface) -> list[Item]:
    """An earlier chat turn; its trace as complete call/output pairs (or data)."""
    items = [user(turn.user)]
    if turn.trace and interface == "structured":
        items.append(user(trace_text(turn.trace)))
    elif turn.trace:
        for group in turn.trace:
            items.extend(_call(c.call_id, c.name, c.arguments) for c in group)
            items.extend(_output(c.call_id, observation_payload(c)) for c in group)
    if turn.replies:
        items.append(assistant("\n\n".join(turn.replies)))
    return items


def _replayable(decision: DecisionMessage, interface: DecisionInterface) -> list[Item] | None:
    """This decision's own output items, if they can be sent back as they are.

    Only items this provider produced, whose function calls are exactly the
    decision's calls, and whose reasoning items carry ``encrypted_content``
    (with ``store=False`` the API cannot find a reasoning item by id alone).
    """
    items = decision.opaque
    if decision.provider != PROVIDER or not isinstance(items, list):
        return None
    if not all(isinstance(item, dict) for item in items):
        return None
    if any(
        item.get("type") == "reasoning" and not isinstance(item.get("encrypted_content"), str)
        for item in items
    ):
        return None
    calls = [item.get("call_id") for item in items if item.get("type") == "function_call"]
    expected = [c.call_id for c in decision.calls] if interface == "native" else []
    return items if calls == expected else None


def _decision_items(
    decision: DecisionMessage,
    interface: DecisionInterface,
    projected: Mapping[str, Mapping[str, JSON]],
) -> list[Item]:
    replay = _replayable(decision, interface)
    if replay is not None:
        return replay
    # Rendered from the neutral fields (another provider's decision, opaque_refs
    # continuity, unusable opaque data): no item ids, no reasoning, and the
    # runtime's projected arguments wherever an observation gives them.
    calls = projected_calls(decision, projected)
    if interface == "structured":
        return [assistant(structured_decision_json(replace(decision, calls=calls)))]
    items: list[Item] = []
    if decision.text is not None:
        items.append(assistant(decision.text))
    elif decision.final:
        items.append(assistant(canonical_json({"output": decision.output})))
    items.extend(_call(c.call_id, c.name, c.arguments) for c in calls)
    return items


def _exchange_items(exchange: Sequence[Message], interface: DecisionInterface) -> list[Item]:
    return exchange_items(exchange, interface, _decision_items, _output)


def exchange_memo() -> ExchangeMemo[list[Item]]:
    """A wire's memo of rendered exchanges (see :mod:`touba.providers._memo`)."""
    return ExchangeMemo(_exchange_items)


def input_items(plan: Plan, memo: ExchangeMemo[list[Item]] | None = None) -> list[Item]:
    """Prior turns, the invocation input, the summary, then the exchanges (each
    taken from ``memo`` when it rendered that very exchange before)."""
    return plan_items(plan, memo, _turn_items, _exchange_items)


def count_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """The generation body as the count endpoint takes it: its parameters only."""
    return {key: value for key, value in body.items() if key in COUNT_FIELDS}


# response --------------------------------------------------------------------


def _check_status(data: Mapping[str, Any]) -> None:
    status = data.get("status")
    if status == "incomplete":
        details = data.get("incomplete_details")
        reason = details.get("reason") if isinstance(details, Mapping) else None
        if reason == "max_output_tokens":
            raise violation(
                "the response stopped at max_output_tokens before the decision was complete; "
                "raise max_output_tokens (reasoning tokens count against it)",
                "truncated_output",
            )
        if reason == "content_filter":
            raise violation("OpenAI's content filter blocked the response", "blocked")
        raise violation(f"the response is incomplete (reason {reason!r})", "incomplete_output")
    if status not in (None, "completed"):
        error = data.get("error")
        code = error.get("code") if isinstance(error, Mapping) else None
        said = body_message(error)
        raise AgentDecisionProviderUnavailable(
            f"the OpenAI response has status {status!r}, not 'completed'; no decision was "
            "received (touba sends foreground, non-streaming requests)",
            server_message=said,
            retryable=retry_can_help(500, said, code),
        )


def _parse_call(item: Mapping[str, Any]) -> CapabilityCall:
    call_id, name, raw = item.get("call_id"), item.get("name"), item.get("arguments")
    if not isinstance(call_id, str) or not isinstance(name, str) or not isinstance(raw, str):
        raise violation("a function_call item lacks call_id, name or arguments", "bad_call")
    try:
        arguments = json.loads(raw)
    except json.JSONDecodeError as e:
        raise violation(
            f"the arguments of call {call_id!r} are not valid JSON ({e.msg} at char {e.pos})",
            "invalid_json",
        ) from e
    if not isinstance(arguments, dict):
        raise violation(f"the arguments of call {call_id!r} are not a JSON object", "bad_call")
    return CapabilityCall(call_id, name, arguments)


def _final_output(text: str) -> JSON:
    """The native final answer under ``text.format`` (``{"output": ...}``)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise invalid_json("the final answer", e) from e
    if not isinstance(value, dict) or "output" not in value:
        raise violation("the final answer has no 'output' field", "missing_output")
    return value["output"]


def parse_response(
    data: Any, *, interface: DecisionInterface, wrapped_output: bool
) -> tuple[DecisionMessage, Usage]:
    """A ``Response`` body into a neutral decision keeping every output item.

    ``wrapped_output``: the native final answer was asked for as
    ``{"output": ...}`` (the ``touba_output`` text format).

    Raises :class:`AgentDecisionProviderSchemaViolation` when the response
    holds no valid decision; messages name what failed, never the content.
    """
    output = data.get("output") if isinstance(data, Mapping) else None
    if not isinstance(output, list) or not all(isinstance(item, dict) for item in output):
        raise AgentDecisionProviderUnavailable(
            "the OpenAI response body has no list of output items; check that base_url "
            "points to a server speaking the Responses API"
        )
    _check_status(data)
    texts: list[str] = []
    calls: list[CapabilityCall] = []
    for item in output:
        kind = item.get("type")
        if kind == "message":
            for part in item.get("content") or ():
                if not isinstance(part, Mapping):
                    continue
                if part.get("type") == "refusal":
                    raise violation("the model refused to answer", "refusal")
                if part.get("type") == "output_text" and isinstance(part.get("text"), str):
                    texts.append(part["text"])
        elif kind == "function_call" and interface == "native":
            calls.append(_parse_call(item))
        elif kind != "reasoning":
            raise violation(
                f"the response holds a {kind!r} output item, which touba did not ask for",
                "unexpected_output_item",
            )
    text = "".join(texts) if texts else None
    if interface == "structured":
        decision = parse_structured_text(text)
    elif calls:
        decision = DecisionMessage(text=text, calls=tuple(calls))
    elif text is None or not text.strip():
        raise violation("the model returned neither calls nor text", "empty_output")
    elif not wrapped_output:
        decision = DecisionMessage(text=text, output=text, final=True)
    else:
        decision = DecisionMessage(output=_final_output(text), final=True)
    counted = usage(data, "input_tokens", "output_tokens")
    return replace(decision, provider=PROVIDER, opaque=output), counted


# streaming -------------------------------------------------------------------

_STREAM_EVENTS = frozenset(
    {
        "response.created",
        "response.in_progress",
        "response.queued",
        "response.output_item.done",
        "response.content_part.added",
        "response.content_part.done",
        "response.output_text.done",
        "response.output_text.annotation.added",
        "response.refusal.delta",
        "response.refusal.done",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.reasoning_summary_part.added",
        "response.reasoning_summary_part.done",
        "response.reasoning_summary_text.delta",
        "response.reasoning_summary_text.done",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
    }
)
"""Events read past: what they carry comes whole in ``response.completed``."""

_SAFE_CODE = re.compile(r"\A[\w.-]{1,64}\Z")


def _failure_code(error: Any) -> str:
    code = error.get("code") if isinstance(error, Mapping) else None
    return f" (code {code})" if isinstance(code, str) and _SAFE_CODE.match(code) else ""


def _stream_failure(what: str, error: Any) -> AgentDecisionProviderUnavailable:
    """A failure reported inside the stream, with what the API said (see ``_refusal``)."""
    said = body_message(error)
    code = error.get("code") if isinstance(error, Mapping) else None
    retryable = retry_can_help(500, said, code)
    hint = "" if retryable else ": the API refused this request, a retry will not help"
    return AgentDecisionProviderUnavailable(
        f"{what}{_failure_code(error)}; no decision was received and nothing was stored{hint}",
        server_message=said,
        retryable=retryable,
    )


async def read_response_stream(events: AsyncIterable[Any], sink: DeltaSink) -> Any:
    """The Responses API's SSE events (``stream: true``) up to the final response body.

    Text deltas and started function calls go to ``sink`` as they arrive; the
    body returned is the ``response`` of ``response.completed`` (or
    ``response.incomplete``), the very object the non-streaming request
    answers, for :func:`parse_response`. ``error`` and ``response.failed``
    are AgentDecisionProviderUnavailable; a stream ending before its final
    event is a schema violation; events of unknown types are ignored.
    """
    calls = 0
    async for event in events:
        kind = event.get("type") if isinstance(event, Mapping) else None
        if kind == "response.output_text.delta":
            delta = event.get("delta")
            if isinstance(delta, str) and delta:
                await sink(StreamedText(delta))
        elif kind == "response.output_item.added":
            item = event.get("item")
            if isinstance(item, Mapping) and item.get("type") == "function_call":
                name, call_id = item.get("name"), item.get("call_id")
                await sink(
                    StreamedCall(
                        calls,
                        name if isinstance(name, str) else "",
                        call_id if isinstance(call_id, str) else None,
                    )
                )
                calls += 1
        elif kind in ("response.completed", "response.incomplete"):
            response = event.get("response")
            if not isinstance(response, Mapping):
                raise violation(f"the {kind} event carries no response", "malformed_response")
            return response
        elif kind == "response.failed":
            response = event.get("response")
            error = response.get("error") if isinstance(response, Mapping) else None
            raise _stream_failure("the OpenAI response failed while streaming", error)
        elif kind == "error":
            raise _stream_failure("the OpenAI stream sent an error event", event)
        elif kind not in _STREAM_EVENTS:
            ignore_event(PROVIDER, kind)
    raise incomplete_stream("OpenAI Responses")

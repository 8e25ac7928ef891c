"""Gemini ``generateContent`` in its REST JSON shape: rendering and parsing.

Pure conversion, no SDK import. The generation body is rendered once, in the
camelCase REST shape, so the very dict that ``countTokens`` counts (wrapped in
``generateContentRequest``) is the one posted to ``generateContent``.

Wire facts this module keeps (https://ai.google.dev/api/generate-content and
https://ai.google.dev/gemini-api/docs/thought-signatures):

- a model turn with ``functionCall`` parts is followed by ONE user turn with
  as many ``functionResponse`` parts, same names, same order (``id`` echoed
  only when the model gave one);
- the model's own parts (thoughts, ``thoughtSignature`` on the very part that
  carried it) are replayed exactly as received;
- in the *current turn* (after the last user content holding something other
  than function responses) the first ``functionCall`` of every model step
  must carry a signature. Calls touba renders from neutral fields (another
  provider's decision, ``opaque_refs`` projections, chat traces) have none:
  they get Google's documented ``skip_thought_signature_validator`` marker,
  which claims no signature from the model and is never put on a model part.
"""

from __future__ import annotations

import copy
import enum
import hashlib
import json
import re
from collections.abc import AsyncIterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from touba.errors import (
    ConfigurationError,
    DecisionHistoryMismatch,
    ProviderContextCountUnavailable,
)
from touba.history._model import (
    CapabilityCall,
    DataMessage,
    DecisionMessage,
    Message,
    ResultMessage,
    SummaryMessage,
    canonical_json,
)
from touba.providers._base import Plan
from touba.providers._framing import (
    data_text,
    input_text,
    invalid_json,
    observation_payload,
    parse_structured_text,
    results_text,
    structured_decision_json,
    structured_instructions,
    structured_schema,
    summary_text,
    trace_text,
    violation,
)
from touba.providers._memo import ExchangeMemo, rendered_exchanges
from touba.providers._stream import DeltaSink, StreamedCall, StreamedText, incomplete_stream
from touba.providers._types import CapabilitySpec, DecisionInterface, TraceCall, Turn, Usage

__all__ = [
    "PROVIDER",
    "SKIP_SIGNATURE",
    "GeminiBody",
    "count_request",
    "exchange_memo",
    "parse_response",
    "read_content_stream",
    "read_count",
    "render_body",
    "split_options",
]

PROVIDER = "gemini"
SKIP_SIGNATURE = "skip_thought_signature_validator"
NO_INPUT = "[touba: this invocation has no input]"
_INVENTED_ID = re.compile(r"touba_gc_[0-9a-f]{16}_[0-9]+")
_FUNCTION_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.:-]{0,63}")
_NEUTRAL = "__touba_neutral__"  # marks calls rendered from neutral fields; removed before sending
_COUNTED = (
    "contents",
    "systemInstruction",
    "tools",
    "toolConfig",
    "safetySettings",
    "generationConfig",
)
_BLOCKED = frozenset(
    {
        "SAFETY",
        "BLOCKLIST",
        "PROHIBITED_CONTENT",
        "SPII",
        "IMAGE_SAFETY",
        "IMAGE_PROHIBITED_CONTENT",
        "MODEL_ARMOR",
        "JAILBREAK",
    }
)
_FINISH_CODES = {
    "MAX_TOKENS": "truncated_output",
    "CONTINUATION": "truncated_output",  # the rest waits behind server state: never followed
    "RECITATION": "recitation",
    "IMAGE_RECITATION": "recitation",
    **dict.fromkeys(_BLOCKED, "blocked"),
}


class GeminiBody(dict[str, Any]):
    """A rendered body; ``output_schema`` says how to read a native final text.

    An attribute, not a key: it is neither counted nor sent.
    """

    output_schema: Mapping[str, Any] | None = None


# options -----------------------------------------------------------------------

_GENERATION_OPTIONS = {
    "temperature": "temperature",
    "top_p": "topP",
    "top_k": "topK",
    "seed": "seed",
    "stop_sequences": "stopSequences",
    "presence_penalty": "presencePenalty",
    "frequency_penalty": "frequencyPenalty",
    "response_logprobs": "responseLogprobs",
    "logprobs": "logprobs",
    "thinking_config": "thinkingConfig",
    "media_resolution": "mediaResolution",
    "candidate_count": "candidateCount",
}
_REQUEST_OPTIONS = {
    "safety_settings": "safetySettings",
    "tool_config": "toolConfig",
    "cached_content": "cachedContent",
    "labels": "labels",
    "service_tier": "serviceTier",
}
_RENDERED_OPTIONS = frozenset(
    {
        "contents",
        "system_instruction",
        "tools",
        "response_mime_type",
        "response_schema",
        "response_json_schema",
        "max_output_tokens",
    }
)


def split_options(options: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``**options`` (or ``config=``) into REST ``generationConfig`` and request fields."""
    given = dict(options)
    config = given.pop("config", None)
    if config is not None:
        for key, value in _config_items(config).items():
            if key in given:
                raise ConfigurationError(f"Gemini option {key!r} is given twice (and in config=)")
            given[key] = value
    afc = given.pop("automatic_function_calling", None)
    disabled = afc.get("disable") if isinstance(afc, Mapping) else getattr(afc, "disable", True)
    if afc is not None and disabled is not True:
        raise ConfigurationError(
            "touba runs capabilities through its runtime: Gemini automatic function calling "
            "cannot be enabled"
        )
    generation: dict[str, Any] = {}
    fields: dict[str, Any] = {}
    for key, value in given.items():
        if key in _RENDERED_OPTIONS:
            raise ConfigurationError(
                f"Gemini option {key!r} is set by touba (instructions, capabilities, "
                "decision_interface and max_output_tokens= decide it)"
            )
        if key in _GENERATION_OPTIONS:
            generation[_GENERATION_OPTIONS[key]] = _json_value(key, value)
        elif key in _REQUEST_OPTIONS:
            fields[_REQUEST_OPTIONS[key]] = _json_value(key, value)
        else:
            known = sorted({*_GENERATION_OPTIONS, *_REQUEST_OPTIONS, "config"})
            raise ConfigurationError(
                f"unknown Gemini option {key!r}; supported: {', '.join(known)}"
            )
    if generation.get("candidateCount", 1) != 1:
        raise ConfigurationError("candidate_count must be 1: a decision reads one candidate")
    cached = fields.get("cachedContent")
    if cached is not None and (not isinstance(cached, str) or not cached):
        raise ConfigurationError("cached_content must be a cachedContents/... name")
    return generation, fields


def _config_items(config: Any) -> dict[str, Any]:
    if hasattr(config, "model_dump"):
        data: dict[str, Any] = config.model_dump(exclude_none=True)
    elif isinstance(config, Mapping):
        data = dict(config)
    else:
        raise ConfigurationError("config must be a google.genai.types.GenerateContentConfig")
    if data.pop("http_options", None) is not None:
        raise ConfigurationError(
            "config.http_options is not supported: configure the genai.Client instead"
        )
    return data


def _json_value(key: str, value: Any) -> Any:
    """SDK objects and snake_case dicts as REST JSON (labels keep their keys)."""
    if hasattr(value, "model_dump"):
        value = value.model_dump(mode="json", by_alias=True, exclude_none=True)
    value = _camel(value, keys=key != "labels")
    try:
        canonical_json(value)
    except (TypeError, ValueError) as e:
        raise ConfigurationError(f"Gemini option {key!r} is not JSON-serialisable") from e
    return value


def _camel(value: Any, *, keys: bool) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Mapping):
        return {
            (re.sub(r"_([a-z0-9])", lambda m: m.group(1).upper(), k) if keys else k): _camel(
                v, keys=keys
            )
            for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        return [_camel(v, keys=keys) for v in value]
    return value


# rendering ---------------------------------------------------------------------


def render_body(
    plan: Plan,
    *,
    max_output_tokens: int | None,
    generation: Mapping[str, Any],
    fields: Mapping[str, Any],
    memo: ExchangeMemo[Rendered] | None = None,
) -> GeminiBody:
    """The full ``generateContent`` body for ``plan`` (REST JSON, camelCase); each
    exchange taken from ``memo`` when it rendered that very exchange before."""
    request = plan.request
    native = plan.interface == "native"
    body = GeminiBody(contents=_contents(plan, memo))
    system = [request.instructions.strip()]
    if not native:
        system.append(structured_instructions(request.capabilities, request.output_schema))
    elif request.output_schema is not None:
        system.append(
            "When you give your final answer (no function call), answer only with JSON "
            "matching this JSON Schema: " + canonical_json(dict(request.output_schema))
        )
        body.output_schema = request.output_schema
    text = "\n\n".join(s for s in system if s)
    if text:
        body["systemInstruction"] = {"parts": [{"text": text}]}
    if native and request.capabilities:
        body["tools"] = [{"functionDeclarations": [_declaration(c) for c in request.capabilities]}]
    body.update(fields)
    config = dict(generation)
    if max_output_tokens is not None:
        config["maxOutputTokens"] = max_output_tokens
    if not native:
        config["responseMimeType"] = "application/json"
        config["responseJsonSchema"] = structured_schema(
            request.capabilities, request.output_schema
        )
    if config:
        body["generationConfig"] = config
    return body


def _declaration(capability: CapabilitySpec) -> dict[str, Any]:
    if not _FUNCTION_NAME.fullmatch(capability.name):
        raise ConfigurationError(
            f"capability {capability.name!r} cannot be a Gemini function name: use letters, "
            "digits, '_', '.', ':' or '-', at most 64, starting with a letter or '_'"
        )
    declaration: dict[str, Any] = {"name": capability.name}
    if capability.description:
        declaration["description"] = capability.description
    declaration["parametersJsonSchema"] = dict(capability.parameters)
    return declaration


def wire_id(call_id: str) -> str | None:
    """The id to send for a call: never one touba invented for an id-less call."""
    return None if _INVENTED_ID.fullmatch(call_id) else call_id


class _Parts:
    """What an exchange adds, in order, as ``(role, parts)``: what a memo keeps."""

    def __init__(self) -> None:
        self.added: list[tuple[str, list[dict[str, Any]]]] = []

    def add(self, role: str, parts: list[dict[str, Any]]) -> None:
        if parts:
            self.added.append((role, parts))

    def text(self, role: str, text: str | None) -> None:
        if text:
            self.add(role, [{"text": text}])


class _Contents(_Parts):
    """Contents in order; adjacent same-role turns merge unless one answers calls."""

    def __init__(self) -> None:
        super().__init__()
        self.items: list[dict[str, Any]] = []

    def add(self, role: str, parts: list[dict[str, Any]]) -> None:
        if not parts:
            return
        last = self.items[-1] if self.items else None
        if (
            last is not None
            and last["role"] == role
            and not _answers(last["parts"])
            and not _answers(parts)
        ):
            last["parts"].extend(parts)
        else:
            self.items.append({"role": role, "parts": list(parts)})


def _answers(parts: Sequence[Mapping[str, Any]]) -> bool:
    return any("functionResponse" in p for p in parts)


Rendered = tuple[tuple[str, list[dict[str, Any]]], ...]


def _rendered(exchange: tuple[Message, ...], interface: DecisionInterface) -> Rendered:
    parts = _Parts()
    _exchange(parts, exchange, interface == "native")
    return tuple(parts.added)


def exchange_memo() -> ExchangeMemo[Rendered]:
    """A wire's memo of rendered exchanges (see :mod:`touba.providers._memo`)."""
    return ExchangeMemo(_rendered)


def _contents(plan: Plan, memo: ExchangeMemo[Rendered] | None) -> list[dict[str, Any]]:
    out = _Contents()
    native = plan.interface == "native"
    for turn in plan.prior_turns:
        _turn(out, turn, native)
    if plan.request.input is not None:
        out.text("user", input_text(plan.request.input))
    if plan.summary is not None:
        out.text("user", summary_text(plan.summary))
    # Each part copied: _mark_current_turn edits parts, the memo's stay as rendered.
    for rendered in rendered_exchanges(plan.window, plan.interface, memo, _rendered):
        for role, parts in rendered:
            out.add(role, [dict(part) for part in parts])
    if not out.items or out.items[0]["role"] != "user":
        out.items.insert(0, {"role": "user", "parts": [{"text": NO_INPUT}]})
    _mark_current_turn(out.items)
    return out.items


def _turn(out: _Contents, turn: Turn, native: bool) -> None:
    out.text("user", turn.user)
    if turn.trace and not native:
        out.text("user", trace_text(turn.trace))
    elif turn.trace:
        for group in (g for g in turn.trace if g):
            calls = [_neutral_call(c.call_id, c.name, c.arguments) for c in group]
            out.add("model", calls)
            out.add("user", [_response(call, c) for call, c in zip(calls, group, strict=True)])
    out.text("model", "\n\n".join(turn.replies))


def _exchange(out: _Parts, exchange: Sequence[Message], native: bool) -> None:
    results = [m for m in exchange if isinstance(m, ResultMessage)]
    projected = {r.call_id: r.arguments for r in results}
    for message in exchange:
        if isinstance(message, DecisionMessage):
            _decision(out, message, native, {r.call_id: r for r in results}, projected)
        elif isinstance(message, DataMessage):
            out.text("user", data_text(message))
        elif isinstance(message, SummaryMessage):
            out.text("user", summary_text(message))
    if results and not native:
        out.text("user", results_text(results))


def _decision(
    out: _Parts,
    decision: DecisionMessage,
    native: bool,
    results: Mapping[str, ResultMessage],
    projected: Mapping[str, Mapping[str, Any]],
) -> None:
    # opaque_refs keeps calls without arguments: the runtime's projection wins.
    calls = tuple(
        c if c.arguments else CapabilityCall(c.call_id, c.name, projected.get(c.call_id, {}))
        for c in decision.calls
    )
    parts = _own_parts(decision, native)
    if not native:
        if parts is None:
            parts = [{"text": structured_decision_json(replace(decision, calls=calls))}]
        out.add("model", parts)
        return
    if parts is None:
        text = decision.text
        if text is None and decision.final:
            text = input_text(decision.output)
        parts = [{"text": text}] if text else []
        if not decision.final:
            parts.extend(_neutral_call(c.call_id, c.name, c.arguments) for c in calls)
    out.add("model", parts)
    call_parts = [p for p in parts if "functionCall" in p]
    if not call_parts:
        return
    answers = []
    for call, part in zip(decision.calls, call_parts, strict=True):
        result = results.get(call.call_id)
        if result is None:
            raise DecisionHistoryMismatch(
                f"call {call.call_id} of a past decision has no observation in its exchange; "
                "the stored conversation is inconsistent"
            )
        answers.append(_response(part, result))
    out.add("user", answers)


def _own_parts(decision: DecisionMessage, native: bool) -> list[dict[str, Any]] | None:
    """This provider's parts for ``decision``, exactly as received, or None."""
    opaque = decision.opaque
    if decision.provider != PROVIDER or not isinstance(opaque, Mapping):
        return None
    parts = opaque.get("parts")
    if not isinstance(parts, list) or not parts or not all(isinstance(p, dict) for p in parts):
        return None
    names = [
        p["functionCall"].get("name") if isinstance(p["functionCall"], Mapping) else None
        for p in parts
        if "functionCall" in p
    ]
    if names != ([c.name for c in decision.calls] if native else []):
        return None
    return copy.deepcopy(parts)


def _neutral_call(call_id: str, name: str, arguments: Mapping[str, Any]) -> dict[str, Any]:
    call: dict[str, Any] = {"name": name, "args": dict(arguments)}
    identifier = wire_id(call_id)
    if identifier is not None:
        call["id"] = identifier
    return {"functionCall": call, _NEUTRAL: True}


def _response(call_part: Mapping[str, Any], result: ResultMessage | TraceCall) -> dict[str, Any]:
    call = call_part["functionCall"]
    response: dict[str, Any] = {"name": call["name"], "response": observation_payload(result)}
    if "id" in call:
        response["id"] = call["id"]
    return {"functionResponse": response}


def _mark_current_turn(contents: list[dict[str, Any]]) -> None:
    """Give neutral calls of the current turn the documented no-signature marker."""
    start = 0
    for index, content in enumerate(contents):
        if content["role"] == "user" and any("functionResponse" not in p for p in content["parts"]):
            start = index + 1
    for index, content in enumerate(contents):
        first = next((p for p in content["parts"] if "functionCall" in p), None)
        if (
            index >= start
            and first is not None
            and first.get(_NEUTRAL)
            and "thoughtSignature" not in first
        ):
            first["thoughtSignature"] = SKIP_SIGNATURE
        for part in content["parts"]:
            part.pop(_NEUTRAL, None)


# counting ----------------------------------------------------------------------


def count_request(body: Mapping[str, Any], resource: str) -> dict[str, Any]:
    """``countTokens`` body: the generation body's counted fields (an allow-list).

    System instruction, tools, tool config, safety settings and generation
    config are counted with the contents; fields that carry no prompt tokens
    (``labels``, ``serviceTier``) stay out, ``cachedContent`` is refused earlier.
    """
    return {
        "generateContentRequest": {"model": resource, **{k: body[k] for k in _COUNTED if k in body}}
    }


def read_count(data: Any) -> int:
    """``totalTokens`` of a countTokens answer.

    Protobuf JSON omits zero-valued fields, so a missing ``totalTokens`` reads
    as 0. touba never counts an empty request (there is always a user turn),
    so 0, missing or not an integer all mean the count is unavailable: the
    guard never vouches for a request on a count it did not get.
    """
    total = data.get("totalTokens") if isinstance(data, Mapping) else None
    if isinstance(total, str) and total.isdigit():
        total = int(total)
    if isinstance(total, bool) or not isinstance(total, int) or total <= 0:
        raise ProviderContextCountUnavailable(
            "Gemini countTokens answered without a positive totalTokens; nothing was generated. "
            "Check that the client reaches the official Gemini API (or a gateway that speaks it)"
        )
    return total


# parsing -----------------------------------------------------------------------


def parse_response(
    data: Any, *, structured: bool, output_schema: Mapping[str, Any] | None
) -> tuple[DecisionMessage, Usage]:
    """A ``generateContent`` answer into a neutral decision; problems are violations."""
    if not isinstance(data, Mapping):
        raise violation("the Gemini response is not a JSON object", "malformed_response")
    feedback = data.get("promptFeedback")
    block = feedback.get("blockReason") if isinstance(feedback, Mapping) else None
    if block not in (None, "BLOCKED_REASON_UNSPECIFIED"):
        raise violation("Gemini blocked the prompt (promptFeedback.blockReason)", "blocked")
    candidates = data.get("candidates")
    if not isinstance(candidates, list) or not candidates:
        raise violation("Gemini returned no candidate", "empty_output")
    candidate = candidates[0]
    if not isinstance(candidate, Mapping):
        raise violation("the Gemini candidate is not an object", "malformed_response")
    reason = candidate.get("finishReason")
    if isinstance(reason, str) and reason not in ("STOP", "FINISH_REASON_UNSPECIFIED"):
        code = _FINISH_CODES.get(reason)
        if code is None:
            code = reason.lower() if re.fullmatch(r"[A-Z_]{1,64}", reason) else "finish_reason"
        raise violation(f"Gemini stopped with finishReason {reason[:64]}", code)
    content = candidate.get("content")
    parts = content.get("parts", []) if isinstance(content, Mapping) else []
    if not isinstance(parts, list) or not all(isinstance(p, Mapping) for p in parts):
        raise violation("the Gemini candidate parts are not objects", "malformed_response")
    calls: list[CapabilityCall] = []
    texts: list[str] = []
    base = hashlib.sha256(
        canonical_json([data.get("responseId"), parts]).encode("utf-8", "surrogatepass")
    ).hexdigest()[:16]
    for part in parts:
        if "functionCall" in part:
            calls.append(_call(part["functionCall"], f"touba_gc_{base}_{len(calls)}"))
        elif isinstance(part.get("text"), str) and not part.get("thought"):
            texts.append(part["text"])
    text = "".join(texts) or None
    if structured:
        if calls:
            raise violation(
                "Gemini returned a function call in the structured interface",
                "unexpected_function_call",
            )
        message = parse_structured_text(text)
    elif calls:
        message = DecisionMessage(text=text, calls=tuple(calls))
    elif text is None or not text.strip():
        raise violation("Gemini returned neither a function call nor text", "empty_output")
    else:
        output = text if output_schema is None else _json_output(text)
        message = DecisionMessage(text=text, output=output, final=True)
    opaque = {"parts": [copy.deepcopy(dict(p)) for p in parts]}
    return replace(message, provider=PROVIDER, opaque=opaque), _usage(data.get("usageMetadata"))


def _call(raw: Any, invented: str) -> CapabilityCall:
    if (
        not isinstance(raw, Mapping)
        or not isinstance(raw.get("name"), str)
        or not isinstance(raw.get("args") or {}, Mapping)
    ):
        raise violation("a Gemini functionCall part has no name or object args", "bad_call")
    given = raw.get("id")
    call_id = given if isinstance(given, str) and given else invented
    return CapabilityCall(call_id, raw["name"], dict(raw.get("args") or {}))


def _json_output(text: str) -> Any:
    body = text.strip()
    fenced = re.fullmatch(r"```(?:json)?\s*(.*?)\s*```", body, flags=re.DOTALL)
    if fenced:
        body = fenced.group(1)
    try:
        return json.loads(body)
    except json.JSONDecodeError as e:
        raise invalid_json("the final answer", e) from e


def _usage(meta: Any) -> Usage:
    if not isinstance(meta, Mapping):
        return Usage()

    def number(key: str) -> int | None:
        value = meta.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    candidates, thoughts = number("candidatesTokenCount"), number("thoughtsTokenCount")
    output = (
        None if candidates is None and thoughts is None else (candidates or 0) + (thoughts or 0)
    )
    return Usage(input_tokens=number("promptTokenCount"), output_tokens=output, details=dict(meta))


# streaming ---------------------------------------------------------------------


def _merges_into(previous: Mapping[str, Any] | None, part: Mapping[str, Any]) -> bool:
    """Whether ``part`` (a streamed text piece) continues ``previous``: both text of
    the same kind (thought or answer), and ``previous`` not yet closed by a signature."""
    if previous is None or not isinstance(previous.get("text"), str):
        return False
    if set(part) - {"text", "thought", "thoughtSignature"}:
        return False
    if set(previous) - {"text", "thought", "thoughtSignature"}:
        return False
    return (
        "thoughtSignature" not in previous
        and bool(previous.get("thought")) == bool(part.get("thought"))
        and isinstance(part.get("text", ""), str)
    )


async def read_content_stream(chunks: AsyncIterable[Any], sink: DeltaSink) -> dict[str, Any]:
    """``streamGenerateContent`` (``alt=sse``) chunks merged into the answer the
    non-streaming ``generateContent`` gives, for :func:`parse_response`.

    Each chunk is a partial answer: its first candidate's parts are appended,
    consecutive text pieces of the same kind joined into one part until a
    ``thoughtSignature`` closes it (the signature stays on the part that
    carried it, also when it came in a last, empty piece); function calls come
    whole. The last chunk's ``finishReason`` and ``usageMetadata`` stand; a
    stream without a ``finishReason`` (nor a blocked prompt) is a schema
    violation. Answer text pieces and function calls go to ``sink``.
    """
    answer: dict[str, Any] = {}
    candidate: dict[str, Any] = {}
    parts: list[dict[str, Any]] = []
    role: Any = None
    calls = 0
    async for data in chunks:
        if not isinstance(data, Mapping):
            raise violation("a Gemini stream chunk is not a JSON object", "malformed_response")
        answer.update((k, v) for k, v in data.items() if k != "candidates")
        found = data.get("candidates")
        first = found[0] if isinstance(found, list) and found else None
        if not isinstance(first, Mapping):
            continue
        candidate.update((k, v) for k, v in first.items() if k != "content")
        content = first.get("content")
        if not isinstance(content, Mapping):
            continue
        role = content.get("role", role)
        for part in content.get("parts") or ():
            if not isinstance(part, Mapping):
                raise violation("a streamed Gemini part is not an object", "malformed_response")
            previous = parts[-1] if parts else None
            if previous is not None and _merges_into(previous, part):
                previous["text"] += part.get("text", "")
                if "thoughtSignature" in part:
                    previous["thoughtSignature"] = part["thoughtSignature"]
            else:
                parts.append(copy.deepcopy(dict(part)))
            if "functionCall" in part:
                call = part["functionCall"]
                name = call.get("name") if isinstance(call, Mapping) else None
                given = call.get("id") if isinstance(call, Mapping) else None
                await sink(
                    StreamedCall(
                        calls,
                        name if isinstance(name, str) else "",
                        given if isinstance(given, str) and given else None,
                    )
                )
                calls += 1
            elif isinstance(part.get("text"), str) and part["text"] and not part.get("thought"):
                await sink(StreamedText(part["text"]))
    feedback = answer.get("promptFeedback")
    blocked = isinstance(feedback, Mapping) and feedback.get("blockReason") not in (
        None,
        "BLOCKED_REASON_UNSPECIFIED",
    )
    if "finishReason" not in candidate and not blocked:
        raise incomplete_stream("Gemini")
    if candidate:
        if role is not None or parts:
            body: dict[str, Any] = {"parts": parts} if parts else {}
            candidate["content"] = {"role": role, **body} if role is not None else body
        answer["candidates"] = [candidate]
    return answer

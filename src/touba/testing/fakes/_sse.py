"""Each vendor's streamed form of an answer the fakes rendered whole.

Pure functions: the non-streaming body in, the ``(event name, data)`` pairs
of the vendor's server-sent events out, such that a client assembling the
events gets that body back (text split into pieces, the final event carrying
what the vendor's final event carries).
"""

from __future__ import annotations

import copy
import json
from typing import Any

from touba.testing.fakes._server import JSONObject

__all__ = [
    "PIECE",
    "chat_events",
    "gemini_events",
    "joined_gemini_parts",
    "message_events",
    "pieces",
    "response_events",
]

PIECE = 8
"""Characters per text delta."""

Event = tuple[str | None, object]


def pieces(text: str, size: int = PIECE) -> list[str]:
    """``text`` in deltas of ``size`` characters (none for an empty text)."""
    return [text[i : i + size] for i in range(0, len(text), size)]


# OpenAI Responses ----------------------------------------------------------------


def _in_progress(item: JSONObject) -> JSONObject:
    added = {k: v for k, v in item.items() if k != "encrypted_content"}
    kind = item.get("type")
    if kind == "message":
        added["content"] = []
    elif kind == "function_call":
        added["arguments"] = ""
    elif kind == "reasoning":
        added["summary"] = []
    if "status" in added:
        added["status"] = "in_progress"
    return added


def _message_item_events(i: int, item: JSONObject, event: Any) -> None:
    item_id = item.get("id")
    for j, part in enumerate(item.get("content") or []):
        kind = part.get("type")
        empty = {**part, "text": ""} if kind == "output_text" else {**part, "refusal": ""}
        event(
            "response.content_part.added",
            item_id=item_id,
            output_index=i,
            content_index=j,
            part=empty,
        )
        if kind == "output_text":
            for delta in pieces(part.get("text", "")):
                event(
                    "response.output_text.delta",
                    item_id=item_id,
                    output_index=i,
                    content_index=j,
                    delta=delta,
                    logprobs=[],
                )
            event(
                "response.output_text.done",
                item_id=item_id,
                output_index=i,
                content_index=j,
                text=part.get("text", ""),
                logprobs=[],
            )
        elif kind == "refusal":
            for delta in pieces(part.get("refusal", "")):
                event(
                    "response.refusal.delta",
                    item_id=item_id,
                    output_index=i,
                    content_index=j,
                    delta=delta,
                )
            event(
                "response.refusal.done",
                item_id=item_id,
                output_index=i,
                content_index=j,
                refusal=part.get("refusal", ""),
            )
        event(
            "response.content_part.done",
            item_id=item_id,
            output_index=i,
            content_index=j,
            part=part,
        )


def response_events(response: JSONObject) -> list[Event]:
    """``response.created`` ... ``response.completed`` (or ``.incomplete``) for a response."""
    events: list[Event] = []

    def event(kind: str, **data: Any) -> None:
        events.append((kind, {"type": kind, **data, "sequence_number": len(events)}))

    started = {
        **response,
        "status": "in_progress",
        "output": [],
        "usage": None,
        "completed_at": None,
        "incomplete_details": None,
    }
    event("response.created", response=started)
    event("response.in_progress", response=started)
    for i, item in enumerate(response.get("output") or []):
        event("response.output_item.added", output_index=i, item=_in_progress(item))
        kind, item_id = item.get("type"), item.get("id")
        if kind == "message":
            _message_item_events(i, item, event)
        elif kind == "function_call":
            for delta in pieces(str(item.get("arguments", ""))):
                event(
                    "response.function_call_arguments.delta",
                    item_id=item_id,
                    output_index=i,
                    delta=delta,
                )
            event(
                "response.function_call_arguments.done",
                item_id=item_id,
                output_index=i,
                name=item.get("name"),
                arguments=item.get("arguments"),
            )
        elif kind == "reasoning":
            for j, part in enumerate(item.get("summary") or []):
                event(
                    "response.reasoning_summary_part.added",
                    item_id=item_id,
                    output_index=i,
                    summary_index=j,
                    part={**part, "text": ""},
                )
                for delta in pieces(str(part.get("text", ""))):
                    event(
                        "response.reasoning_summary_text.delta",
                        item_id=item_id,
                        output_index=i,
                        summary_index=j,
                        delta=delta,
                    )
                event(
                    "response.reasoning_summary_text.done",
                    item_id=item_id,
                    output_index=i,
                    summary_index=j,
                    text=part.get("text"),
                )
                event(
                    "response.reasoning_summary_part.done",
                    item_id=item_id,
                    output_index=i,
                    summary_index=j,
                    part=part,
                )
        event("response.output_item.done", output_index=i, item=item)
    final = (
        "response.incomplete" if response.get("status") == "incomplete" else "response.completed"
    )
    event(final, response=response)
    return events


# Chat Completions ------------------------------------------------------------------


def chat_events(completion: JSONObject, *, include_usage: bool) -> list[Event]:
    """``chat.completion.chunk`` events for a completion (``[DONE]`` is the trailer)."""
    base = {k: completion.get(k) for k in ("id", "created", "model", "system_fingerprint")}
    base["object"] = "chat.completion.chunk"
    choice = completion["choices"][0]
    message = choice["message"]
    events: list[Event] = []

    def chunk(delta: JSONObject, finish: str | None = None) -> None:
        choices = [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]
        events.append((None, {**base, "choices": choices}))

    opening: JSONObject = {"role": "assistant", "content": "", "refusal": None}
    if "annotations" in message:
        opening["annotations"] = message["annotations"]
    chunk(opening)
    for key, value in message.items():
        if key in ("role", "tool_calls", "annotations") or not isinstance(value, str):
            continue
        for delta in pieces(value):
            chunk({key: delta})
    for index, call in enumerate(message.get("tool_calls") or []):
        function = call.get("function") or {}
        opening = {
            "index": index,
            "id": call.get("id"),
            "type": call.get("type", "function"),
            "function": {"name": function.get("name"), "arguments": ""},
        }
        chunk({"tool_calls": [opening]})
        for delta in pieces(str(function.get("arguments", ""))):
            chunk({"tool_calls": [{"index": index, "function": {"arguments": delta}}]})
    chunk({}, choice.get("finish_reason"))
    if include_usage:
        events.append((None, {**base, "choices": [], "usage": completion.get("usage")}))
    return events


# Anthropic Messages ------------------------------------------------------------------


def _block_events(index: int, block: JSONObject, event: Any) -> None:
    kind = block.get("type")
    if kind == "text":
        start = {k: v for k, v in block.items() if k != "citations"}
        event("content_block_start", index=index, content_block={**start, "text": ""})
        for delta in pieces(block.get("text", "")):
            event("content_block_delta", index=index, delta={"type": "text_delta", "text": delta})
    elif kind == "thinking":
        event(
            "content_block_start",
            index=index,
            content_block={"type": "thinking", "thinking": "", "signature": ""},
        )
        for delta in pieces(block.get("thinking", "")):
            event(
                "content_block_delta",
                index=index,
                delta={"type": "thinking_delta", "thinking": delta},
            )
        event(
            "content_block_delta",
            index=index,
            delta={"type": "signature_delta", "signature": block.get("signature", "")},
        )
    elif kind == "tool_use":
        raw = block.get("input")
        text = raw if isinstance(raw, str) else json.dumps(raw)
        event("content_block_start", index=index, content_block={**block, "input": {}})
        for delta in pieces(text):
            event(
                "content_block_delta",
                index=index,
                delta={"type": "input_json_delta", "partial_json": delta},
            )
    else:  # redacted_thinking and anything else: whole at the start
        event("content_block_start", index=index, content_block=block)
    event("content_block_stop", index=index)


def message_events(message: JSONObject) -> list[Event]:
    """``message_start`` ... ``message_stop`` for a Messages API answer."""
    events: list[Event] = []

    def event(kind: str, **data: Any) -> None:
        events.append((kind, {"type": kind, **data}))

    usage = dict(message.get("usage") or {})
    opening = {
        **message,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {**usage, "output_tokens": 1},
    }
    opening.pop("stop_details", None)
    event("message_start", message=opening)
    event("ping")
    for index, block in enumerate(message.get("content") or []):
        _block_events(index, block, event)
    delta = {
        "stop_reason": message.get("stop_reason"),
        "stop_sequence": message.get("stop_sequence"),
    }
    if "stop_details" in message:
        delta["stop_details"] = message["stop_details"]
    event("message_delta", delta=delta, usage={"output_tokens": usage.get("output_tokens")})
    event("message_stop")
    return events


# Gemini ------------------------------------------------------------------------------


_TEXT_KEYS = frozenset({"text", "thought", "thoughtSignature"})


def joined_gemini_parts(parts: list[JSONObject]) -> list[JSONObject]:
    """The parts a streaming client can tell apart: a stream of text pieces marks no
    part boundary, only a ``thoughtSignature`` closes a text part, so consecutive text
    parts of one kind (thought or answer) after an unsigned one are one part."""
    joined: list[JSONObject] = []
    for part in parts:
        previous = joined[-1] if joined else None
        if (
            previous is not None
            and isinstance(previous.get("text"), str)
            and isinstance(part.get("text"), str)
            and set(previous) <= _TEXT_KEYS
            and set(part) <= _TEXT_KEYS
            and "thoughtSignature" not in previous
            and bool(previous.get("thought")) == bool(part.get("thought"))
        ):
            previous["text"] += part["text"]
            if "thoughtSignature" in part:
                previous["thoughtSignature"] = part["thoughtSignature"]
        else:
            joined.append(copy.deepcopy(part))
    return joined


def gemini_events(answer: JSONObject) -> list[Event]:
    """``streamGenerateContent?alt=sse`` chunks for a ``generateContent`` answer: one
    chunk per text piece (a part's signature on its last piece) or function call part;
    the last chunk carries ``finishReason`` and the full ``usageMetadata``."""
    candidates = answer.get("candidates")
    if not candidates:
        return [(None, answer)]
    candidate = candidates[0]
    content = candidate.get("content") or {}
    head = {k: v for k, v in answer.items() if k not in ("candidates", "usageMetadata")}
    usage = answer.get("usageMetadata") or {}
    partial_usage = {k: v for k, v in usage.items() if k == "promptTokenCount"}
    chunks: list[JSONObject] = []
    for part in content.get("parts") or []:
        if isinstance(part.get("text"), str) and set(part) <= {
            "text",
            "thought",
            "thoughtSignature",
        }:
            texts = pieces(part["text"]) or [""]
            for n, text in enumerate(texts):
                piece = {k: v for k, v in part.items() if k != "thoughtSignature"}
                piece["text"] = text
                if n == len(texts) - 1 and "thoughtSignature" in part:
                    piece["thoughtSignature"] = part["thoughtSignature"]
                chunks.append(piece)
        else:
            chunks.append(copy.deepcopy(part))
    events: list[Event] = []
    role = content.get("role", "model")
    for n, part in enumerate(chunks):
        last = n == len(chunks) - 1
        streamed: JSONObject = {"content": {"role": role, "parts": [part]}, "index": 0}
        if last:
            streamed.update({k: v for k, v in candidate.items() if k != "content"})
        events.append(
            (
                None,
                {
                    "candidates": [streamed],
                    "usageMetadata": usage if last else partial_usage,
                    **head,
                },
            )
        )
    if not chunks:
        events.append((None, {**answer}))
    return events

"""What the OpenAI Responses and Chat Completions APIs refuse, as pure checks.

Messages, params and codes follow what api.openai.com answers (collected from
real error reports). Checks needing server memory (encrypted content, stored
items, reasoning/item pairing) run only when an ``IssueLedger`` is given.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Sequence
from typing import Any

from touba.testing.fakes._ledger import IssueLedger
from touba.testing.fakes._server import JSONObject, Rejection, json_type_name

__all__ = [
    "ENCRYPTED_PREFIX",
    "REASONING_KIND",
    "check_chat_completions",
    "check_responses",
    "decode_encrypted_content",
    "validate_chat_completions_request",
    "validate_openai_input_tokens_request",
    "validate_openai_responses_request",
]

ENCRYPTED_PREFIX = "gAAAAA"
REASONING_KIND = "openai.reasoning"

INPUT_TOKENS_PARAMS = frozenset(
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


def _bad(
    message: str, *, status: int = 400, param: str | None = None, code: str | None = None
) -> Rejection:
    return Rejection(status, message, param, code)


def _missing(param: str) -> Rejection:
    return _bad(
        f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter"
    )


def _invalid_type(param: str, expected: str, value: object) -> Rejection:
    got = json_type_name(value)
    return _bad(
        f"Invalid type for '{param}': expected {expected}, but got {got} instead.",
        param=param,
        code="invalid_type",
    )


def decode_encrypted_content(token: str) -> bytes | None:
    """The raw bytes inside an ``encrypted_content`` the fake issued, or None."""
    if not token.startswith(ENCRYPTED_PREFIX):
        return None
    try:
        return base64.urlsafe_b64decode(token[len(ENCRYPTED_PREFIX) :].encode())
    except (binascii.Error, ValueError):
        return None


def _short(token: str) -> str:
    return f"{token[:4]}...{token[-4:]}" if len(token) > 8 else token


def _item_type(item: JSONObject) -> str | None:
    kind = item.get("type")
    if isinstance(kind, str):
        return kind
    return "message" if "role" in item else None


def _is_reasoning_follower(item: object) -> bool:
    if not isinstance(item, dict):
        return False
    kind = _item_type(item)
    if kind == "message":
        return item.get("role") == "assistant"
    return kind is not None and kind.endswith("_call")


def check_tools(tools: object, *, prefix: str = "tools") -> list[Rejection]:
    """Each Responses tool needs ``type``; function tools need ``name`` and ``parameters``."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        return [_invalid_type(prefix, "an array", tools)]
    problems: list[Rejection] = []
    for i, tool in enumerate(tools):
        where = f"{prefix}[{i}]"
        if not isinstance(tool, dict):
            problems.append(_invalid_type(where, "an object", tool))
            continue
        if "type" not in tool:
            problems.append(_missing(f"{where}.type"))
        elif tool["type"] == "function":
            problems.extend(
                _missing(f"{where}.{key}") for key in ("name", "parameters") if key not in tool
            )
    return problems


def _check_reasoning(
    items: Sequence[Any], i: int, item: JSONObject, ledger: IssueLedger | None
) -> list[Rejection]:
    rid = str(item.get("id", ""))
    problems: list[Rejection] = []
    following = items[i + 1] if i + 1 < len(items) else None
    orphan = not _is_reasoning_follower(following)
    if not orphan and ledger is not None and isinstance(following, dict):
        expected = ledger.recall("follower", rid)
        orphan = bool(expected and following.get("id") and following["id"] != expected)
    if orphan:
        problems.append(
            _bad(
                f"Item '{rid}' of type 'reasoning' was provided without its required "
                "following item.",
                param="input",
            )
        )
    encrypted = item.get("encrypted_content")
    if ledger is None:
        return problems
    if isinstance(encrypted, str):
        raw = decode_encrypted_content(encrypted)
        if raw is None or not ledger.verify(REASONING_KIND, raw, rid):
            problems.append(
                _bad(
                    f"The encrypted content {_short(encrypted)} could not be verified.",
                    code="invalid_encrypted_content",
                )
            )
    elif ledger.recall("stored", rid) is None:
        problems.append(_not_stored(rid))
    return problems


def _not_stored(item_id: str) -> Rejection:
    return _bad(
        f"Item with id '{item_id}' not found. Items are not persisted when `store` is set to "
        "false. Try again with `store` set to true, or remove this item from your input.",
        status=404,
        param="input",
    )


def _check_function_call(items: Sequence[Any], i: int, item: JSONObject) -> list[Rejection]:
    problems = [
        _missing(f"input[{i}].{key}") for key in ("call_id", "name", "arguments") if key not in item
    ]
    if "arguments" in item and not isinstance(item["arguments"], str):
        problems.append(_invalid_type(f"input[{i}].arguments", "a string", item["arguments"]))
    call_id = item.get("call_id")
    later = items[i + 1 :]
    answered = any(
        isinstance(o, dict)
        and o.get("type") == "function_call_output"
        and o.get("call_id") == call_id
        for o in later
    )
    continues = any(
        not (isinstance(o, dict) and _item_type(o) in {"function_call", "reasoning"}) for o in later
    )
    if call_id is not None and not answered and continues:
        problems.append(_bad(f"No tool output found for function call {call_id}.", param="input"))
    return problems


def _check_input(items: list[Any], ledger: IssueLedger | None) -> list[Rejection]:
    problems: list[Rejection] = []
    calls_seen: set[object] = set()
    ids_present = {item.get("id") for item in items if isinstance(item, dict)}
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            problems.append(_invalid_type(f"input[{i}]", "an object", item))
            continue
        kind = _item_type(item)
        if kind == "function_call":
            problems.extend(_check_function_call(items, i, item))
            calls_seen.add(item.get("call_id"))
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if call_id not in calls_seen:
                problems.append(
                    _bad(
                        f"No tool call found for function call output with call_id {call_id}.",
                        param="input",
                    )
                )
            if not isinstance(item.get("output"), str | list):
                problems.append(
                    _invalid_type(f"input[{i}].output", "a string or an array", item.get("output"))
                )
        elif kind == "reasoning":
            problems.extend(_check_reasoning(items, i, item, ledger))
        elif (
            kind == "item_reference"
            and ledger is not None
            and ledger.recall("stored", str(item.get("id"))) is None
        ):
            problems.append(_not_stored(str(item.get("id"))))
        item_id = item.get("id")
        if ledger is not None and isinstance(item_id, str) and kind != "reasoning":
            required = ledger.recall("requires_reasoning", item_id)
            if required and required not in ids_present:
                problems.append(
                    _bad(
                        f"Item '{item_id}' of type '{kind}' was provided without its required "
                        f"'reasoning' item: '{required}'.",
                        param="input",
                    )
                )
    return problems


def check_responses(
    body: JSONObject, ledger: IssueLedger | None = None, *, count: bool = False
) -> list[Rejection]:
    """Rejections for a ``POST /v1/responses`` body (``count=True``: ``/input_tokens``)."""
    problems: list[Rejection] = []
    if count:
        problems.extend(
            _bad(f"Unknown parameter: '{key}'.", param=key, code="unknown_parameter")
            for key in body
            if key not in INPUT_TOKENS_PARAMS
        )
    elif "model" not in body:
        problems.append(_missing("model"))
    problems.extend(
        _bad(
            f"The fake server keeps no server-side state: `{key}` is not supported; "
            "send the full input instead.",
            param=key,
        )
        for key in ("previous_response_id", "conversation")
        if body.get(key) is not None
    )
    problems.extend(check_tools(body.get("tools")))
    items = body.get("input")
    if isinstance(items, list):
        problems.extend(_check_input(items, ledger))
    elif items is not None and not isinstance(items, str):
        problems.append(_invalid_type("input", "a string or an array", items))
    return problems


def validate_openai_responses_request(
    body: JSONObject, *, ledger: IssueLedger | None = None
) -> list[str]:
    """Problems the Responses API would report for this ``POST /v1/responses`` body.

    Without ``ledger`` only stateless rules run (pairing, ordering, tool shape);
    pass ``server.ledger`` to also verify encrypted content and stored items.
    """
    return [problem.message for problem in check_responses(body, ledger)]


def validate_openai_input_tokens_request(
    body: JSONObject, *, ledger: IssueLedger | None = None
) -> list[str]:
    """Problems for a ``POST /v1/responses/input_tokens`` body (unknown params included)."""
    return [problem.message for problem in check_responses(body, ledger, count=True)]


def _chat_missing_responses(
    messages: list[Any], start: int, pending: list[str]
) -> tuple[int, list[Rejection]]:
    """Walk the tool messages after an assistant message at ``start - 1``."""
    j = start
    problems: list[Rejection] = []
    remaining = list(pending)
    while j < len(messages) and isinstance(messages[j], dict) and messages[j].get("role") == "tool":
        call_id = messages[j].get("tool_call_id")
        if call_id in remaining:
            remaining.remove(call_id)
        else:
            problems.append(_chat_orphan_tool(j))
        j += 1
    if remaining:
        problems.append(
            _bad(
                "An assistant message with 'tool_calls' must be followed by tool messages "
                "responding to each 'tool_call_id'. The following tool_call_ids did not have "
                f"response messages: {', '.join(remaining)}",
                param=f"messages.[{j}].role",
            )
        )
    return j, problems


def _chat_orphan_tool(i: int) -> Rejection:
    return _bad(
        "Invalid parameter: messages with role 'tool' must be a response to a preceeding "
        "message with 'tool_calls'.",
        param=f"messages.[{i}].role",
    )


def check_chat_completions(body: JSONObject) -> list[Rejection]:
    """Rejections for a ``POST /v1/chat/completions`` body."""
    problems: list[Rejection] = [_missing(key) for key in ("model", "messages") if key not in body]
    tools = body.get("tools")
    if isinstance(tools, list):
        for i, tool in enumerate(tools):
            if not isinstance(tool, dict) or "function" not in tool:
                problems.append(_missing(f"tools[{i}].function"))
            elif not isinstance(tool["function"], dict) or "name" not in tool["function"]:
                problems.append(_missing(f"tools[{i}].function.name"))
    messages = body.get("messages")
    if not isinstance(messages, list):
        return problems
    i = 0
    while i < len(messages):
        message = messages[i]
        if not isinstance(message, dict):
            problems.append(_invalid_type(f"messages.[{i}]", "an object", message))
            i += 1
            continue
        role = message.get("role")
        calls = message.get("tool_calls") if role == "assistant" else None
        if isinstance(calls, list) and calls:
            ids = [str(call.get("id")) for call in calls if isinstance(call, dict)]
            i, found = _chat_missing_responses(messages, i + 1, ids)
            problems.extend(found)
            continue
        if role == "tool":
            problems.append(_chat_orphan_tool(i))
        i += 1
    return problems


def validate_chat_completions_request(body: JSONObject) -> list[str]:
    """Problems the Chat Completions API would report for this request body."""
    return [problem.message for problem in check_chat_completions(body)]

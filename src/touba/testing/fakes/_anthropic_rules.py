"""What the Anthropic Messages API refuses, as pure checks.

Messages follow what api.anthropic.com answers (collected from real error
reports). Like the real API, consecutive messages of one role form a single
turn. Signature checks run only when an ``IssueLedger`` is given.

``bind_prefix=True`` imitates models with *preserved thinking*: a thinking
block's signature also binds its prefix (top-level ``system``, ``tools`` and
everything sent before the block), so a block replayed after that prefix
changed (older turns trimmed or summarised, instructions edited, an earlier
thinking block left out) is refused as "bound to a different conversation".
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from dataclasses import dataclass, field
from typing import Any

from touba.testing.fakes._ledger import IssueLedger
from touba.testing.fakes._server import JSONObject, Rejection, canonical_json

__all__ = [
    "REDACTED_KIND",
    "THINKING_KIND",
    "check_messages",
    "decode_token",
    "thinking_prefix",
    "validate_anthropic_count_tokens_request",
    "validate_anthropic_messages_request",
]

THINKING_KIND = "anthropic.thinking"
REDACTED_KIND = "anthropic.redacted_thinking"

COUNT_TOKENS_PARAMS = frozenset(
    {
        "messages",
        "model",
        "cache_control",
        "context_management",
        "mcp_servers",
        "output_config",
        "speed",
        "system",
        "thinking",
        "tool_choice",
        "tools",
    }
)
_THINKING_TYPES = frozenset({"thinking", "redacted_thinking"})
_FINAL_THINKING_MESSAGE = (
    "When `thinking` is enabled, a final `assistant` message must start with a thinking "
    "block (preceeding the lastmost set of `tool_use` and `tool_result` blocks). We "
    "recommend you include thinking blocks from previous turns. To avoid this requirement, "
    "disable `thinking`. Please consult our documentation at "
    "https://docs.claude.com/en/docs/build-with-claude/extended-thinking"
)


_PREFIX_MISMATCH = (
    "The block is bound to a different conversation. Remove the block, or set "
    '`thinking.block_binding.prefix_mismatch_behavior` to "drop_block".'
)


def thinking_prefix(body: JSONObject, messages_before: list[Any], blocks_before: list[Any]) -> str:
    """The digest a preserved-thinking signature binds: what preceded the block."""
    prefix = {
        "system": body.get("system"),
        "tools": body.get("tools"),
        "messages": messages_before,
        "blocks": blocks_before,
    }
    return hashlib.sha256(canonical_json(prefix).encode()).hexdigest()


def _bad(message: str) -> Rejection:
    return Rejection(400, message)


def decode_token(value: object) -> bytes | None:
    """Standard base64 → bytes, or None when ``value`` is not valid base64."""
    if not isinstance(value, str):
        return None
    try:
        return base64.b64decode(value.encode(), validate=True)
    except (binascii.Error, ValueError):
        return None


@dataclass
class _Turn:
    """Consecutive messages of one role, merged as the API does."""

    role: str
    first: int
    blocks: list[tuple[int, int, JSONObject]] = field(default_factory=list)

    def tool_use_ids(self) -> list[str]:
        return [str(b.get("id")) for _, _, b in self.blocks if b.get("type") == "tool_use"]


def _blocks(content: object) -> list[JSONObject]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if isinstance(content, list):
        return [b if isinstance(b, dict) else {"type": None} for b in content]
    return []


def _turns(messages: list[Any]) -> tuple[list[_Turn], list[Rejection]]:
    turns: list[_Turn] = []
    problems: list[Rejection] = []
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ("user", "assistant"):
            problems.append(_bad(f"messages.{i}.role: Input should be 'user' or 'assistant'"))
            continue
        assert isinstance(message, dict)
        if not turns or turns[-1].role != role:
            turns.append(_Turn(role, i))
        turns[-1].blocks.extend((i, k, b) for k, b in enumerate(_blocks(message.get("content"))))
    return turns, problems


def _check_tool_pairing(turns: list[_Turn]) -> list[Rejection]:
    problems: list[Rejection] = []
    for t, turn in enumerate(turns):
        previous_ids = turns[t - 1].tool_use_ids() if t > 0 else []
        if turn.role == "user":
            for i, k, block in turn.blocks:
                if (
                    block.get("type") == "tool_result"
                    and block.get("tool_use_id") not in previous_ids
                ):
                    problems.append(
                        _bad(
                            f"messages.{i}.content.{k}: unexpected `tool_use_id` found in "
                            f"`tool_result` blocks: {block.get('tool_use_id')}. Each "
                            "`tool_result` block must have a corresponding `tool_use` block "
                            "in the previous message."
                        )
                    )
            continue
        ids = turn.tool_use_ids()
        if not ids:
            continue
        following = turns[t + 1] if t + 1 < len(turns) else None
        results = [] if following is None else [b for _, _, b in following.blocks]
        answered = {b.get("tool_use_id") for b in results if b.get("type") == "tool_result"}
        missing = [tool_id for tool_id in ids if tool_id not in answered]
        if missing:
            problems.append(
                _bad(
                    f"messages.{turn.first}: `tool_use` ids were found without `tool_result` "
                    f"blocks immediately after: {', '.join(missing)}. Each `tool_use` block "
                    "must have a corresponding `tool_result` block in the next message."
                )
            )
        elif following is not None and any(
            b.get("type") != "tool_result" for b in results[: len(ids)]
        ):
            problems.append(
                _bad(
                    f"messages.{following.first}: Did not find {len(ids)} `tool_result` "
                    "block(s) at the beginning of this message. Messages following `tool_use` "
                    "blocks must begin with a matching number of `tool_result` blocks."
                )
            )
    return problems


def _verify(
    ledger: IssueLedger, kind: str, token: bytes | None, payload: str, prefix: str | None
) -> str | None:
    """None when valid, else why: ``"content"`` (altered) or ``"prefix"`` (rebound)."""
    if token is None:
        return "content"
    if prefix is None:
        return None if ledger.verify(kind, token, payload) else "content"
    half = len(token) // 2
    if not ledger.verify(kind, token[:half], payload):
        return "content"
    return None if ledger.verify(kind, token[half:], payload + "\x00" + prefix) else "prefix"


def _check_thinking(
    body: JSONObject, turns: list[_Turn], ledger: IssueLedger | None, bind_prefix: bool
) -> list[Rejection]:
    problems: list[Rejection] = []
    messages = body.get("messages")
    assert isinstance(messages, list)
    for turn in turns:
        if turn.role != "assistant":
            continue
        first_blocks: dict[int, str] = {}
        has_thinking: set[int] = set()
        for i, k, block in turn.blocks:
            kind = str(block.get("type"))
            first_blocks.setdefault(i, kind)
            if kind in _THINKING_TYPES:
                has_thinking.add(i)
            prefix = (
                thinking_prefix(body, messages[:i], _blocks(messages[i].get("content"))[:k])
                if bind_prefix and kind in _THINKING_TYPES
                else None
            )
            if kind == "thinking":
                if "signature" not in block:
                    problems.append(
                        _bad(f"messages.{i}.content.{k}.thinking.signature: Field required")
                    )
                elif ledger is not None:
                    token = decode_token(block["signature"])
                    text = str(block.get("thinking", ""))
                    why = _verify(ledger, THINKING_KIND, token, text, prefix)
                    if why is not None:
                        problems.append(
                            _bad(
                                f"messages.{i}.content.{k}: Invalid `signature` in `thinking` block"
                                + (f". {_PREFIX_MISMATCH}" if why == "prefix" else "")
                            )
                        )
            elif kind == "redacted_thinking" and ledger is not None:
                token = decode_token(block.get("data"))
                why = _verify(ledger, REDACTED_KIND, token, "", prefix)
                if why is not None:
                    problems.append(
                        _bad(
                            f"messages.{i}.content.{k}: Invalid `data` in `redacted_thinking` block"
                            + (f". {_PREFIX_MISMATCH}" if why == "prefix" else "")
                        )
                    )
        problems.extend(
            _bad(
                f"messages.{i}.content.0: If an assistant message contains any thinking blocks, "
                f"the first block must be thinking or redacted_thinking. Found {first_blocks[i]}."
            )
            for i in sorted(has_thinking)
            if first_blocks[i] not in _THINKING_TYPES
        )
    return problems


def _check_final_thinking(body: JSONObject, turns: list[_Turn]) -> list[Rejection]:
    thinking = body.get("thinking")
    if not (isinstance(thinking, dict) and thinking.get("type") == "enabled") or len(turns) < 2:
        return []
    last, previous = turns[-1], turns[-2]
    if last.role != "user" or previous.role != "assistant":
        return []
    if not any(b.get("type") == "tool_result" for _, _, b in last.blocks):
        return []
    i, _, first = previous.blocks[0] if previous.blocks else (previous.first, 0, {"type": None})
    if first.get("type") in _THINKING_TYPES:
        return []
    return [
        _bad(
            f"messages.{i}.content.0.type: Expected `thinking` or `redacted_thinking`, but "
            f"found `{first.get('type')}`. {_FINAL_THINKING_MESSAGE}"
        )
    ]


def _check_forced_tool(body: JSONObject) -> list[Rejection]:
    """With thinking on (``enabled`` or ``adaptive``), only ``tool_choice`` ``auto`` or
    ``none`` is accepted: ``any`` and ``tool`` force tool use, which thinking cannot do."""
    thinking, choice = body.get("thinking"), body.get("tool_choice")
    if (
        isinstance(thinking, dict)
        and thinking.get("type") in ("enabled", "adaptive")
        and isinstance(choice, dict)
        and choice.get("type") in ("any", "tool")
    ):
        return [_bad("Thinking may not be enabled when tool_choice forces tool use.")]
    return []


def _check_tools(tools: object) -> list[Rejection]:
    if not isinstance(tools, list):
        return [] if tools is None else [_bad("tools: Input should be a valid list")]
    problems: list[Rejection] = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            problems.append(_bad(f"tools.{i}: Input should be a valid dictionary"))
        elif tool.get("type") in (None, "custom"):
            problems.extend(
                _bad(f"tools.{i}.custom.{key}: Field required")
                for key in ("name", "input_schema")
                if key not in tool
            )
    return problems


def check_messages(
    body: JSONObject,
    ledger: IssueLedger | None = None,
    *,
    count: bool = False,
    bind_prefix: bool = False,
) -> list[Rejection]:
    """Rejections for a ``POST /v1/messages`` body (``count=True``: ``/count_tokens``).

    ``bind_prefix``: thinking signatures also bind their prefix (preserved thinking).
    """
    problems: list[Rejection] = []
    if count:
        problems.extend(
            _bad(f"{key}: Extra inputs are not permitted")
            for key in body
            if key not in COUNT_TOKENS_PARAMS
        )
    required = ("model", "messages") if count else ("model", "messages", "max_tokens")
    problems.extend(_bad(f"{key}: Field required") for key in required if key not in body)
    problems.extend(_check_tools(body.get("tools")))
    problems.extend(_check_forced_tool(body))
    messages = body.get("messages")
    if not isinstance(messages, list):
        if messages is not None:
            problems.append(_bad("messages: Input should be a valid list"))
        return problems
    if not messages:
        problems.append(_bad("messages: at least one message is required"))
        return problems
    first = messages[0]
    if isinstance(first, dict) and first.get("role") != "user":
        problems.append(_bad('messages: first message must use the "user" role'))
    turns, found = _turns(messages)
    problems.extend(found)
    problems.extend(_check_tool_pairing(turns))
    problems.extend(_check_thinking(body, turns, ledger, bind_prefix))
    problems.extend(_check_final_thinking(body, turns))
    return problems


def validate_anthropic_messages_request(
    body: JSONObject, *, ledger: IssueLedger | None = None
) -> list[str]:
    """Problems the Messages API would report for this ``POST /v1/messages`` body.

    Pass ``server.ledger`` to also verify thinking signatures and redacted data.
    """
    return [problem.message for problem in check_messages(body, ledger)]


def validate_anthropic_count_tokens_request(
    body: JSONObject, *, ledger: IssueLedger | None = None
) -> list[str]:
    """Problems for a ``POST /v1/messages/count_tokens`` body (extra inputs included)."""
    return [problem.message for problem in check_messages(body, ledger, count=True)]

"""What the Gemini Developer API refuses, as pure checks.

Messages follow what generativelanguage.googleapis.com answers (collected from
real error reports). Thought-signature checks run only with an ``IssueLedger``.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

from touba.testing.fakes._ledger import IssueLedger
from touba.testing.fakes._server import JSONObject, Rejection, canonical_json

__all__ = [
    "PART_KIND",
    "check_count_tokens",
    "check_generate_content",
    "decode_signature",
    "part_fingerprint",
    "validate_gemini_count_tokens_request",
    "validate_gemini_generate_content_request",
]

PART_KIND = "gemini.part"

GENERATE_CONTENT_FIELDS = frozenset(
    {
        "model",
        "contents",
        "systemInstruction",
        "tools",
        "toolConfig",
        "safetySettings",
        "generationConfig",
        "cachedContent",
        "labels",
        "serviceTier",
        "store",
    }
)
COUNT_TOKENS_FIELDS = frozenset({"model", "contents", "generateContentRequest"})
_ROLES = frozenset({"user", "model", "function"})
_COUNT_MISMATCH = (
    "Please ensure that the number of function response parts is equal to the number of "
    "function call parts of the function call turn."
)


def _bad(message: str) -> Rejection:
    return Rejection(400, message)


def _unknown_field(name: str) -> Rejection:
    return _bad(f'Invalid JSON payload received. Unknown name "{name}": Cannot find field.')


def decode_signature(value: object) -> bytes | None:
    """Base64 (standard or URL-safe, padding optional) → bytes, or None."""
    if not isinstance(value, str):
        return None
    text = value.replace("-", "+").replace("_", "/")
    text += "=" * (-len(text) % 4)
    try:
        return base64.b64decode(text.encode(), validate=True)
    except (binascii.Error, ValueError):
        return None


def part_fingerprint(part: JSONObject) -> str:
    """What a thought signature covers: the call's name and args, or the text and thought flag."""
    call = part.get("functionCall")
    if isinstance(call, dict):
        return canonical_json({"functionCall": [call.get("name"), call.get("args") or {}]})
    return canonical_json({"text": [part.get("text", ""), bool(part.get("thought"))]})


def _parts(content: object) -> list[JSONObject]:
    parts = content.get("parts") if isinstance(content, dict) else None
    return [p for p in parts if isinstance(p, dict)] if isinstance(parts, list) else []


def _calls(content: object) -> list[JSONObject]:
    return [p for p in _parts(content) if "functionCall" in p]


def _responses(content: object) -> list[JSONObject]:
    return [p for p in _parts(content) if "functionResponse" in p]


def _role(content: object) -> object:
    return content.get("role", "user") if isinstance(content, dict) else None


def _check_turns(contents: list[Any]) -> list[Rejection]:
    problems: list[Rejection] = []
    for i, content in enumerate(contents):
        if _role(content) not in _ROLES:
            problems.append(_bad("Please use a valid role: user, model."))
            continue
        previous = contents[i - 1] if i > 0 else None
        if _responses(content) and not _calls(previous):
            problems.append(
                _bad(
                    "Please ensure that function response turn comes immediately after a "
                    "function call turn."
                )
            )
        calls = _calls(content)
        if not calls:
            continue
        if previous is None or (_role(previous) == "model"):
            problems.append(
                _bad(
                    "Please ensure that function call turn comes immediately after a user turn "
                    "or after a function response turn."
                )
            )
        if i + 1 < len(contents) and len(_responses(contents[i + 1])) != len(calls):
            problems.append(_bad(_COUNT_MISMATCH))
    return problems


def _current_turn_start(contents: list[Any]) -> int:
    """Index after the last user content that is not only function responses."""
    start = 0
    for i, content in enumerate(contents):
        parts = _parts(content)
        if _role(content) != "model" and any("functionResponse" not in p for p in parts):
            start = i + 1
    return start


SKIP_SIGNATURE_MARKER = "skip_thought_signature_validator"


def _check_signatures(contents: list[Any], ledger: IssueLedger | None) -> list[Rejection]:
    problems: list[Rejection] = []
    current = _current_turn_start(contents)
    for i, content in enumerate(contents):
        for j, part in enumerate(_parts(content)):
            signature = part.get("thoughtSignature")
            if signature is None:
                call = part.get("functionCall")
                if (
                    ledger is not None
                    and i >= current
                    and isinstance(call, dict)
                    and ledger.recall("signed_part", part_fingerprint(part)) == "signed"
                ):
                    problems.append(
                        _bad(
                            "Function call is missing a thought_signature in functionCall parts. "
                            "This is required for tools to work correctly, and missing "
                            "thought_signature may lead to degraded model performance. Additional "
                            f"data, function call `default_api:{call.get('name')}` , position {i}. "
                            "Please refer to "
                            "https://ai.google.dev/gemini-api/docs/thought-signatures for more "
                            "details."
                        )
                    )
                continue
            if signature == SKIP_SIGNATURE_MARKER:
                # Documented for function calls the model did not produce
                # (thought-signatures FAQ): accepted on calls of the current turn.
                if not (i >= current and isinstance(part.get("functionCall"), dict)):
                    problems.append(_bad("Corrupted thought signature."))
                continue
            token = decode_signature(signature)
            if token is None:
                problems.append(
                    _bad(
                        f"Invalid value at 'contents[{i}].parts[{j}].thought_signature' "
                        f'(TYPE_BYTES), Base64 decoding failed for "{signature}"'
                    )
                )
            elif ledger is not None and not ledger.verify(PART_KIND, token, part_fingerprint(part)):
                problems.append(_bad("Corrupted thought signature."))
    return problems


def check_generate_content(body: JSONObject, ledger: IssueLedger | None = None) -> list[Rejection]:
    """Rejections for a ``models/{model}:generateContent`` body."""
    problems = [_unknown_field(key) for key in body if key not in GENERATE_CONTENT_FIELDS]
    contents = body.get("contents")
    if not isinstance(contents, list) or not contents:
        problems.append(_bad("* GenerateContentRequest.contents: contents is not specified\n"))
        return problems
    problems.extend(_check_turns(contents))
    problems.extend(_check_signatures(contents, ledger))
    return problems


def check_count_tokens(body: JSONObject, ledger: IssueLedger | None = None) -> list[Rejection]:
    """Rejections for a ``countTokens`` body (``contents`` or ``generateContentRequest``)."""
    problems = [_unknown_field(key) for key in body if key not in COUNT_TOKENS_FIELDS]
    request = body.get("generateContentRequest")
    if request is None:
        return problems + check_generate_content({"contents": body.get("contents")}, ledger)
    if body.get("contents"):
        problems.append(
            _bad(
                "contents and generateContentRequest are mutually exclusive: send only one of them."
            )
        )
    if not isinstance(request, dict):
        return [*problems, _bad("Invalid value at 'generate_content_request': expected an object.")]
    model = request.get("model")
    if not (isinstance(model, str) and model.startswith(("models/", "tunedModels/"))):
        problems.append(_bad("* GenerateContentRequest.model: unexpected model name format\n"))
    return problems + check_generate_content(request, ledger)


def validate_gemini_generate_content_request(
    body: JSONObject, *, ledger: IssueLedger | None = None
) -> list[str]:
    """Problems Gemini would report for this ``generateContent`` body.

    Pass ``server.ledger`` to also verify (and require) issued thought signatures.
    """
    return [problem.message for problem in check_generate_content(body, ledger)]


def validate_gemini_count_tokens_request(
    body: JSONObject, *, ledger: IssueLedger | None = None
) -> list[str]:
    """Problems for a ``countTokens`` body, with ``contents`` or ``generateContentRequest``."""
    return [problem.message for problem in check_count_tokens(body, ledger)]

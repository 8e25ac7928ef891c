"""How the Anthropic provider sends its rendered bodies through the official SDK client.

``messages.create`` and ``messages.count_tokens`` copy the body they are given
(the SDK's ``copy_tree``) and serialise it again on every request; touba has
already rendered and checked that body. For a direct ``anthropic.AsyncAnthropic``
(a custom ``base_url`` included) touba serialises the body once and sends the
bytes with the client's low-level ``post``: base URL, auth, the client's headers,
its timeout (for ``/v1/messages`` the same non-streaming timeout the typed
method computes, and its refusal of a request too long to wait for), its retries
policy, transport and error classes are the SDK's as they are. The JSON the API
receives is the same. Platform clients (Bedrock, Vertex, ...) rewrite the body
on its way (model in the URL, version fields), so they keep the typed methods,
as does an SDK whose helpers this module cannot find.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from typing import Any

__all__ = ["open_stream", "send_count", "send_message", "streaming_required"]

_HEADER_OPTIONS = {
    "user_profile_id": "anthropic-user-profile-id",
    "workspace_id": "anthropic-workspace-id",
}


def _direct(client: Any) -> bool:
    """Whether ``client`` is a plain ``AsyncAnthropic`` whose helpers are the ones known here."""
    import anthropic

    return type(client) is anthropic.AsyncAnthropic and callable(getattr(client, "post", None))


def _options(request: Mapping[str, Any]) -> dict[str, Any]:
    headers = {"Content-Type": "application/json"}
    for option, header in _HEADER_OPTIONS.items():
        if request.get(option) is not None:
            headers[header] = request[option]
    headers.update(request.get("extra_headers") or {})
    options: dict[str, Any] = {"headers": headers}
    if "timeout" in request:
        options["timeout"] = request["timeout"]
    return options


def _generation_timeout(client: Any, body: Mapping[str, Any]) -> Any:
    """The timeout ``messages.create`` would use when none is set (or None: the client's)."""
    from anthropic._constants import DEFAULT_TIMEOUT, MODEL_NONSTREAMING_TOKENS

    if client.timeout != DEFAULT_TIMEOUT:
        return None
    limit = MODEL_NONSTREAMING_TOKENS.get(str(body.get("model")), None)
    return client._calculate_nonstreaming_timeout(body["max_tokens"], limit)


async def send_message(
    client: Any, body: Mapping[str, Any], params: Mapping[str, Any], request: Mapping[str, Any]
) -> bytes:
    """POST ``body`` to ``/v1/messages``; the answer's bytes.

    ``params`` and ``request`` are what ``messages.create`` takes (the typed
    path, for platform clients). Raises what the SDK raises.
    """
    if _direct(client):
        try:
            timeout = _generation_timeout(client, body)
        except (ImportError, AttributeError):
            pass  # an SDK without these helpers: its typed method below
        else:
            options = _options(request)
            if timeout is not None and "timeout" not in options:
                options["timeout"] = timeout
            text = await client.post(
                "/v1/messages", content=_encode(body), cast_to=str, options=options
            )
            return str(text).encode("utf-8")
    raw = await client.messages.with_raw_response.create(**params, **request)
    return bytes(await raw.read())


def streaming_required(client: Any, body: Mapping[str, Any], request: Mapping[str, Any]) -> bool:
    """Whether the SDK would refuse ``body`` as a non-streaming request.

    The anthropic SDK's own rule (``messages.create``): with the client's
    default timeout and none given for the request, a request whose
    ``max_tokens`` could take longer than 10 minutes (above 21,333 tokens: one
    hour per 128,000 tokens) or above its model's entry in
    ``MODEL_NONSTREAMING_TOKENS`` is refused before it is sent ("Streaming is
    required"). Asked of the SDK's helper itself; an SDK without it refuses
    nothing here (its typed method keeps its own rule).
    """
    if "timeout" in request:
        return False
    try:
        from anthropic._constants import DEFAULT_TIMEOUT, MODEL_NONSTREAMING_TOKENS

        if client.timeout != DEFAULT_TIMEOUT:
            return False
        limit = MODEL_NONSTREAMING_TOKENS.get(str(body.get("model")), None)
        client._calculate_nonstreaming_timeout(body["max_tokens"], limit)
    except (ImportError, AttributeError, KeyError, TypeError):
        return False
    except ValueError:
        return True
    return False


async def open_stream(
    client: Any, body: Mapping[str, Any], params: Mapping[str, Any], request: Mapping[str, Any]
) -> Any:
    """POST ``body`` with ``stream: true``; the SDK's ``AsyncStream`` of the events, as dicts.

    Use it as ``async with``: leaving closes the HTTP response. Platform
    clients go through ``messages.create(stream=True)`` (typed events, turned
    back into their JSON).
    """
    import anthropic

    if _direct(client):
        return await client.post(
            "/v1/messages",
            content=_encode({**body, "stream": True}),
            cast_to=object,
            options=_options(request),
            stream=True,
            stream_cls=anthropic.AsyncStream[object],
        )
    return _Typed(await client.messages.create(**params, **request, stream=True))


class _Typed:
    """A typed event stream of a platform client, yielding each event's JSON."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    async def __aenter__(self) -> _Typed:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._stream.close()

    async def __aiter__(self) -> AsyncIterator[Any]:
        async for event in self._stream:
            yield event.to_dict()


async def send_count(client: Any, params: Mapping[str, Any], request: Mapping[str, Any]) -> bytes:
    """POST ``params`` to ``/v1/messages/count_tokens``; the answer's bytes."""
    if _direct(client):
        text = await client.post(
            "/v1/messages/count_tokens",
            content=_encode(params),
            cast_to=str,
            options=_options(request),
        )
        return str(text).encode("utf-8")
    raw = await client.messages.with_raw_response.count_tokens(**params, **request)
    return bytes(await raw.read())


def _encode(body: Mapping[str, Any]) -> bytes:
    """The JSON the SDK would send (compact, ASCII-escaped as its encoder writes it)."""
    return json.dumps(dict(body), separators=(",", ":")).encode("utf-8")

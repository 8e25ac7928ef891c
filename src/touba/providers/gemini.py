"""The Gemini provider: ``generateContent`` through google-genai's ``genai.Client``.

``create_gemini_decision_provider`` renders each request once, in the REST
JSON shape (see :mod:`touba.providers._gemini_wire`), and posts that dict
through the SDK's own API client (``client.aio._api_client.async_request``):
base URL, API version, auth headers, timeouts and the host's retry options
stay the SDK's. Posting the rendered dict, rather than rebuilding it through
``client.aio.models.generate_content``'s typed converters, is what keeps

- the body counted by ``countTokens`` equal to the body sent (the typed
  converters re-encode ``thoughtSignature`` bytes as URL-safe base64 and drop
  fields they do not know);
- the model's parts replayed byte for byte (thought signatures on the very
  part that carried them);
- one request per decision: the SDK's automatic function calling and
  automatic continuation loops (both send requests nobody counted, the second
  one resumes server-side state) live in ``models.generate_content`` and are
  never entered, so automatic function calling is disabled by construction.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from touba.errors import (
    AgentDecisionProviderUnavailable,
    ConfigurationError,
    ProviderContextCountUnavailable,
    ProviderContextGuardUnsupported,
    ToubaError,
)
from touba.history._config import HistoryConfig
from touba.history._deadline import PROVIDER_DEADLINE_SECONDS
from touba.history._model import DecisionMessage
from touba.providers._base import DecisionProvider, Plan, Wire
from touba.providers._deadline import Paced
from touba.providers._gemini_wire import (
    PROVIDER,
    GeminiBody,
    count_request,
    exchange_memo,
    parse_response,
    read_content_stream,
    read_count,
    render_body,
    split_options,
)
from touba.providers._guard import ContextConfig
from touba.providers._refusal import body_message, retry_can_help
from touba.providers._stream import DeltaSink
from touba.providers._types import DecisionInterface, Usage

if TYPE_CHECKING:
    from google.genai import Client
    from google.genai._api_client import BaseApiClient
    from google.genai.client import AsyncClient

__all__ = ["GeminiWire", "create_gemini_decision_provider"]


def model_resource(model: str, *, vertex: bool) -> str:
    """The model's resource name, as the SDK writes it (``models/...`` on the Developer API)."""
    if vertex:
        if model.startswith(("projects/", "models/", "publishers/")):
            return model
        if "/" in model:
            publisher, name = model.split("/", 1)
            return f"publishers/{publisher}/models/{name}"
        return f"publishers/google/models/{model}"
    return model if model.startswith(("models/", "tunedModels/")) else f"models/{model}"


def _transport_errors() -> tuple[type[BaseException], ...]:
    """Exceptions meaning no HTTP answer arrived (connection, timeout, auth refresh)."""
    found: list[type[BaseException]] = [OSError, TimeoutError]
    for module, name in (
        ("httpx2", "HTTPError"),
        ("httpx", "HTTPError"),
        ("aiohttp", "ClientError"),
        ("google.auth.exceptions", "GoogleAuthError"),
    ):
        try:
            cls = getattr(importlib.import_module(module), name, None)
        except ImportError:
            continue
        if isinstance(cls, type) and issubclass(cls, BaseException):
            found.append(cls)
    return tuple(found)


class GeminiWire(Wire):
    """Gemini ``generateContent`` / ``countTokens`` over a google-genai API client."""

    provider: ClassVar[str] = PROVIDER
    streams: ClassVar[bool] = True

    def __init__(
        self,
        *,
        api_client: BaseApiClient,
        model: str,
        interface: DecisionInterface,
        max_output_tokens: int | None,
        generation: Mapping[str, Any],
        fields: Mapping[str, Any],
    ) -> None:
        super().__init__(model=model, interface=interface)
        self._api = api_client
        self._vertex = bool(api_client.vertexai)
        self._resource = model_resource(model, vertex=self._vertex)
        self._max_output_tokens = max_output_tokens
        self._generation = dict(generation)
        self._fields = dict(fields)
        self._exchanges = exchange_memo()

    def check_guard(self) -> None:
        """Wire.check_guard: refuse Vertex clients, cached content and extra_body."""
        if self._vertex:
            raise ProviderContextGuardUnsupported(
                "the context guard supports the Gemini Developer API only, not a Vertex-mode "
                "genai.Client: use a Developer API client, or drop context="
            )
        if "cachedContent" in self._fields:
            raise ProviderContextGuardUnsupported(
                "cached_content is server-side context the guard cannot count: send the "
                "messages explicitly, or drop context="
            )
        http_options = getattr(self._api, "_http_options", None)
        if getattr(http_options, "extra_body", None):
            raise ProviderContextGuardUnsupported(
                "the genai.Client's http_options.extra_body adds fields to every request that "
                "the guard cannot count: remove it, or drop context="
            )

    def render(self, plan: Plan) -> dict[str, Any]:
        """Wire.render: a ``generateContent`` body (see :func:`render_body`)."""
        return render_body(
            plan,
            max_output_tokens=self._max_output_tokens,
            generation=self._generation,
            fields=self._fields,
            memo=self._exchanges,
        )

    async def count(self, body: dict[str, Any]) -> int:
        """Wire.count: ``countTokens`` for the body; SDK errors become touba's, chained."""
        return read_count(await self._post("countTokens", count_request(body, self._resource)))

    async def generate(
        self, body: dict[str, Any], sink: DeltaSink | None = None
    ) -> tuple[DecisionMessage, Usage]:
        """Wire.generate: ``generateContent``; SDK errors become touba's, chained.

        With ``sink``: ``streamGenerateContent?alt=sse`` through the SDK's streamed
        request, merged by :func:`read_content_stream`.
        """
        if sink is None:
            data = await self._post("generateContent", body)
        else:
            data = await self._post("streamGenerateContent", body, sink)
        schema = body.output_schema if isinstance(body, GeminiBody) else None
        return parse_response(data, structured=self.interface == "structured", output_schema=schema)

    def _sendable(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """A copy of ``body`` the SDK may edit: it drops top-level ``_`` keys (a
        shallow copy suffices) and merges the client's ``http_options.extra_body``
        into nested objects (then a deep copy, by a JSON round trip: the body is
        JSON)."""
        if getattr(getattr(self._api, "_http_options", None), "extra_body", None):
            copied: dict[str, Any] = json.loads(json.dumps(dict(body)))
            return copied
        return dict(body)

    def _http_options(self) -> Any:
        """Per request: the client's timeout (ms) capped at the deadline; the rest of
        the client's ``http_options`` as they are (the SDK merges the two)."""
        deadline_ms = max(1, round(self.deadline_seconds * 1000))
        own = getattr(getattr(self._api, "_http_options", None), "timeout", None)
        return {"timeout": deadline_ms if own is None else min(int(own), deadline_ms)}

    async def _post(
        self, method: str, body: Mapping[str, Any], sink: DeltaSink | None = None
    ) -> Any:
        """POST through the SDK's client; every SDK failure is converted here, chained.

        With ``sink``: a streamed request (``?alt=sse``), its chunks merged; the
        HTTP response is closed on any exit (a cancelled ``decide`` included).
        """
        from google.genai import errors

        counting = method == "countTokens"
        try:
            if sink is not None:
                chunks = await self._api.async_request_streamed(
                    "post",
                    f"{self._resource}:{method}?alt=sse",
                    self._sendable(body),
                    self._http_options(),
                )
                async with contextlib.aclosing(chunks):
                    return await read_content_stream(Paced(_bodies(chunks)), sink)
            response = await self._api.async_request(
                "post", f"{self._resource}:{method}", self._sendable(body), self._http_options()
            )
            return json.loads(response.body or "")
        except errors.APIError as e:
            status = f"HTTP {e.code} {e.status}" if e.status else f"HTTP {e.code}"
            said = body_message(e.message) or body_message(e.details)
            code = e.code if isinstance(e.code, int) else None
            raise _failure(counting, status, code, said, e.status) from e
        except json.JSONDecodeError as e:
            raise _failure(counting, "an answer that is not JSON", None) from e
        except _transport_errors() as e:
            raise _failure(counting, type(e).__name__, None) from e


async def _bodies(chunks: Any) -> Any:
    """The JSON of each streamed chunk (the SDK hands each one's text)."""
    async for chunk in chunks:
        yield json.loads(chunk.body or "")


def _failure(
    counting: bool,
    what: str,
    status_code: int | None,
    server_message: str | None = None,
    kind: object = None,
) -> ToubaError:
    """The typed error of a failed request, with what the API said (see ``_refusal``)."""
    retryable = retry_can_help(status_code, server_message, kind)
    hint = (
        "Retry later, or check"
        if retryable
        else "The API refused this request (see its message), so a retry will not help; check"
    )
    if counting:
        return ProviderContextCountUnavailable(
            f"Gemini countTokens failed ({what}); nothing was generated. {hint} the client's "
            "key and base_url",
            status_code=status_code,
            server_message=server_message,
            retryable=retryable,
        )
    return AgentDecisionProviderUnavailable(
        f"Gemini generateContent failed ({what}); no decision was received and nothing was "
        f"stored. {hint} the client's key, model and base_url",
        status_code=status_code,
        server_message=server_message,
        retryable=retryable,
    )


def _api_client(client: object) -> BaseApiClient:
    from google import genai
    from google.genai.client import AsyncClient

    if client is None:
        try:
            client = genai.Client()
        except ValueError as e:
            raise ConfigurationError(
                "no Gemini credentials found: set GEMINI_API_KEY (or GOOGLE_API_KEY), or pass "
                "client=genai.Client(...)"
            ) from e
    aio = client.aio if isinstance(client, genai.Client) else client
    if not isinstance(aio, AsyncClient):
        raise ConfigurationError(
            f"client must be a google.genai.Client, got {type(client).__name__}"
        )
    return aio._api_client


def create_gemini_decision_provider(
    *,
    model: str,
    decision_interface: DecisionInterface = "native",
    history: HistoryConfig | bool | None = None,
    context: ContextConfig | None = None,
    max_output_tokens: int | None = None,
    client: Client | AsyncClient | None = None,
    deadline_seconds: float = PROVIDER_DEADLINE_SECONDS,
    **options: Any,
) -> DecisionProvider:
    """A decision provider over Gemini ``generateContent`` (SPEC section 2).

    ``client`` is a ``google.genai.Client`` or its ``.aio`` (None:
    ``genai.Client()`` with the SDK's usual environment variables).
    ``options`` are generation parameters in the SDK's snake_case
    (``temperature``, ``thinking_config``, ``safety_settings``,
    ``tool_config``, ... or ``config=GenerateContentConfig(...)``), sent in
    REST form; what touba renders itself is refused.

    ``deadline_seconds`` (default 120) bounds each request: no answer within it (for a
    stream, no event within it) is ``AgentDecisionProviderUnavailable``, retryable.
    """
    try:
        importlib.import_module("google.genai")
    except ImportError as e:
        raise ImportError(
            'the Gemini provider needs google-genai: pip install "touba[gemini]"'
        ) from e
    if not isinstance(model, str) or not model or re.search(r"\.\.|[?&#\s]", model):
        raise ConfigurationError(f"model must be a Gemini model name, got {model!r}")
    generation, fields = split_options(options)
    wire = GeminiWire(
        api_client=_api_client(client),
        model=model,
        interface=decision_interface,
        max_output_tokens=max_output_tokens,
        generation=generation,
        fields=fields,
    )
    return DecisionProvider(
        wire,
        history=history,
        context=context,
        max_output_tokens=max_output_tokens,
        deadline_seconds=deadline_seconds,
    )

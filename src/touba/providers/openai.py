"""The OpenAI decision provider, over the Responses API (SPEC section 2).

``create_openai_decision_provider`` posts to ``/responses`` through the
official ``openai`` SDK (as a stream, ``stream: true``, when ``decide`` is
given a sink: the SDK's ``AsyncStream`` reads the server-sent events), and
counts requests for the context guard with ``/responses/input_tokens``.
Both go through the client's low-level ``post`` with the body touba
rendered and checked, not through ``client.responses.create``: the typed
method would re-transform that body (about eight times the cost of the
request itself) into the same JSON. The client's base URL, auth (the same
``bearer_auth`` scope as the typed methods), headers, timeout, retries
policy, transport and error classes are the SDK's as they are. Every request
carries the full conversation explicitly: ``store=False`` with
``include=["reasoning.encrypted_content"]``, so reasoning items come back
self-contained and are replayed untouched; no server-side state (stored
responses, conversations, prompts, compaction) is ever relied on.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar, NoReturn

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
from touba.providers._deadline import Paced, capped_timeout
from touba.providers._guard import ContextConfig
from touba.providers._openai_wire import (
    ENCRYPTED_REASONING,
    OUTPUT_FORMAT,
    count_body,
    exchange_memo,
    function_tools,
    input_items,
    instructions,
    parse_response,
    read_response_stream,
    text_format,
)
from touba.providers._refusal import body_message, retry_can_help
from touba.providers._stream import DeltaSink
from touba.providers._types import DecisionInterface, Usage

if TYPE_CHECKING:
    from openai import AsyncOpenAI

__all__ = ["OpenAIWire", "create_openai_decision_provider"]

_OWNED = {
    "model": "pass it as model=",
    "input": "touba builds the input from the request and the history",
    "instructions": "pass them in DecisionRequest.instructions",
    "tools": "touba offers the request's capabilities as function tools",
    "max_output_tokens": "pass it as max_output_tokens= (the context guard reserves it)",
    "stream": "touba streams when decide() is given a sink",
    "stream_options": "touba streams when decide() is given a sink",
    "extra_headers": "configure the client instead: client.with_options(...)",
    "extra_query": "configure the client instead: client.with_options(...)",
    "extra_body": "pass generation parameters as keyword options",
    "timeout": "configure the client instead: client.with_options(timeout=...)",
}
_SERVER_STATE = ("previous_response_id", "conversation", "prompt", "context_management")
_HINTS = {
    401: "check OPENAI_API_KEY or the client's api_key",
    403: "check the project's access to this model and region",
    404: "check the model name and the client's base_url",
    429: "rate limited or out of quota; retry later or lower the request rate",
}


def _import_openai() -> Any:
    try:
        import openai
    except ImportError as e:
        raise ImportError(
            'the OpenAI provider needs the openai SDK: pip install "touba[openai]"'
        ) from e
    return openai


def _server_state(options: Mapping[str, Any]) -> list[str]:
    """Options that would make the server add to (or rewrite) what touba sends."""
    found = [key for key in _SERVER_STATE if options.get(key) is not None]
    if options.get("truncation") == "auto":
        found.append('truncation="auto"')
    return found


def _check_options(options: Mapping[str, Any], interface: DecisionInterface) -> dict[str, Any]:
    """Refuse options touba owns or cannot honour; return the pass-through ones."""
    from openai.resources.responses import AsyncResponses

    known = set(inspect.signature(AsyncResponses.create).parameters) - {"self"}
    for key, value in options.items():
        if key in _OWNED:
            raise ConfigurationError(f"option {key!r} is not accepted: {_OWNED[key]}")
        if key not in known:
            raise ConfigurationError(
                f"unknown option {key!r}: options are parameters of client.responses.create"
            )
        if key == "store" and value is not False:
            raise ConfigurationError(
                "store must stay False: touba sends the whole conversation explicitly with "
                "every request and keeps it in its own history store"
            )
        if key == "background" and value:
            raise ConfigurationError("background responses need store=True; touba waits instead")
    include = options.get("include") or []
    if not isinstance(include, list) or not all(isinstance(i, str) for i in include):
        raise ConfigurationError("option 'include' must be a list of str")
    text = options.get("text")
    if text is not None and (not isinstance(text, Mapping) or "format" in text):
        raise ConfigurationError(
            "option 'text' may set verbosity but not 'format': touba sets the format "
            f"for the {interface} interface and the request's output_schema"
        )
    try:
        json.dumps(dict(options))
    except (TypeError, ValueError) as e:
        raise ConfigurationError("options must be JSON values (they are sent as is)") from e
    return dict(options)


class OpenAIWire(Wire):
    """The Responses API: render, count, generate, and the SDK's errors."""

    provider: ClassVar[str] = "openai"
    streams: ClassVar[bool] = True

    def __init__(
        self,
        *,
        client: AsyncOpenAI,
        model: str,
        interface: DecisionInterface,
        max_output_tokens: int | None,
        options: Mapping[str, Any],
        owns_client: bool = False,
    ) -> None:
        super().__init__(model=model, interface=interface)
        self._client = client
        self._owns_client = owns_client
        # A generation the SDK would retry after a received error answer could
        # be produced twice; touba leaves retries to the runtime.
        self._generation_client = client.with_options(max_retries=0)
        self._max_output_tokens = max_output_tokens
        self._options = _check_options(options, interface)
        # merged with what touba sets, rather than passed through
        self._text = dict(self._options.pop("text", None) or {})
        self._include = list(self._options.pop("include", None) or [])
        if ENCRYPTED_REASONING not in self._include:
            self._include.append(ENCRYPTED_REASONING)
        self._request_options = request_options()
        self._exchanges = exchange_memo()

    def _sdk_options(self) -> Any:
        """The request options, with the client's timeout capped at the deadline (for a
        stream, httpx's read timeout bounds the silence between two chunks)."""
        timeout = capped_timeout(self._client.timeout, self.deadline_seconds)
        return {**self._request_options, "timeout": timeout}

    def refuse_server_state(self) -> None:
        """Without the guard, server-side conversation state is still refused."""
        found = _server_state(self._options)
        state = [key for key in found if not key.startswith("truncation")]
        if state:
            raise ConfigurationError(
                f"option(s) {', '.join(state)} make OpenAI add stored state to the request; "
                "touba always sends the conversation explicitly (store=False) from its own "
                "history: remove them"
            )

    async def aclose(self) -> None:
        """Wire.aclose: close the AsyncOpenAI client when this wire created it."""
        if self._owns_client:
            await self._client.close()

    def check_guard(self) -> None:
        """Wire.check_guard: refuse Azure clients and options that keep server-side state."""
        openai = _import_openai()
        if isinstance(self._client, openai.AsyncAzureOpenAI):
            raise ProviderContextGuardUnsupported(
                "the context guard counts with api.openai.com's /v1/responses/input_tokens, "
                "which Azure OpenAI does not offer; use an openai.AsyncOpenAI client (a custom "
                "base_url speaking the OpenAI protocol is fine) or drop context="
            )
        found = _server_state(self._options)
        if found:
            raise ProviderContextGuardUnsupported(
                f"the context guard cannot count what the server adds or drops with "
                f"{', '.join(found)}; remove them (touba sends the full conversation itself)"
            )

    def render(self, plan: Plan) -> dict[str, Any]:
        """Wire.render: a Responses API body (store=False, every output item replayed)."""
        request = plan.request
        body: dict[str, Any] = {"model": self.model}
        system = instructions(request, self.interface)
        if system:
            body["instructions"] = system
        body["input"] = input_items(plan, self._exchanges)
        if self.interface == "native" and request.capabilities:
            body["tools"] = function_tools(request.capabilities)
        if self._max_output_tokens is not None:
            body["max_output_tokens"] = self._max_output_tokens
        body.update(self._options)
        text = dict(self._text)
        format_ = text_format(request, self.interface)
        if format_ is not None:
            text["format"] = format_
        if text:
            body["text"] = text
        body["store"] = False
        body["include"] = list(self._include)
        return body

    async def count(self, body: dict[str, Any]) -> int:
        """Wire.count: ``POST /v1/responses/input_tokens`` (ProviderContextCountUnavailable)."""
        try:
            text = await self._client.post(
                "/responses/input_tokens",
                body=count_body(body),
                cast_to=str,
                options=self._sdk_options(),
            )
            result = json.loads(text)
        except Exception as e:
            _raise_sdk_error(e, counting=True)
        value = result.get("input_tokens") if isinstance(result, dict) else None
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ProviderContextCountUnavailable(
                "OpenAI's input-token count answered without a valid input_tokens field; "
                "nothing was generated"
            )
        return value

    async def generate(
        self, body: dict[str, Any], sink: DeltaSink | None = None
    ) -> tuple[DecisionMessage, Usage]:
        """Wire.generate: ``POST /v1/responses``; SDK errors become touba's, chained.

        With ``sink``: ``stream: true``, read through the SDK's ``AsyncStream``.
        """
        try:
            if sink is None:
                text = await self._generation_client.post(
                    "/responses", body=body, cast_to=str, options=self._sdk_options()
                )
                data = json.loads(text)
            else:
                data = await self._stream(body, sink)
        except ToubaError:
            raise
        except Exception as e:
            _raise_sdk_error(e, counting=False)
        wrapped = body.get("text", {}).get("format", {}).get("name") == OUTPUT_FORMAT
        return parse_response(data, interface=self.interface, wrapped_output=wrapped)

    async def _stream(self, body: dict[str, Any], sink: DeltaSink) -> Any:
        """The streamed response's final body; the HTTP response is closed on any exit
        (a cancelled ``decide`` included)."""
        openai = _import_openai()
        stream = await self._generation_client.post(
            "/responses",
            body={**body, "stream": True},
            cast_to=object,
            options=self._sdk_options(),
            stream=True,
            stream_cls=openai.AsyncStream[object],
        )
        async with stream:
            return await read_response_stream(Paced(stream), sink)


def request_options() -> Any:
    """The request options the SDK's typed Responses methods send: the API-key auth
    scope only (never an admin key), where the SDK has auth scopes."""
    try:
        from openai._base_client import make_request_options
    except ImportError:  # pragma: no cover - an SDK without the helper: its defaults
        return {}
    if "security" not in inspect.signature(make_request_options).parameters:
        return {}  # pragma: no cover - an SDK before auth scopes
    return make_request_options(security={"bearer_auth": True})


def _raise_sdk_error(error: Exception, *, counting: bool) -> NoReturn:
    """The one place SDK and transport failures become touba errors (chained)."""
    openai = _import_openai()
    if not isinstance(error, openai.OpenAIError | ValueError):
        raise error
    status: int | None = None
    said: str | None = None
    retryable = True
    if isinstance(error, openai.APIStatusError):
        status = error.status_code
        kind = error.code or error.type or "error"
        detail = f"HTTP {status} ({kind}; request id {error.request_id or 'unknown'})"
        said = body_message(error.body)
        retryable = retry_can_help(status, said, error.type)
        hint = _HINTS.get(status) or (
            "retry later" if retryable else "the API refused this request: a retry will not help"
        )
    elif isinstance(error, openai.APIError) and type(error) is openai.APIError:
        # an error event inside a stream, which the SDK raises itself
        said = body_message(error.body)
        retryable = retry_can_help(500, said, error.type)
        detail = "an error event in the stream"
        hint = "retry later" if retryable else "the API refused this request: a retry will not help"
    elif isinstance(error, openai.APITimeoutError):
        detail, hint = "a timeout", "retry later or raise the client's timeout"
    elif isinstance(error, openai.APIConnectionError):
        detail, hint = "a connection failure", "check the network and the client's base_url"
    else:
        detail, hint = f"an unreadable answer ({type(error).__name__})", "check base_url"
    if counting:
        raise ProviderContextCountUnavailable(
            f"OpenAI's input-token count failed with {detail}; nothing was generated: {hint}, "
            "or create the provider without context= to skip the guard",
            status_code=status,
            server_message=said,
            retryable=retryable,
        ) from error
    raise AgentDecisionProviderUnavailable(
        f"the OpenAI Responses API failed with {detail}; nothing was stored: {hint}",
        status_code=status,
        server_message=said,
        retryable=retryable,
    ) from error


def create_openai_decision_provider(
    *,
    model: str,
    decision_interface: DecisionInterface = "native",
    history: HistoryConfig | bool | None = None,
    context: ContextConfig | None = None,
    max_output_tokens: int | None = None,
    client: AsyncOpenAI | None = None,
    deadline_seconds: float = PROVIDER_DEADLINE_SECONDS,
    **options: Any,
) -> DecisionProvider:
    """A decision provider over OpenAI's Responses API.

    ``client`` is an ``openai.AsyncOpenAI`` (default: one built from the SDK's
    environment variables, ``OPENAI_API_KEY``...). ``options`` are extra
    parameters of ``client.responses.create`` (``reasoning``, ``temperature``,
    ``text={"verbosity": ...}``...); options that would hand the conversation
    to server-side state are refused.

    ``deadline_seconds`` (default 120) bounds each request: no answer within it (for a
    stream, no event within it) is ``AgentDecisionProviderUnavailable``, retryable.
    """
    openai = _import_openai()
    if not isinstance(model, str) or not model:
        raise ConfigurationError("model must be a non-empty str, e.g. model='gpt-4.1-mini'")
    owns_client = client is None
    if client is None:
        try:
            client = openai.AsyncOpenAI()
        except openai.OpenAIError as e:
            raise ConfigurationError(
                "no OpenAI client could be built: set OPENAI_API_KEY or pass client="
            ) from e
    elif not isinstance(client, openai.AsyncOpenAI):
        raise ConfigurationError(
            f"client must be an openai.AsyncOpenAI (the Responses API, async), "
            f"not {type(client).__name__}"
        )
    wire = OpenAIWire(
        client=client,
        model=model,
        interface=decision_interface,
        max_output_tokens=max_output_tokens,
        options=options,
        owns_client=owns_client,
    )
    if context is None:
        wire.refuse_server_state()
    return DecisionProvider(
        wire,
        history=history,
        context=context,
        max_output_tokens=max_output_tokens,
        deadline_seconds=deadline_seconds,
    )

"""Anthropic Messages API decision provider (``touba[anthropic]``).

``create_anthropic_decision_provider`` posts to ``/v1/messages``
(``max_tokens=max_output_tokens``) on an ``anthropic.AsyncAnthropic``: as a
stream (``stream: true``, the SDK's ``AsyncStream`` of server-sent events
assembled back into the message the non-streaming request answers) when
``decide`` is given a sink, and also whenever the SDK would refuse the
non-streaming request (``max_tokens`` above its non-streaming limit, see
``_anthropic_post.streaming_required``); otherwise non-streaming. The
context guard counts the same body with ``/v1/messages/count_tokens``, built
from that endpoint's allow-list of parameters. Conversion lives in
``_anthropic_wire``, the SDK call in ``_anthropic_post`` (the client's
``post``; the typed methods for platform clients).

Interfaces. ``"native"``: capabilities are tools; a response with
``tool_use`` blocks is a call decision, one with text only is final (parsed
as JSON when ``output_schema`` is set; the schema is stated in ``system``).
``"structured"``: one tool, ``touba_decision``, whose ``input_schema`` is
``structured_schema(...)``. Structured outputs (``output_config.format``)
were not chosen: their JSON Schema subset needs ``additionalProperties:
false`` on every object, which a decision with free-form capability
arguments cannot satisfy.

Tool choice and thinking (decided here). The Messages API refuses a
``tool_choice`` that forces tool use (``any`` or ``tool``) whenever thinking
is on ("Thinking may not be enabled when tool_choice forces tool use"; the
docs allow only ``auto`` and ``none`` with thinking). So the structured
interface forces ``touba_decision`` only when thinking is off (``thinking``
absent or ``{"type": "disabled"}``); with ``"enabled"`` or ``"adaptive"``
thinking it offers that one tool with ``tool_choice={"type": "auto"}``, and
the system prompt asks for it; an answer that does not call it is a
``missing_decision`` (or ``empty_output``) schema violation, as a forced call
that came back empty would be. A model that thinks when ``thinking`` is
absent (a default some models have) is the host's to configure: pass its
thinking mode explicitly. A ``tool_choice`` option of the host's that forces
tool use together with thinking on is refused at construction
(ConfigurationError), never sent.

Thinking blocks and the prefix rule (decided here). Newer models ("preserved
thinking") bind each thinking/redacted_thinking block's signature to its
prefix: top-level ``system``, ``tools`` and every message before the block.
If the prefix changed, the block and all later ones are invalid and the API
rejects the request (400) or, with
``thinking.block_binding.prefix_mismatch_behavior="drop_block"``, silently
drops them. The docs' remedy for trimmed or summarised history is to remove
the thinking of the kept turns. Older models check only the block's own
content, strip earlier turns' thinking themselves, and require, when
``thinking.type == "enabled"``, that the final assistant message answered by
``tool_result`` blocks start with its thinking block. So:

- each decision's opaque data is ``{"content": <the response content,
  verbatim>, "prefix": sha256 of the system, tools and messages it was
  generated after}``;
- at render time a decision replays its content exactly while the digest of
  what now precedes it equals the stored one (the window starts where it
  did, same summary, prior turns, instructions and tools); otherwise its
  thinking blocks are removed, which also changes the prefix of every later
  decision, so theirs go too;
- exception: the final assistant turn of a tool-use continuation keeps its
  blocks when ``thinking.type == "enabled"`` because the API documents them
  as required there. After a trim inside a tool loop this is the only
  request that can succeed on models without prefix binding, and on models
  with it the API answers 400 (AgentDecisionProviderUnavailable, status 400,
  never a compaction signal) unless the host sets ``drop_block``. Hosts on
  such models should use ``"adaptive"`` thinking (stale blocks are then
  removed, as documented) or bounds that do not trim a running tool loop.

Server-side state and edits (``container``, ``context_management``,
``mcp_servers``), Bedrock, Vertex, Google Cloud, Foundry and AWS platform
clients are refused by the guard (ProviderContextGuardUnsupported): it only
vouches for the direct Messages API (a custom ``base_url`` speaking it is
fine). Requests are sent with ``max_retries=0``: no response is retried.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from touba.errors import (
    AgentDecisionProviderSchemaViolation,
    AgentDecisionProviderUnavailable,
    ConfigurationError,
    ProviderContextCountUnavailable,
    ProviderContextGuardUnsupported,
    ToubaError,
)
from touba.history._config import HistoryConfig
from touba.history._deadline import PROVIDER_DEADLINE_SECONDS
from touba.history._model import DecisionMessage, canonical_json
from touba.providers._anthropic_post import (
    open_stream,
    send_count,
    send_message,
    streaming_required,
)
from touba.providers._anthropic_wire import (
    DECISION_TOOL,
    ThinkingMode,
    exchange_memo,
    parse_message,
    prefix_digest,
    read_message_stream,
    render_messages,
)
from touba.providers._base import DecisionProvider, Plan, Wire
from touba.providers._deadline import Paced
from touba.providers._framing import structured_instructions, structured_schema
from touba.providers._guard import ContextConfig
from touba.providers._refusal import body_message, retry_can_help
from touba.providers._stream import DeltaSink
from touba.providers._types import DecisionInterface, Usage

if TYPE_CHECKING:
    import anthropic

__all__ = ["AnthropicWire", "create_anthropic_decision_provider"]

# Parameters of POST /v1/messages/count_tokens (the guard counts only these).
COUNT_PARAMS = frozenset(
    {
        "messages",
        "model",
        "system",
        "tools",
        "tool_choice",
        "thinking",
        "output_config",
        "cache_control",
        "speed",
    }
)
# Generation-only parameters: they do not change the input the model reads.
GENERATION_ONLY = frozenset(
    {
        "max_tokens",
        "metadata",
        "stop_sequences",
        "service_tier",
        "inference_geo",
        "diagnostics",
        "temperature",
        "top_p",
        "top_k",
    }
)
# Named parameters of messages.create in the SDK; any other body key goes in extra_body.
_CREATE_PARAMS = COUNT_PARAMS | {
    "max_tokens",
    "metadata",
    "stop_sequences",
    "service_tier",
    "inference_geo",
    "diagnostics",
    "container",
}
# Per-request options of the SDK methods (headers, timeout), sent with both calls.
_REQUEST_OPTIONS = frozenset({"extra_headers", "timeout", "user_profile_id", "workspace_id"})
_OWNED = frozenset(
    {"model", "messages", "system", "tools", "max_tokens", "stream", "output_format"}
    | {"extra_body", "extra_query"}
)
_PLATFORM_CLIENTS = (
    "AnthropicBedrock",
    "AsyncAnthropicBedrock",
    "AnthropicBedrockMantle",
    "AsyncAnthropicBedrockMantle",
    "AnthropicVertex",
    "AsyncAnthropicVertex",
    "AnthropicGoogleCloud",
    "AsyncAnthropicGoogleCloud",
    "AnthropicFoundry",
    "AsyncAnthropicFoundry",
    "AnthropicAWS",
    "AsyncAnthropicAWS",
)
_INSTALL = 'the Anthropic provider needs the anthropic SDK: pip install "touba[anthropic]"'


def _sdk() -> Any:
    try:
        import anthropic
    except ImportError as e:  # pragma: no cover - exercised without the extra
        raise ImportError(_INSTALL) from e
    return anthropic


class _Body(dict[str, Any]):
    """A rendered request body that remembers what parsing its answer needs.

    ``prefix`` is the :func:`prefix_digest` of the body as rendered, valid while
    its ``system``, ``tools`` and ``messages`` are the very objects it hashed.
    """

    output_schema: Mapping[str, Any] | None = None
    prefix: tuple[str, Any, Any, Any] | None = None

    def prefix_digest(self) -> str:
        known = self.prefix
        if known is not None:
            digest, system, tools, messages = known
            if (
                self.get("system") is system
                and self.get("tools") is tools
                and self.get("messages") is messages
            ):
                return digest
        return prefix_digest(self.get("system"), self.get("tools"), self["messages"])


class AnthropicWire(Wire):
    """The Messages API at the edge; SDK errors are converted in ``count``/``generate``."""

    provider: ClassVar[str] = "anthropic"
    streams: ClassVar[bool] = True

    def __init__(
        self,
        *,
        client: Any,
        model: str,
        interface: DecisionInterface,
        max_output_tokens: int,
        options: Mapping[str, Any],
    ) -> None:
        super().__init__(model=model, interface=interface)
        self._client = client
        self._max_tokens = max_output_tokens
        self._body_options = {k: v for k, v in options.items() if k not in _REQUEST_OPTIONS}
        self._request_options = {k: v for k, v in options.items() if k in _REQUEST_OPTIONS}
        thinking = self._body_options.get("thinking")
        self._thinking: ThinkingMode = (
            thinking.get("type") if isinstance(thinking, Mapping) else None
        )
        self._exchanges = exchange_memo()

    def check_guard(self) -> None:
        """Wire.check_guard: refuse platform clients and options count_tokens cannot count."""
        sdk = _sdk()
        for name in _PLATFORM_CLIENTS:
            platform = getattr(sdk, name, None)
            if isinstance(platform, type) and isinstance(self._client, platform):
                raise ProviderContextGuardUnsupported(
                    f"the context guard counts with the direct Messages API and cannot vouch "
                    f"for an {name} client; use anthropic.AsyncAnthropic (a custom base_url "
                    "speaking the Messages API is fine), or drop context="
                )
        uncounted = sorted(set(self._body_options) - COUNT_PARAMS - GENERATION_ONLY)
        if uncounted:
            raise ProviderContextGuardUnsupported(
                f"the context guard cannot count option(s) {', '.join(uncounted)} (server-side "
                "state or edits, or parameters count_tokens does not take); remove them or "
                "drop context="
            )

    def render(self, plan: Plan) -> dict[str, Any]:
        """Wire.render: a Messages API body (system, tools, messages, then the options given)."""
        request = plan.request
        system = request.instructions.strip()
        tools: list[dict[str, Any]] | None
        if plan.interface == "structured":
            rules = structured_instructions(request.capabilities, request.output_schema)
            system = f"{system}\n\n{rules} Give it as the input of the {DECISION_TOOL} tool."
            tools = [
                {
                    "name": DECISION_TOOL,
                    "description": "Record your decision: capability calls, or the final output.",
                    "input_schema": structured_schema(request.capabilities, request.output_schema),
                }
            ]
        else:
            if request.output_schema is not None:
                schema = canonical_json(dict(request.output_schema))
                system = (
                    f"{system}\n\nWhen you give your final answer instead of calling a tool, "
                    f"reply with only a JSON value matching this JSON Schema: {schema}"
                )
            tools = [_tool(c.name, c.description, dict(c.parameters)) for c in request.capabilities]
        body = _Body(model=self.model, max_tokens=self._max_tokens)
        if system.strip():
            body["system"] = system.strip()
        if tools:
            body["tools"] = tools
        if plan.interface == "structured":
            body["tool_choice"] = _decision_choice(self._thinking)
        messages, digest = render_messages(
            prior_turns=plan.prior_turns,
            request_input=request.input,
            summary=plan.summary,
            exchanges=self._exchanges.rendered(plan.window, plan.interface),
            interface=plan.interface,
            system=body.get("system"),
            tools=body.get("tools"),
            thinking=self._thinking,
        )
        body["messages"] = messages
        system_sent, tools_sent = body.get("system"), body.get("tools")
        body.update(self._body_options)
        body.output_schema = request.output_schema
        body.prefix = (digest, system_sent, tools_sent, messages)
        return body

    async def count(self, body: dict[str, Any]) -> int:
        """Wire.count: ``messages.count_tokens``; ProviderContextCountUnavailable when unusable."""
        params = {k: v for k, v in body.items() if k in COUNT_PARAMS}
        try:
            data = json.loads(await send_count(self._client, params, self._request_options))
        except (TypeError, ValueError) as e:
            if not isinstance(e, json.JSONDecodeError):
                raise _refused_locally(e) from e
            raise _count_unavailable(e) from e
        except Exception as e:
            raise _count_unavailable(e) from e
        count = data.get("input_tokens") if isinstance(data, dict) else None
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ProviderContextCountUnavailable(
                "messages.count_tokens answered without a valid input_tokens; nothing was generated"
            )
        return count

    async def generate(
        self, body: dict[str, Any], sink: DeltaSink | None = None
    ) -> tuple[DecisionMessage, Usage]:
        """Wire.generate: ``messages.create``; SDK errors become touba's, chained.

        As a stream with ``sink``, or when the SDK refuses the request as a
        non-streaming one (see :func:`streaming_required`).
        """
        params = {k: v for k, v in body.items() if k in _CREATE_PARAMS}
        extra = {k: v for k, v in body.items() if k not in _CREATE_PARAMS}
        if extra:
            params["extra_body"] = extra
        sdk = _sdk()
        streamed = sink is not None or streaming_required(self._client, body, self._request_options)
        try:
            if streamed:
                events = await open_stream(self._client, body, params, self._request_options)
                async with events:  # closed on any exit, a cancelled decide included
                    data: Any = await read_message_stream(Paced(events), sink or _no_sink)
            else:
                payload = await send_message(self._client, body, params, self._request_options)
        except ToubaError:
            raise
        except sdk.APIStatusError as e:
            said = body_message(e.body)
            if streamed and e.status_code == 200:  # an ``error`` event inside the stream
                retryable = retry_can_help(500, said, getattr(e, "type", None))
                raise AgentDecisionProviderUnavailable(
                    f"the Messages API stream sent an error event ({_describe(e)}); no "
                    f"decision was received and nothing was stored{_no_retry(retryable)}",
                    server_message=said,
                    retryable=retryable,
                ) from e
            retryable = retry_can_help(e.status_code, said, getattr(e, "type", None))
            raise AgentDecisionProviderUnavailable(
                f"the Messages API answered HTTP {e.status_code} ({_describe(e)}); no decision "
                f"was received and nothing was stored{_no_retry(retryable)}",
                status_code=e.status_code,
                server_message=said,
                retryable=retryable,
            ) from e
        except (TypeError, ValueError) as e:
            raise _refused_locally(e) from e
        except Exception as e:
            raise AgentDecisionProviderUnavailable(
                f"the Messages API could not be reached ({_describe(e)}); no decision was "
                "received and nothing was stored"
            ) from e
        if not streamed:
            try:
                data = json.loads(payload)
            except ValueError as e:
                raise AgentDecisionProviderSchemaViolation(
                    "the Messages API answered with a body that is not JSON",
                    provider_error_code="malformed_response",
                ) from e
        if isinstance(body, _Body):
            prefix, schema = body.prefix_digest(), body.output_schema
        else:
            prefix = prefix_digest(body.get("system"), body.get("tools"), body["messages"])
            schema = None
        message = parse_message(data, interface=self.interface, output_schema=schema, prefix=prefix)
        return message, _usage(data)


async def _no_sink(delta: object) -> None:
    """Where the deltas of a stream nobody asked for go (a long ``max_tokens``)."""


def _thinks(mode: ThinkingMode) -> bool:
    """Whether thinking is on, which rules out a forced tool choice."""
    return mode in ("enabled", "adaptive")


def _decision_choice(mode: ThinkingMode) -> dict[str, Any]:
    """The structured interface's tool choice (see the module docstring)."""
    if _thinks(mode):
        return {"type": "auto", "disable_parallel_tool_use": True}
    return {"type": "tool", "name": DECISION_TOOL, "disable_parallel_tool_use": True}


def _count_unavailable(error: BaseException) -> ProviderContextCountUnavailable:
    status = getattr(error, "status_code", None)
    status = status if isinstance(status, int) else None
    said = body_message(getattr(error, "body", None)) if status is not None else None
    retryable = retry_can_help(status, said, getattr(error, "type", None))
    hint = "Retry later" if retryable else "The API refused this request: a retry will not help"
    return ProviderContextCountUnavailable(
        f"messages.count_tokens failed ({_describe(error)}); nothing was generated. "
        f"{hint}, or drop context= to generate without the guard",
        status_code=status,
        server_message=said,
        retryable=retryable,
    )


def _no_retry(retryable: bool) -> str:
    """What a refusal adds to the message: a retry will not help (see ``_refusal``)."""
    return "" if retryable else "; the API refused this request: a retry will not help"


def _refused_locally(error: BaseException) -> ConfigurationError:
    """The SDK refused before sending (no credentials, a non-streaming limit...)."""
    return ConfigurationError(f"the anthropic SDK refused the request before sending it: {error}")


def _tool(name: str, description: str, parameters: dict[str, Any]) -> dict[str, Any]:
    tool: dict[str, Any] = {"name": name, "input_schema": parameters}
    if description:
        tool["description"] = description
    return tool


def _describe(error: BaseException) -> str:
    """The error's kind, never its text (an API message may quote request content: it
    goes to ``server_message`` instead)."""
    kind = getattr(error, "type", None)
    request_id = getattr(error, "request_id", None)
    parts = [type(error).__name__] + [str(p) for p in (kind, request_id) if isinstance(p, str)]
    return ", ".join(parts)


def _usage(data: Any) -> Usage:
    usage = data.get("usage") if isinstance(data, Mapping) else None
    if not isinstance(usage, Mapping):
        return Usage()

    def tokens(key: str) -> int | None:
        value = usage.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    details = {
        k: v
        for k, v in usage.items()
        if k not in ("input_tokens", "output_tokens") and isinstance(v, int | str)
    }
    return Usage(tokens("input_tokens"), tokens("output_tokens"), details)


def _check_options(
    options: Mapping[str, Any], interface: DecisionInterface, history: HistoryConfig | bool | None
) -> None:
    owned = sorted(set(options) & _OWNED)
    if owned:
        raise ConfigurationError(
            f"option(s) {', '.join(owned)} are set by touba itself; remove them"
        )
    output_config = options.get("output_config")
    if output_config is not None and (
        not isinstance(output_config, Mapping) or output_config.get("format") is not None
    ):
        raise ConfigurationError(
            "output_config must be a mapping without 'format': touba asks for the decision "
            "format itself (effort is fine)"
        )
    thinking = options.get("thinking")
    mode = thinking.get("type") if isinstance(thinking, Mapping) else None
    if thinking is not None and mode not in ("enabled", "adaptive", "disabled"):
        raise ConfigurationError(
            "thinking must be a mapping with type 'enabled' (and budget_tokens), 'adaptive' "
            f"or 'disabled', got {thinking!r}"
        )
    if interface == "structured" and "tool_choice" in options:
        raise ConfigurationError("the structured interface sets tool_choice itself; remove it")
    choice = options.get("tool_choice")
    choice_type = choice.get("type") if isinstance(choice, Mapping) else None
    if choice_type in ("any", "tool") and _thinks(mode):
        raise ConfigurationError(
            f"tool_choice {choice_type!r} forces tool use, which the Messages API refuses "
            f"with thinking type {mode!r}; use tool_choice {{'type': 'auto'}} (or 'none'), or "
            "turn thinking off"
        )
    continuity = history.continuity if isinstance(history, HistoryConfig) else "inline"
    if mode == "enabled" and continuity == "opaque_refs":
        raise ConfigurationError(
            "with thinking type 'enabled' the Messages API requires the thinking blocks of the "
            "turn a tool result answers, which continuity='opaque_refs' does not keep; use "
            "'inline' continuity or 'adaptive' thinking"
        )


def create_anthropic_decision_provider(
    *,
    model: str,
    decision_interface: DecisionInterface = "native",
    history: HistoryConfig | bool | None = None,
    context: ContextConfig | None = None,
    max_output_tokens: int | None = 1024,
    client: anthropic.AsyncAnthropic | None = None,
    deadline_seconds: float = PROVIDER_DEADLINE_SECONDS,
    **options: Any,
) -> DecisionProvider:
    """A decision provider on the Anthropic Messages API (see the module docstring).

    ``client`` defaults to ``anthropic.AsyncAnthropic()`` (``ANTHROPIC_API_KEY``
    from the environment); ``options`` are extra Messages parameters
    (``thinking``, ``output_config`` effort, ``metadata``, ``extra_headers``...).

    ``deadline_seconds`` (default 120) bounds each request: no answer within it (for a
    stream, no event within it) is ``AgentDecisionProviderUnavailable``, retryable.
    """
    sdk = _sdk()
    if not isinstance(model, str) or not model:
        raise ConfigurationError("model must be a non-empty str, e.g. 'claude-sonnet-4-5'")
    if max_output_tokens is None:
        raise ConfigurationError("the Messages API requires max_output_tokens (max_tokens)")
    if decision_interface not in ("native", "structured"):
        raise ConfigurationError(
            f"decision_interface must be 'native' or 'structured', got {decision_interface!r}"
        )
    _check_options(options, decision_interface, history)
    if client is None:
        client = sdk.AsyncAnthropic()
    copy = getattr(client, "with_options", None)
    wire = AnthropicWire(
        client=copy(max_retries=0) if callable(copy) else client,  # never retry a response
        model=model,
        interface=decision_interface,
        max_output_tokens=max_output_tokens,
        options=options,
    )
    provider = DecisionProvider(
        wire,
        history=history,
        context=context,
        max_output_tokens=max_output_tokens,
        deadline_seconds=deadline_seconds,
    )
    async_clients = [sdk.AsyncAnthropic] + [
        cls
        for name in _PLATFORM_CLIENTS
        if name.startswith("Async") and isinstance(cls := getattr(sdk, name, None), type)
    ]
    if not isinstance(client, tuple(async_clients)):
        raise ConfigurationError(
            f"client must be an anthropic.AsyncAnthropic, got {type(client).__name__}"
        )
    return provider

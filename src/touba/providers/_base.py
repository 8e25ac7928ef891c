"""What every decision provider shares: history, the guard, validation.

A provider is a :class:`DecisionProvider` around a :class:`Wire`, the one
piece that knows a vendor's API: it renders a :class:`Plan` (the neutral
request) into that API's body, counts it, generates, and parses the response
back into a neutral :class:`DecisionMessage`.
"""

from __future__ import annotations

import asyncio
import json
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from touba import _telemetry as telemetry
from touba.errors import (
    AgentDecisionProviderUnavailable,
    ConfigurationError,
    ProviderContextCountUnavailable,
)
from touba.history._config import HistoryConfig, HistoryEvent
from touba.history._deadline import PROVIDER_DEADLINE_SECONDS, check_deadline
from touba.history._engine import DecisionHistory, HistoryWindow
from touba.history._identity import ConversationIdentity
from touba.history._integrity import check_decision_json, check_observations
from touba.history._model import (
    DataMessage,
    DecisionMessage,
    Message,
    ResultMessage,
    SummaryMessage,
    message_bytes,
)
from touba.history._window import ExchangeSize
from touba.providers._deadline import request_deadline
from touba.providers._guard import ContextConfig, find_cut, largest_fitting_count, reserve_tokens
from touba.providers._stream import (
    DecisionDelta,
    DeltaSink,
    StreamedCall,
    StreamedDecision,
    StreamedText,
)
from touba.providers._types import (
    Decision,
    DecisionInterface,
    DecisionRequest,
    Turn,
    Usage,
)
from touba.providers._validate import check_catalog, check_decision, schema_validator

__all__ = ["DecisionProvider", "Plan", "Wire"]


@dataclass(frozen=True, slots=True)
class Plan:
    """The neutral request for one generation, in sending order.

    Prior chat turns, then the invocation input, then the history window
    (summary first, then complete exchanges). The guard drops units oldest
    first: prior turns, then the window's summary and exchanges.
    """

    request: DecisionRequest
    interface: DecisionInterface
    prior_turns: tuple[Turn, ...]
    window: HistoryWindow

    @property
    def summary(self) -> SummaryMessage | None:
        return self.window.summary

    @property
    def exchanges(self) -> tuple[tuple[Message, ...], ...]:
        return self.window.exchanges

    @property
    def droppable(self) -> int:
        return len(self.prior_turns) + self.window.droppable

    def dropping(self, units: int) -> Plan:
        turns = min(units, len(self.prior_turns))
        return replace(
            self,
            prior_turns=self.prior_turns[turns:],
            window=self.window.dropping(units - turns),
        )

    def unit_bytes(self) -> list[int]:
        """Rough weights of the droppable units, oldest first (guard prediction)."""
        weights = [len(json.dumps(_turn_dict(t), ensure_ascii=False)) for t in self.prior_turns]
        if self.window.summary is not None:
            weights.append(message_bytes(self.window.summary))
        weights.extend(s.bytes for s in self.window.sizes[:-1])
        return weights


def _turn_dict(turn: Turn) -> dict[str, Any]:
    return {
        "user": turn.user,
        "replies": list(turn.replies),
        "trace": [[c.arguments, c.result, c.error] for g in turn.trace for c in g],
    }


class Wire(ABC):
    """One vendor API, at the edge. Subclasses convert SDK errors in one place.

    A wire with ``streams = True`` sends the generation as a stream when
    ``generate`` is given a sink, and awaits it for each :class:`StreamedText`
    and :class:`StreamedCall` while it assembles the very body the
    non-streaming request returns (then parsed by the same function). Other
    wires generate as usual; the provider then reports the decision's calls
    and text to the sink in one go.

    The provider runs ``count`` and ``generate`` under its deadline
    (:mod:`touba.providers._deadline`) and sets ``deadline_seconds`` on its wire: a
    wire reads a stream's events through ``Paced`` and sends the SDK a per-request
    timeout no longer than it, where the SDK has one.
    """

    provider: ClassVar[str]
    streams: ClassVar[bool] = False
    deadline_seconds: float = PROVIDER_DEADLINE_SECONDS

    def __init__(self, *, model: str, interface: DecisionInterface) -> None:
        self.model = model
        self.interface = interface

    def check_guard(self) -> None:  # noqa: B027 - optional hook
        """Raise ProviderContextGuardUnsupported if the guard cannot vouch for this client."""

    async def aclose(self) -> None:  # noqa: B027 - optional hook
        """Close a client this wire created itself (never one the host passed in)."""

    @abstractmethod
    def render(self, plan: Plan) -> dict[str, Any]:
        """The full generation body for ``plan``."""

    @abstractmethod
    async def count(self, body: dict[str, Any]) -> int:
        """Input tokens of ``body`` by the provider's own count endpoint."""

    @abstractmethod
    async def generate(
        self, body: dict[str, Any], sink: DeltaSink | None = None
    ) -> tuple[DecisionMessage, Usage]:
        """Send ``body``; parse the response into a decision (schema violations raise).

        With ``sink`` (wires with ``streams = True``): as a stream, reporting deltas.
        """


class DecisionProvider:
    """Turns a :class:`DecisionRequest` into a typed :class:`Decision`.

    With history (the default), each decision is one transaction of the
    conversation named by the request's identity; with ``history=False``
    nothing is kept and observations are sent as plain data.

    ``deadline_seconds`` (default 120) bounds each request to the provider, its SDK's
    retries included: one that gets no answer within it fails with the retryable
    ``AgentDecisionProviderUnavailable`` (a count of the context guard with
    ``ProviderContextCountUnavailable``). For a streamed reply it bounds the silence
    before the first event and between two events, so a stream may last longer in
    total. The host's client keeps its own timeout and retries; touba sends a
    per-request timeout no longer than the deadline where the SDK takes one.
    """

    def __init__(
        self,
        wire: Wire,
        *,
        history: HistoryConfig | bool | None,
        context: ContextConfig | None = None,
        max_output_tokens: int | None = None,
        deadline_seconds: float = PROVIDER_DEADLINE_SECONDS,
    ) -> None:
        if wire.interface not in ("native", "structured"):
            raise ConfigurationError(
                f"decision_interface must be 'native' or 'structured', got {wire.interface!r}"
            )
        self.deadline_seconds = check_deadline(
            deadline_seconds, owner=f"the {wire.provider} provider"
        )
        wire.deadline_seconds = self.deadline_seconds
        self._wire = wire
        if history is True or history is None:
            history = HistoryConfig()
        if history is not False and not isinstance(history, HistoryConfig):
            raise ConfigurationError(
                "history must be None (default bounds in RAM), a HistoryConfig, or False"
            )
        self._history = DecisionHistory(history) if history is not False else None
        if context is not None:
            if not isinstance(context, ContextConfig):
                raise ConfigurationError("context must be a touba.ContextConfig")
            if max_output_tokens is None:
                raise ConfigurationError(
                    "max_output_tokens is required with context=: the guard reserves it"
                )
            wire.check_guard()
            if largest_fitting_count(context, max_output_tokens) < 0:
                raise ConfigurationError(
                    "context_window_tokens leaves no room for input after "
                    "safety_margin_tokens and max_output_tokens"
                )
        if max_output_tokens is not None and (
            isinstance(max_output_tokens, bool)
            or not isinstance(max_output_tokens, int)
            or max_output_tokens < 1
        ):
            raise ConfigurationError(
                f"max_output_tokens must be a positive int, got {max_output_tokens!r}"
            )
        self._context = context
        self._max_output_tokens = max_output_tokens
        self._cuts = _Cuts()

    @property
    def provider(self) -> str:
        """The provider's name as conversations record it (``"openai"``, ``"anthropic"``...)."""
        return self._wire.provider

    @property
    def model(self) -> str:
        """The model every request names."""
        return self._wire.model

    @property
    def decision_interface(self) -> DecisionInterface:
        """How decisions are asked for: ``"native"`` tool calls or ``"structured"`` JSON."""
        return self._wire.interface

    @property
    def history(self) -> DecisionHistory | None:
        """The decision history that keeps this provider's conversations, or None."""
        return self._history

    async def aclose(self) -> None:
        """Close what the provider created (its SDK client); a host's client stays open."""
        await self._wire.aclose()

    async def __aenter__(self) -> DecisionProvider:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    @property
    def _telemetry_name(self) -> str:
        return telemetry.PROVIDER_NAMES.get(self.provider, self.provider)

    async def decide(self, request: DecisionRequest, *, sink: DeltaSink | None = None) -> Decision:
        """One decision: one history transaction, the guard's counts, one generation.

        With ``sink``, the generation is sent as a stream and ``sink`` is
        awaited for each delta (see :mod:`touba.providers._stream`): pieces of
        the visible reply, calls as they start, then the decision once saved.
        The decision and what is stored are those of the non-streaming request.
        Traced as a ``chat {model}`` span (see :mod:`touba._telemetry`); a streamed
        one also records ``gen_ai.server.time_to_first_token`` (seconds to the first
        delta), a cancelled one ``touba.cancelled``.
        """
        with telemetry.span(
            f"chat {self.model}",
            kind="client",
            decision=True,
            attributes={
                "gen_ai.operation.name": "chat",
                "gen_ai.provider.name": self._telemetry_name,
                "gen_ai.request.model": self.model,
                "touba.decision_interface": self.decision_interface,
            },
        ) as span:
            first: list[float] = []  # seconds to the first delta, when streamed
            try:
                decision = await self._decide(request, _timed(sink, first))
            except _SinkFailure as failure:  # the consumer's own error, as it raised it
                raise failure.error from None
            except asyncio.CancelledError:
                telemetry.set_attributes(span, {"touba.cancelled": True})
                raise
            finally:
                if first:
                    telemetry.set_attributes(span, {"gen_ai.server.time_to_first_token": first[0]})
            telemetry.set_attributes(
                span,
                {
                    "gen_ai.usage.input_tokens": decision.usage.input_tokens,
                    "gen_ai.usage.output_tokens": decision.usage.output_tokens,
                    "touba.calls": len(decision.calls),
                    "touba.final": not decision.calls,
                },
            )
        if sink is not None:
            await sink(StreamedDecision(decision))
        return decision

    async def _decide(self, request: DecisionRequest, sink: DeltaSink | None = None) -> Decision:
        check_catalog(request.capabilities)
        if request.output_schema is not None:
            schema_validator(request.output_schema, "output_schema")
        usage: list[Usage] = []
        prior = tuple(request.prior_turns)
        fitted: list[Plan] = []  # the guard's plan, when it ran
        deltas = None
        if sink is not None:
            deltas = _guarded(_visible(sink, self.decision_interface, request))

        async def generate(window: HistoryWindow) -> DecisionMessage:
            plan = fitted[-1] if fitted else Plan(request, self.decision_interface, prior, window)
            body = self._wire.render(plan)
            streamed = deltas is not None and self._wire.streams
            async with request_deadline(self.deadline_seconds, self._no_answer(streamed)):
                if deltas is None:
                    message, used = await self._wire.generate(body)
                elif streamed:
                    message, used = await self._wire.generate(body, deltas)
                else:
                    message, used = await self._wire.generate(body)
            if deltas is not None and not streamed:
                await _replay(message, deltas)
            check_decision(message, request.capabilities, request.output_schema)
            usage.append(used)
            return message

        async def fit(window: HistoryWindow) -> HistoryWindow:
            plan = await self._fit(Plan(request, self.decision_interface, prior, window))
            fitted.append(plan)
            return plan.window

        guard = fit if self._context is not None else None
        if self._history is None:
            check_observations(request.observations, request.data)  # as history.step does
            window = _stateless_window(request)
            if guard is not None:
                window = await guard(window)
            message = await generate(window)
            check_decision_json(message)
        else:
            identity = self._identity(request)
            message = await self._history.step(
                identity, request.observations, generate, fit=guard, data=request.data
            )
        return Decision(
            calls=message.calls,
            output=message.output if message.final else None,
            text=message.text,
            usage=usage[0] if usage else Usage(),
        )

    async def discard_history(self, *, run_id: str, invocation_id: str, agent_ref: str) -> bool:
        """Delete the decision history of one invocation from this provider's store.

        Returns False when it held none (or keeps none: ``history=False``).
        Raises ``DecisionHistoryBusy`` while a decision of it runs. The
        runtime calls it for finished invocations when asked to
        (``Runtime(retain_finished_history=False)``, ``ChatSession``).
        """
        if self._history is None:
            return False
        return await self._history.discard(self._named(run_id, invocation_id, agent_ref))

    async def recover_history(
        self, *, run_id: str, invocation_id: str, agent_ref: str
    ) -> tuple[tuple[str, str], ...]:
        """Free the invocation's history reservation left by a stopped worker and
        return the ``(call_id, name)`` pairs its conversation awaits results for.

        Only for a caller who has checked that the worker is gone (the
        runtime, on ``resume(..., worker_stopped=True)``).
        """
        if self._history is None:
            return ()
        return await self._history.recover(self._named(run_id, invocation_id, agent_ref))

    async def saved_final_decision(
        self, *, run_id: str, invocation_id: str, agent_ref: str, answered: tuple[str, ...]
    ) -> Decision | None:
        """The final decision the invocation's history saved right after the results
        of exactly the calls ``answered`` (or, with none, as its first and only
        exchange), when that is its last exchange; None otherwise (or without
        history).

        Only for a caller who has checked that the worker is gone (the runtime, on
        ``resume(..., worker_stopped=True)``): that worker had the decision saved and
        stopped before it reported it; the resume completes the invocation from it
        rather than asking the model again. Its usage is not known (zero).
        """
        if self._history is None:
            return None
        identity = self._named(run_id, invocation_id, agent_ref)
        message = await self._history.saved_final(identity, answered)
        if message is None:
            return None
        return Decision(calls=(), output=message.output, text=message.text, usage=Usage())

    def _named(self, run_id: str, invocation_id: str, agent_ref: str) -> ConversationIdentity:
        assert self._history is not None
        return ConversationIdentity(
            namespace=self._history.namespace,
            provider=self.provider,
            model=self.model,
            decision_interface=self.decision_interface,
            run_id=run_id,
            invocation_id=invocation_id,
            agent_ref=agent_ref,
        )

    def _identity(self, request: DecisionRequest) -> ConversationIdentity:
        missing = [
            name for name in ("run_id", "invocation_id", "agent_ref") if not getattr(request, name)
        ]
        if missing:
            raise ConfigurationError(
                f"history is enabled, so the request needs {', '.join(missing)}: pass run_id, "
                "invocation_id and agent_ref (the touba runtime passes them), or create the "
                "provider with history=False"
            )
        return self._named(str(request.run_id), str(request.invocation_id), str(request.agent_ref))

    async def _fit(self, plan: Plan) -> Plan:
        """Drop the oldest units until the counted request fits (SPEC section 4)."""
        assert self._context is not None
        assert self._max_output_tokens is not None
        context, max_output = self._context, self._max_output_tokens
        limit = largest_fitting_count(context, max_output)
        rendered: dict[int, dict[str, Any]] = {}

        def body(drop: int) -> dict[str, Any]:
            if drop not in rendered:
                rendered[drop] = self._wire.render(plan.dropping(drop))
            return rendered[drop]

        async def measure(drop: int) -> int:
            with telemetry.span(
                f"count_tokens {self.model}",
                kind="client",
                attributes={
                    "gen_ai.operation.name": "count_tokens",
                    "gen_ai.provider.name": self._telemetry_name,
                    "gen_ai.request.model": self.model,
                },
            ):
                async with request_deadline(self.deadline_seconds, self._no_count):
                    count = await self._wire.count(body(drop))
            reserve = reserve_tokens(count, context, max_output)
            counted = plan.dropping(drop)
            size = counted.window.size
            await self._emit(
                HistoryEvent(
                    kind="provider_context_count",
                    session_key=plan.window.session_key,
                    message_count=size.messages,
                    bytes=size.bytes,
                    provider=self.provider,
                    count=count,
                    reserve=reserve,
                    window=context.context_window_tokens,
                    fits=reserve <= context.context_window_tokens,
                    prior_turns=len(counted.prior_turns),
                )
            )
            return count

        request_bytes = len(json.dumps(body(0), ensure_ascii=False).encode("utf-8"))
        key = plan.window.session_key
        drop = await find_cut(
            plan.unit_bytes(), request_bytes, measure, limit, hint=self._cuts.hint(key, plan)
        )
        fitted = plan.dropping(drop)
        self._cuts.remember(
            key, fitted, dropped_turns=len(plan.prior_turns) - len(fitted.prior_turns)
        )
        return fitted

    def _no_answer(self, streamed: bool) -> Callable[[], AgentDecisionProviderUnavailable]:
        """The error of a generation that hit the deadline."""
        where = " before its next event" if streamed else ""
        message = (
            f"the {self.provider} provider gave no answer{where} within "
            f"{self.deadline_seconds:g} s (deadline_seconds); no decision was received and "
            "nothing was stored: retry later, or raise deadline_seconds"
        )
        return lambda: AgentDecisionProviderUnavailable(message)

    def _no_count(self) -> ProviderContextCountUnavailable:
        """The error of a count of the context guard that hit the deadline."""
        return ProviderContextCountUnavailable(
            f"the {self.provider} token count gave no answer within {self.deadline_seconds:g} s "
            "(deadline_seconds); nothing was generated: retry later, or create the provider "
            "without context= to skip the guard"
        )

    async def _emit(self, event: HistoryEvent) -> None:
        if self._history is not None:
            await self._history.emit(event)


def _timed(sink: DeltaSink | None, first: list[float]) -> DeltaSink | None:
    """``sink``, noting in ``first`` the seconds until its first delta."""
    if sink is None:
        return None
    started = time.monotonic()

    async def timed(delta: DecisionDelta) -> None:
        if not first:
            first.append(time.monotonic() - started)
        await sink(delta)

    return timed


class _SinkFailure(BaseException):
    """Carries an exception of the sink through the wire (whose handlers convert SDK
    errors, never the consumer's) and the history step (which saves nothing)."""

    def __init__(self, error: Exception) -> None:
        super().__init__()
        self.error = error


def _guarded(sink: DeltaSink) -> DeltaSink:
    async def guarded(delta: DecisionDelta) -> None:
        try:
            await sink(delta)
        except Exception as e:
            raise _SinkFailure(e) from e

    return guarded


def _visible(sink: DeltaSink, interface: str, request: DecisionRequest) -> DeltaSink:
    """``sink``, or one without text when the text is JSON (a structured decision, a
    structured final output): that is delivered whole, in the decision."""
    if interface == "native" and request.output_schema is None:
        return sink

    async def calls_only(delta: DecisionDelta) -> None:
        if not isinstance(delta, StreamedText):
            await sink(delta)

    return calls_only


async def _replay(message: DecisionMessage, sink: DeltaSink) -> None:
    """A wire that does not stream: its decision's calls, then its text, in one go (a
    plain-text final output is its text: a streaming wire streams it too)."""
    for index, call in enumerate(message.calls):
        await sink(StreamedCall(index, call.name, call.call_id))
    text = message.text
    if not text and message.final and isinstance(message.output, str):
        text = message.output
    if text:
        await sink(StreamedText(text))


class _Cuts:
    """Where the guard last cut each conversation: a hint for its next decision.

    In a tool loop the cut moves by about one exchange per decision, so the
    guard probes the last cut and its neighbour first (verified like any
    guess). Bounded: the least recently used conversations are forgotten.
    """

    SIZE = 1024

    def __init__(self) -> None:
        self._last: OrderedDict[str, tuple[int, int]] = OrderedDict()

    def hint(self, key: str, plan: Plan) -> int | None:
        last = self._last.get(key) if key else None
        if last is None:
            return None
        dropped_turns, first_exchange = last
        turns = len(plan.prior_turns)
        if dropped_turns < turns:
            return dropped_turns
        exchanges = first_exchange - plan.window.start
        if exchanges <= 0:
            return turns or None
        return turns + (plan.window.summary is not None) + exchanges

    def remember(self, key: str, fitted: Plan, *, dropped_turns: int) -> None:
        if not key:
            return
        self._last[key] = (dropped_turns, fitted.window.start)
        self._last.move_to_end(key)
        while len(self._last) > self.SIZE:
            self._last.popitem(last=False)


def _stateless_window(request: DecisionRequest) -> HistoryWindow:
    """``history=False``: the current observations (and data) as plain data, nothing else."""
    given = (*request.observations, *request.data)
    if not given:
        return HistoryWindow(session_key="", summary=None, exchanges=(), sizes=())
    data = DataMessage(tuple(ResultMessage.from_observation(o) for o in given))
    size = ExchangeSize(1, message_bytes(data))
    return HistoryWindow(
        session_key="", summary=None, exchanges=((data,),), sizes=(size,), retained=size
    )

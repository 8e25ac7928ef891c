"""An ADK plugin that trims each model request to touba's window.

```python
from google.adk.apps import App
from google.adk.runners import Runner
from touba.integrations.adk import ToubaContextPlugin

app = App(name="support", root_agent=agent,
          plugins=[ToubaContextPlugin(max_messages=40, max_bytes=64_000)])
runner = Runner(app=app, session_service=sessions)
```

Behaviour decisions:

- **Where.** ``before_model_callback``, after ADK has built ``llm_request.contents``
  from the session (its rearrangements, orphan pruning and stripped ``adk-`` ids
  included) and before the model is called. The plugin replaces
  ``llm_request.contents`` with a new list holding a sub-list of the same
  ``Content`` objects: nothing is copied, edited or reordered, and the session's
  events are never touched (trimming deletes nothing; the session service keeps
  every event, the next request is built from all of them again).
- **Exchanges.** A model ``Content`` with ``function_call`` parts and the user
  ``Content``\\ s carrying their ``function_response`` parts are one exchange:
  several calls of one model turn travel together. Responses are matched to calls
  by id; when ADK has stripped its own ``adk-`` ids (it does for Gemini models), by
  name. A call never answered, or a response whose call is not in the exchange,
  makes the exchange incomplete: it is never sent. A user ``Content`` without
  function responses opens a turn (consecutive ones are one input, as ADK counts
  an invocation's start); any other model ``Content`` is an exchange of its own.
- **Confirmations** (``adk_request_confirmation``, ADK's tool confirmation). ADK
  itself leaves the confirmation request and its answer out of the request, and
  the model sees the tool's call with its placeholder response ("requires
  confirmation"), a complete exchange, and after the answer the call with the
  tool's real result, which ADK moves next to it. Where a request does carry
  them (a custom request processor, another plugin), an ``adk_request_confirmation``
  call joins the exchange of the call it confirms (``originalFunctionCall``, by id,
  else by name), its answer joins it too, and a confirmation still pending does not
  make that exchange incomplete: call and confirmation are kept or left together,
  never split. Only within a turn: a confirmation whose call is behind a user input
  (or not in the request) is an ordinary call, sent only with its answer, and an
  answer behind a user input is a response without its call, never sent. A
  pending confirmation that leaves the window stays in the session, so answering
  it later works (adk-python #4740 was compaction deleting it).
- **The window** is touba's (:mod:`touba.integrations._turns`): the newest user
  input always, not counted in the bounds; then the current turn's exchanges,
  newest first, the last one always (``DecisionHistoryLimitExceeded`` naming the
  bound when it alone exceeds ``max_messages`` or ``max_bytes``, never an empty
  request); then whole earlier turns, newest first, so the window opens on a user
  input. Defaults are touba's history window (128 messages, 256 KiB); ``None``
  lifts a bound.
- **Instructions travel apart.** Contents ADK adds for instructions are kept where
  they stand and not counted: the static-instruction prefix (non-text
  ``static_instruction`` parts, at the front) and the labelled dynamic instruction
  that ADK inserts at the current turn when an agent has both
  ``static_instruction`` and ``instruction``.
- **Tokens** (optional): with ``count_tokens`` (any ``async (contents) -> int``,
  e.g. google-genai's ``client.aio.models.count_tokens``) and ``max_tokens``, the
  window is then counted as it would be sent (instruction contents included) and,
  while the count exceeds ``max_tokens``, whole earlier turns and then the current
  turn's older exchanges are dropped, oldest first: one count when it fits, two
  when the session's previous cut (remembered in the plugin, for the 4,096 most
  recent sessions) still holds, at most ``2 + ceil(log2(n + 1))`` for ``n``
  droppable groups (a bisection, counts assumed not to grow as more is dropped).
  When the input and the last exchange alone exceed it:
  ``ProviderContextWindowExceeded``; a counter that fails or answers something
  other than an int ``>= 0``: ``ProviderContextCountUnavailable`` (the counter's
  exception chained). ``max_tokens`` budgets the contents only: leave room for the
  system instruction, the tools and the answer.
- **Errors reach you wrapped.** ADK's plugin manager re-raises a plugin's
  exception as ``RuntimeError(...) from e``: the touba error is its ``__cause__``;
  nothing was sent to the model.
- **Events, counts only.** Each model call emits ``history_window`` (the messages
  and bytes sent, input and instructions excluded) and, when something was left
  out, ``history_trimmed`` (``removed_exchanges``: units left out, inputs, replies
  and exchanges alike, incomplete ones included; ``removed_messages``,
  ``removed_bytes``), and ``provider_context_count`` per token count, as
  :class:`~touba.HistoryEvent`\\ s to ``on_event`` (sync or async; an exception in
  it is logged, never raised) and as span events of the same names prefixed
  ``touba.`` on the current OpenTelemetry span (ADK's ``call_llm``), never with
  content. Their ``session_key`` is ``"adk1:"`` and the SHA-256 of the session's
  app name, user id and session id (:meth:`ToubaContextPlugin.session_key`), so
  no identifier appears in them.
- **Measure.** A ``Content`` weighs the UTF-8 bytes of its compact JSON as
  google-genai serialises it (``model_dump_json(exclude_none=True, by_alias=True)``).
- **Where ADK differs.** ADK's ``ContextFilterPlugin`` keeps the last N
  invocations, moves its cut to avoid an orphaned response, and on any error logs
  it and sends the request whole; this plugin bounds messages, bytes and tokens,
  cuts only between whole turns or exchanges, and refuses typed rather than send
  more than its bounds. Cutting moves the request's prefix when a turn leaves the
  window, which a provider's context cache sees as a new prefix.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from touba import _telemetry as telemetry
from touba.errors import (
    ConfigurationError,
    DecisionHistoryRecordInvalid,
    ProviderContextCountUnavailable,
    ProviderContextWindowExceeded,
)
from touba.history import ExchangeSize, HistoryEvent
from touba.integrations._cut import UNBOUNDED, Unit, check_bound
from touba.integrations._turns import TurnUnit, turn_window

try:
    from google.adk.agents.callback_context import CallbackContext
    from google.adk.models.llm_request import LlmRequest
    from google.adk.models.llm_response import LlmResponse
    from google.adk.plugins import BasePlugin
    from google.genai import types
except ImportError as e:  # pragma: no cover - exercised without the extra installed
    raise ImportError('touba.integrations.adk needs google-adk: pip install "touba[adk]"') from e

_DYNAMIC_INSTRUCTION: str | None
try:  # ADK's label of the dynamic instruction it puts in contents (a private name).
    from google.adk.flows.llm_flows.prompt._instructions import _INSTRUCTION_PREAMBLE
except ImportError:  # pragma: no cover - another ADK version: no such content to spot
    _DYNAMIC_INSTRUCTION = None
else:
    _DYNAMIC_INSTRUCTION = _INSTRUCTION_PREAMBLE

__all__ = ["TokenCounter", "ToubaContextPlugin", "trim_contents"]

logger = logging.getLogger("touba.integrations.adk")

CONFIRMATION: Final = "adk_request_confirmation"
DEFAULT_MAX_MESSAGES: Final = 128
DEFAULT_MAX_BYTES: Final = 262144
_REMEMBERED_CUTS: Final = 4096  # sessions whose last cut the token guard remembers

TokenCounter = Callable[[list[types.Content]], Awaitable[int]]
"""Counts the tokens of the contents given (the window as it would be sent)."""

_Key = tuple[str, str]


def _call_key(call: types.FunctionCall) -> _Key:
    return ("id", call.id) if call.id else ("name", call.name or "")


def _response_key(response: types.FunctionResponse) -> _Key:
    return ("id", response.id) if response.id else ("name", response.name or "")


def _confirmed_key(call: types.FunctionCall) -> _Key | None:
    """The key of the call an ``adk_request_confirmation`` call confirms, if it says."""
    original = (call.args or {}).get("originalFunctionCall")
    if not isinstance(original, Mapping):
        return None
    ident, name = original.get("id"), original.get("name")
    if isinstance(ident, str) and ident:
        return ("id", ident)
    return ("name", name) if isinstance(name, str) else None


@dataclass(slots=True)
class _Block:
    """Contents from ``start`` on that travel together, while they are being read."""

    start: int
    is_input: bool
    open: Counter[_Key] = field(default_factory=Counter)
    confirmations: Counter[_Key] = field(default_factory=Counter)
    calls: set[_Key] = field(default_factory=set)
    names: set[str] = field(default_factory=set)
    orphan: bool = False

    def absorb(self, later: _Block) -> None:
        self.open.update(later.open)
        self.confirmations.update(later.confirmations)
        self.calls |= later.calls
        self.names |= later.names
        self.orphan = self.orphan or later.orphan


class _Reader:
    """Splits a conversation (a list of contents) into blocks, in one pass."""

    def __init__(self) -> None:
        self.blocks: list[_Block] = []
        self.last_was_input = False

    def _new(self, at: int, *, is_input: bool) -> _Block:
        block = _Block(at, is_input)
        self.blocks.append(block)
        return block

    def _merge_from(self, index: int) -> _Block:
        """Fold every block after ``index`` into it (they are consecutive): one block."""
        target = self.blocks[index]
        for later in self.blocks[index + 1 :]:
            target.absorb(later)
        del self.blocks[index + 1 :]
        return target

    def _find(self, key: _Key, name: str | None, where: Callable[[_Block], set[_Key]]) -> int:
        """The newest block of the current turn holding ``key`` (or ``name``), else -1.

        Only blocks after the newest input are searched: merging across an input
        would fold the user's words into an exchange.
        """
        floor = max((i for i, b in enumerate(self.blocks) if b.is_input), default=-1)
        for index in range(len(self.blocks) - 1, floor, -1):
            held = where(self.blocks[index])
            if key in held or (name is not None and ("name", name) in held):
                return index
        for index in range(len(self.blocks) - 1, floor, -1):
            if name is not None and name in self.blocks[index].names:
                return index
        return -1

    def read(self, at: int, content: types.Content) -> None:
        parts = content.parts or []
        calls = [p.function_call for p in parts if p.function_call is not None]
        responses = [p.function_response for p in parts if p.function_response is not None]
        current = self.blocks[-1] if self.blocks else None
        if content.role == "model":
            self.last_was_input = False
            self._model(at, calls, current)
        elif responses:
            self.last_was_input = False
            self._responses(at, responses, current)
        else:  # a user input (consecutive ones are one input)
            if not (self.last_was_input and current is not None and current.is_input):
                self._new(at, is_input=True)
            self.last_was_input = True

    def _model(self, at: int, calls: list[types.FunctionCall], current: _Block | None) -> None:
        block: _Block | None = None
        attached: list[types.FunctionCall] = []  # confirmations that found their call
        for call in calls:
            if call.name != CONFIRMATION:
                continue
            confirmed = _confirmed_key(call)
            original = (call.args or {}).get("originalFunctionCall")
            name = original.get("name") if isinstance(original, Mapping) else None
            index = (
                -1
                if confirmed is None
                else self._find(confirmed, name if isinstance(name, str) else None, _calls)
            )
            if index >= 0:
                block = self._merge_from(index)
                attached.append(call)
        if block is None:
            if current is not None and +current.open:
                block = current  # the model goes on while its calls are still open
            else:
                block = self._new(at, is_input=False)
        for call in calls:
            if any(call is a for a in attached):
                # Awaiting the user, not the model: pending, it leaves the exchange whole.
                block.confirmations[_call_key(call)] += 1
            else:  # a confirmation without its call is an ordinary call: answered or not sent
                block.open[_call_key(call)] += 1
                block.calls.add(_call_key(call))
                if call.name:
                    block.names.add(call.name)

    def _responses(
        self, at: int, responses: list[types.FunctionResponse], current: _Block | None
    ) -> None:
        block = current
        matched = unmatched = 0
        for response in responses:
            key = _response_key(response)
            index = -1
            if response.name == CONFIRMATION:
                index = self._find(key, None, _confirmations)
            if index >= 0:
                block = self._merge_from(index)
                block.confirmations[key] -= 1
                matched += 1
            elif block is not None and block.open[key] > 0:
                block.open[key] -= 1
                matched += 1
            else:
                unmatched += 1
        if unmatched:
            if block is None or not matched:
                block = self._new(at, is_input=False)
            block.orphan = True  # a response without its call: never sent


def _calls(block: _Block) -> set[_Key]:
    return block.calls


def _confirmations(block: _Block) -> set[_Key]:
    return {k for k, n in block.confirmations.items() if n > 0}


def _content_bytes(content: types.Content) -> int:
    return len(content.model_dump_json(exclude_none=True, by_alias=True).encode("utf-8"))


def _is_dynamic_instruction(content: types.Content) -> bool:
    if _DYNAMIC_INSTRUCTION is None or content.role != "user":
        return False
    parts = content.parts or []
    return len(parts) == 1 and (parts[0].text or "").startswith(_DYNAMIC_INSTRUCTION)


@dataclass(frozen=True, slots=True)
class _Window:
    """A window over ``contents``: the conversation's positions in it, and what to send."""

    contents: Sequence[types.Content]
    fixed: tuple[int, ...]  # instruction contents: always sent, never counted
    conversation: tuple[int, ...]  # positions (in contents) of the conversation's contents
    units: tuple[TurnUnit, ...]
    chosen: tuple[Unit, ...]
    pin: int | None  # start of the newest input unit, in conversation positions

    def groups(self) -> list[list[Unit]]:
        """The chosen units the token guard may drop, oldest first, grouped as they go.

        Earlier turns go whole; then the current turn's exchanges one by one. The
        newest input and the current turn's last exchange are in no group.
        """
        body = list(self.chosen)
        if body and body[-1].start != self.pin:
            body.pop()  # the last exchange is required
        inputs = {u.unit.start for u in self.units if u.is_input}
        groups: list[list[Unit]] = []
        current = self.pin is None
        for unit in body:
            if unit.start == self.pin:
                current = True
            elif current or not groups or unit.start in inputs:
                groups.append([unit])
            else:
                groups[-1].append(unit)
        return groups

    def dropping(self, drop: int) -> tuple[Unit, ...]:
        """The chosen units without the ``drop`` oldest groups."""
        gone = {id(u) for group in self.groups()[:drop] for u in group}
        return tuple(u for u in self.chosen if id(u) not in gone)

    def contents_of(self, units: Sequence[Unit]) -> list[types.Content]:
        """``units`` as contents, the instruction contents where they stood."""
        keep = set(self.fixed)
        for unit in units:
            keep.update(self.conversation[i] for i in range(unit.start, unit.stop))
        return [self.contents[i] for i in sorted(keep)]

    def size_of(self, units: Sequence[Unit]) -> ExchangeSize:
        """What ``units`` weigh, the newest input excluded (the ``history_window`` figures)."""
        total = ExchangeSize(0, 0)
        for unit in units:
            if unit.start != self.pin:
                total = total + unit.size
        return total


def _window(
    contents: Sequence[types.Content], lead: int, max_messages: int, max_bytes: int
) -> _Window:
    fixed = list(range(min(lead, len(contents))))
    conversation: list[int] = []
    for index in range(len(fixed), len(contents)):
        if _is_dynamic_instruction(contents[index]):
            fixed.append(index)
        else:
            conversation.append(index)
    sizes = tuple(_content_bytes(contents[i]) for i in conversation)
    reader = _Reader()
    for position, index in enumerate(conversation):
        reader.read(position, contents[index])
    blocks = reader.blocks
    units: list[TurnUnit] = []
    for n, block in enumerate(blocks):
        stop = blocks[n + 1].start if n + 1 < len(blocks) else len(conversation)
        size = ExchangeSize(stop - block.start, sum(sizes[block.start : stop]))
        complete = not (+block.open) and not block.orphan
        units.append(TurnUnit(Unit(block.start, stop, complete, size), block.is_input))
    inputs = [u.unit.start for u in units if u.is_input]
    chosen = turn_window(units, max_messages=max_messages, max_bytes=max_bytes)
    return _Window(
        contents=contents,
        fixed=tuple(fixed),
        conversation=tuple(conversation),
        units=tuple(units),
        chosen=tuple(chosen),
        pin=inputs[-1] if inputs else None,
    )


def trim_contents(
    contents: Sequence[types.Content],
    *,
    max_messages: int | None = DEFAULT_MAX_MESSAGES,
    max_bytes: int | None = DEFAULT_MAX_BYTES,
    lead: int = 0,
) -> list[types.Content]:
    """The contents to send: the ``lead`` first contents, then touba's window, oldest first.

    The pure form of :class:`ToubaContextPlugin` without the token guard (see the
    module docstring): the same ``Content`` objects, none copied. Raises
    ``DecisionHistoryLimitExceeded`` (``limit`` names the bound) when the last
    exchange alone exceeds a bound, ``DecisionHistoryRecordInvalid`` when the
    contents hold no user input and no complete exchange, ``ConfigurationError``
    on a bad bound.
    """
    window = _window(
        contents,
        lead,
        check_bound("max_messages", max_messages),
        check_bound("max_bytes", max_bytes),
    )
    _check_not_empty(window)
    return window.contents_of(window.chosen)


def _check_not_empty(window: _Window) -> None:
    if window.conversation and not window.chosen:
        raise DecisionHistoryRecordInvalid(
            "the request's contents hold no user input and no complete exchange (only calls "
            "without their responses or responses without their calls), so there is nothing "
            "whole to send; check the session's events and the request processors"
        )


class ToubaContextPlugin(BasePlugin):
    """An ADK plugin: each model request's contents are cut to touba's window.

    Give it to the ADK ``App`` (``App(..., plugins=[ToubaContextPlugin(...)])``). Before each
    model call, ``llm_request.contents`` becomes the window: the newest user input,
    the current turn's exchanges and whole earlier turns within ``max_messages``
    and ``max_bytes`` (and ``max_tokens`` by ``count_tokens``, when given), never a
    function call without its response. The session keeps every event. Bounds are
    checked here (``ConfigurationError``); a request that cannot fit raises (see
    :meth:`before_model_callback`).
    """

    def __init__(
        self,
        *,
        max_messages: int | None = DEFAULT_MAX_MESSAGES,
        max_bytes: int | None = DEFAULT_MAX_BYTES,
        max_tokens: int | None = None,
        count_tokens: TokenCounter | None = None,
        on_event: Callable[[HistoryEvent], Any] | None = None,
        name: str = "touba_context",
    ) -> None:
        super().__init__(name)
        self.max_messages = check_bound("max_messages", max_messages)
        self.max_bytes = check_bound("max_bytes", max_bytes)
        tokens = check_bound("max_tokens", max_tokens)
        if (tokens == UNBOUNDED) != (count_tokens is None):
            raise ConfigurationError(
                "max_tokens and count_tokens go together: give both (an async counter of "
                "the contents and the budget it checks) or neither"
            )
        if count_tokens is not None and not callable(count_tokens):
            raise ConfigurationError("count_tokens must be an async callable (contents) -> int")
        if on_event is not None and not callable(on_event):
            raise ConfigurationError("on_event must be a callable taking a HistoryEvent")
        self.max_tokens = tokens
        self._count_tokens = count_tokens
        self._cuts: OrderedDict[str, int] = OrderedDict()  # session key -> where it was cut
        self._on_event = on_event

    @staticmethod
    def session_key(app_name: str, user_id: str, session_id: str) -> str:
        """The ``session_key`` of this plugin's events for one ADK session (no id in it)."""
        canonical = json.dumps([app_name, user_id, session_id], ensure_ascii=False)
        return "adk1:" + hashlib.sha256(canonical.encode("utf-8")).hexdigest()

    async def before_model_callback(
        self, *, callback_context: CallbackContext, llm_request: LlmRequest
    ) -> LlmResponse | None:
        """Replace ``llm_request.contents`` by the window; return None (the model is called).

        Raises ``DecisionHistoryLimitExceeded`` when the last exchange alone
        exceeds ``max_messages`` or ``max_bytes``, ``ProviderContextWindowExceeded``
        when the input and the last exchange alone count more than ``max_tokens``,
        ``ProviderContextCountUnavailable`` when the counter fails, and
        ``DecisionHistoryRecordInvalid`` when nothing whole is left to send; ADK
        re-raises each as a ``RuntimeError`` whose ``__cause__`` it is.
        """
        session = callback_context.session
        key = self.session_key(session.app_name, session.user_id, session.id)
        contents = list(llm_request.contents)
        lead = getattr(llm_request, "_static_instruction_prefix_end_index", None) or 0
        window = _window(contents, lead, self.max_messages, self.max_bytes)
        _check_not_empty(window)
        chosen = window.chosen
        if self._count_tokens is not None:
            chosen = await self._fit_tokens(window, key)
        await self._announce(window, chosen, key)
        llm_request.contents = window.contents_of(chosen)
        return None

    async def _fit_tokens(self, window: _Window, key: str) -> tuple[Unit, ...]:
        """The fewest groups dropped, oldest first, for the count to fit ``max_tokens``.

        A bisection over the drop, started from where this session's previous
        request was cut (a guess, verified like any other: in a tool loop the cut
        stays put or moves by a turn, so two counts settle it), else from no drop.
        """
        groups = window.groups()
        answers: dict[int, bool] = {}

        async def fits(drop: int) -> bool:
            if drop not in answers:
                answers[drop] = await self._probe(window, drop, key)
            return answers[drop]

        low, high = -1, len(groups) + 1  # the smallest fitting drop is in (low, high]
        cut = self._cuts.get(key)
        hint = 0 if cut is None else sum(1 for g in groups if g[0].start < cut)
        if 0 < hint <= len(groups):
            for drop in (hint, hint - 1) if await fits(hint) else (hint, hint + 1):
                if drop <= len(groups) and await fits(drop):
                    high = min(high, drop)
                else:
                    low = max(low, drop)
        elif await fits(0):
            self._remember(key, None)
            return window.chosen
        else:
            low = 0
        while high - low > 1:
            middle = (low + high) // 2
            if await fits(middle):
                high = middle
            else:
                low = middle
        if high > len(groups):
            raise ProviderContextWindowExceeded(
                f"the newest input and the last exchange alone count more than max_tokens="
                f"{self.max_tokens} tokens; raise max_tokens (within the model's window) or "
                "shorten the input and the tool results"
            )
        self._remember(key, groups[high][0].start if high < len(groups) else UNBOUNDED)
        return window.dropping(high)

    def _remember(self, key: str, cut: int | None) -> None:
        """Note where ``key``'s request was cut (a conversation position; None: not cut)."""
        self._cuts.pop(key, None)
        if cut is not None:
            self._cuts[key] = cut
            while len(self._cuts) > _REMEMBERED_CUTS:
                self._cuts.popitem(last=False)

    async def _probe(self, window: _Window, drop: int, key: str) -> bool:
        """Count the window without its ``drop`` oldest groups; emit the count's event."""
        units = window.dropping(drop)
        count = await self._count(window.contents_of(units))
        size = window.size_of(units)
        ok = count <= self.max_tokens
        await self._emit(
            HistoryEvent(
                kind="provider_context_count",
                session_key=key,
                message_count=size.messages,
                bytes=size.bytes,
                count=count,
                window=self.max_tokens,
                fits=ok,
            )
        )
        return ok

    async def _count(self, contents: list[types.Content]) -> int:
        assert self._count_tokens is not None
        try:
            count = await self._count_tokens(contents)
        except Exception as e:
            raise ProviderContextCountUnavailable(
                f"the token counter failed ({type(e).__name__}); nothing was sent to the "
                "model. Retry, or check the counter's client"
            ) from e
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ProviderContextCountUnavailable(
                f"the token counter returned {type(count).__name__}, not an int >= 0; "
                "nothing was sent to the model"
            )
        return count

    async def _announce(self, window: _Window, chosen: Sequence[Unit], key: str) -> None:
        sent = window.size_of(chosen)
        kept = {u.start for u in chosen}
        removed = [u.unit for u in window.units if u.unit.start not in kept]
        if removed:
            await self._emit(
                HistoryEvent(
                    kind="history_trimmed",
                    session_key=key,
                    message_count=sent.messages,
                    bytes=sent.bytes,
                    removed_exchanges=len(removed),
                    removed_messages=sum(u.size.messages for u in removed),
                    removed_bytes=sum(u.size.bytes for u in removed),
                )
            )
        await self._emit(
            HistoryEvent(
                kind="history_window",
                session_key=key,
                message_count=sent.messages,
                bytes=sent.bytes,
            )
        )

    async def _emit(self, event: HistoryEvent) -> None:
        data = event.to_dict()
        telemetry.current_event(
            f"touba.{event.kind}",
            {f"touba.{k}": v for k, v in data.items() if k != "kind"},
        )
        if self._on_event is None:
            return
        try:
            outcome = self._on_event(event)
            if inspect.isawaitable(outcome):
                await outcome
        except Exception as e:  # a host callback must not break a model call
            logger.warning("event callback failed for %s: %s", event.kind, type(e).__name__)

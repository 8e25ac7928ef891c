"""pydantic-ai with touba's window and stores.

```python
from pydantic_ai import Agent
from pydantic_ai.capabilities import ProcessHistory
from touba.integrations.pydantic_ai import ToubaConversations, touba_history

agent = Agent("openai:gpt-5.2", capabilities=[ProcessHistory(touba_history(max_messages=40))])

conversations = ToubaConversations(store, namespace="support")
async with conversations.open("user-42") as conversation:
    result = await agent.run("Where is my order?", message_history=conversation.messages)
    conversation.extend(result.new_messages())
```

Behaviour decisions:

- **Exchanges.** A ``ModelResponse`` with ``ToolCallPart``\\ s and the
  ``ModelRequest``\\ s carrying their ``ToolReturnPart``\\ s or
  ``RetryPromptPart``\\ s (matched by ``tool_call_id``) are one exchange; a
  ``ModelRequest`` answering no call (a user prompt) opens a turn. A
  response whose calls were never answered, or a return whose call is gone,
  makes its exchange incomplete. The request pydantic-ai writes when a run is
  cancelled during its tools (``state="interrupted"``, no user prompt) belongs
  to the exchange it interrupts: at the end of a conversation that exchange is
  loaded, for pydantic-ai to close its calls out; once a turn follows it is
  never sent (pydantic-ai closes calls out only at the end of a history).
- **The window** (:func:`touba_history`) is the one of
  :mod:`touba.integrations._turns`: the current user request always, not
  counted in the bounds; then the current turn's exchanges, newest first, the
  last one always (``DecisionHistoryLimitExceeded`` when it alone exceeds a
  bound); then whole earlier turns. A ``ToolCallPart`` never reaches the
  model without its return, nor a return without its call, and the window
  always opens on a user request and ends on the request being sent.
- **System prompts.** ``SystemPromptPart``\\ s of messages that leave the
  window are moved, unchanged, to the start of the window's first request, so
  the model keeps its system prompt (they are not counted in the bounds).
- **Measure.** A message weighs the UTF-8 bytes of its compact JSON, as
  pydantic-ai serialises it (``ModelMessagesTypeAdapter``).
- **ProcessHistory persists what it keeps.** pydantic-ai writes a processor's
  result back into the run's messages, so messages trimmed during a run are
  not in ``result.new_messages()``. For a durable conversation, give the
  same window as :class:`ToubaWindow`, a capability that trims only what is
  sent: the run keeps every message and the store receives all of them.
- **Durable conversations** (:class:`ToubaConversations`): one record per
  conversation in any touba store. ``open(conversation_id)`` reserves it
  (a second ``open`` of the same conversation, in any process, is refused at
  once with ``DecisionHistoryBusy``), loads its window, and on a clean exit
  appends what :meth:`ToubaConversation.extend` was given and releases the
  reservation in one atomic step. An exception in the block writes nothing; a
  crashed process leaves the conversation reserved until
  ``store.recover(conversations.key(conversation_id), worker_stopped=True)``.
- **What a run costs.** On a built-in store a conversation is an append-only
  log of turns (:mod:`touba.integrations._turns_log`): ``open`` reads the
  last turn, the sizes of the earlier turns ``max_messages`` can reach and
  the messages of those the window keeps, and the save appends the run's
  messages; neither loads nor rewrites the whole conversation, so a run costs
  the same at 10 or 10,000 stored messages (an unbounded window reads what it
  returns: everything). A custom ``HistoryStore`` (``transact`` only) keeps
  the conversation as one record, read and written whole; a version 1 record
  (touba before the log) is read whole once and rewritten as a log.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from itertools import accumulate
from types import TracebackType
from typing import Any, Final

from touba.history import ExchangeSize, HistoryStore, message_bytes
from touba.history._store import LogSnapshot, LogStore, LogWrite, StoreUsage
from touba.integrations._cut import Unit, check_bound, check_limit
from touba.integrations._items_log import Legacy
from touba.integrations._records import (
    Held,
    HeldLog,
    Record,
    check_id,
    check_store,
    conversation_store_key,
    corrupt,
)
from touba.integrations._turns import TurnUnit, turn_window
from touba.integrations._turns_log import (
    check_head,
    earlier_units,
    extend,
    new_head,
    reach,
    record_of,
    stored_messages,
    wider,
)

try:
    from pydantic import ValidationError
    from pydantic_ai.capabilities import AbstractCapability
    from pydantic_ai.messages import (
        ModelMessage,
        ModelMessagesTypeAdapter,
        ModelRequest,
        ModelResponse,
        RetryPromptPart,
        SystemPromptPart,
        ToolCallPart,
        ToolReturnPart,
        UserPromptPart,
    )
    from pydantic_ai.models import ModelRequestContext
    from pydantic_ai.tools import RunContext
except ImportError as e:  # pragma: no cover - exercised without the extra installed
    raise ImportError(
        'touba.integrations.pydantic_ai needs pydantic-ai: pip install "touba[pydantic-ai]"'
    ) from e

__all__ = ["ToubaConversation", "ToubaConversations", "ToubaWindow", "touba_history"]

KIND: Final = "touba.pydantic_ai.conversation"
INTEGRATION: Final = "pydantic-ai"
MiB: Final = 1024 * 1024


def _returns(message: ModelRequest) -> list[str]:
    return [
        p.tool_call_id
        for p in message.parts
        if isinstance(p, ToolReturnPart) or (isinstance(p, RetryPromptPart) and p.tool_name)
    ]


def _calls(message: ModelResponse) -> list[str]:
    return [p.tool_call_id for p in message.parts if isinstance(p, ToolCallPart)]


def _dump(messages: Sequence[ModelMessage]) -> list[Record]:
    dumped: list[Record] = ModelMessagesTypeAdapter.dump_python(list(messages), mode="json")
    return dumped


@dataclass(slots=True)
class _Open:
    start: int
    is_input: bool
    open: Counter[str] = field(default_factory=Counter)
    orphan: bool = False
    interrupted: bool = False  # a run's interruption closed it: no response joins it


def _interrupts(message: ModelRequest, current: _Open) -> bool:
    """``message`` is the request a run cancelled during its tools wrote after the response
    of ``current`` (``state="interrupted"``, no user prompt): part of that exchange, which it
    leaves incomplete (pydantic-ai closes its calls out only at the end of a history)."""
    return (
        getattr(message, "state", "complete") == "interrupted"
        and bool(+current.open)
        and not any(isinstance(p, UserPromptPart) for p in message.parts)
    )


def _units(messages: Sequence[ModelMessage], sizes: Sequence[int]) -> list[TurnUnit]:
    """Split ``messages`` into exchanges and turn inputs (see the module docstring)."""
    units: list[TurnUnit] = []
    current: _Open | None = None

    def close(stop: int) -> None:
        if current is not None:
            size = ExchangeSize(stop - current.start, sum(sizes[current.start : stop]))
            complete = not (+current.open) and not current.orphan
            units.append(TurnUnit(Unit(current.start, stop, complete, size), current.is_input))

    for index, message in enumerate(messages):
        if isinstance(message, ModelRequest):
            returns = _returns(message)
            answers = current is not None and any(current.open[r] > 0 for r in returns)
            if current is not None and (answers or _interrupts(message, current)):
                current.interrupted |= getattr(message, "state", "complete") == "interrupted"
                for r in returns:
                    if current.open[r] > 0:
                        current.open[r] -= 1
                    else:
                        current.orphan = True
                continue
            close(index)
            current = _Open(index, is_input=not returns, orphan=bool(returns))
        else:
            if current is None or not +current.open or current.interrupted:
                close(index)
                current = _Open(index, is_input=False)
            current.open.update(_calls(message))
    close(len(messages))
    return units


def _window(
    messages: Sequence[ModelMessage],
    *,
    max_messages: int,
    max_bytes: int,
    keep_pending_tail: bool = False,
) -> list[ModelMessage]:
    if not messages:
        return []
    sizes = [message_bytes(m) for m in _dump(messages)]
    chosen = turn_window(
        _units(messages, sizes),
        max_messages=max_messages,
        max_bytes=max_bytes,
        keep_pending_tail=keep_pending_tail,
    )
    kept = [i for unit in chosen for i in range(unit.start, unit.stop)]
    window = [messages[i] for i in kept]
    left = set(range(len(messages))) - set(kept)
    moved = [
        part
        for i in sorted(left)
        if isinstance(messages[i], ModelRequest)
        for part in messages[i].parts
        if isinstance(part, SystemPromptPart)
    ]
    return _opened(window, moved)


def touba_history(
    *, max_messages: int | None = None, max_bytes: int | None = None
) -> Callable[[list[ModelMessage]], list[ModelMessage]]:
    """A pydantic-ai history processor that trims by complete exchanges.

    Give it as ``capabilities=[ProcessHistory(touba_history(max_messages=...))]``.
    The processor raises ``DecisionHistoryLimitExceeded`` (``limit`` names the
    bound) when the last exchange alone exceeds a bound; ``None`` leaves a
    bound open. Raises ``ConfigurationError`` on a bad bound, at once.
    """
    messages_bound = check_bound("max_messages", max_messages)
    bytes_bound = check_bound("max_bytes", max_bytes)

    def process(messages: list[ModelMessage]) -> list[ModelMessage]:
        return _window(messages, max_messages=messages_bound, max_bytes=bytes_bound)

    return process


@dataclass
class ToubaWindow(AbstractCapability[Any]):
    """touba's window applied to what each model request sends, and only to that.

    The same window as :func:`touba_history`, but the run's own messages are
    left whole, so ``result.new_messages()`` holds every message of the run:
    the capability to use with :class:`ToubaConversations`.
    """

    max_messages: int | None = None
    max_bytes: int | None = None

    def __post_init__(self) -> None:
        self._process = touba_history(max_messages=self.max_messages, max_bytes=self.max_bytes)

    async def before_model_request(
        self, ctx: RunContext[Any], request_context: ModelRequestContext
    ) -> ModelRequestContext:
        """pydantic-ai's hook: the request sends the window of its messages (cut by whole
        exchanges, as :func:`touba_history` does, raising ``DecisionHistoryLimitExceeded``
        when the last exchange alone is over a bound); the run's messages stay whole."""
        request_context.messages = self._process(list(request_context.messages))
        return request_context


class ToubaConversation:
    """One reserved conversation, inside ``async with conversations.open(...)``."""

    def __init__(self, conversation_id: str, messages: list[ModelMessage]) -> None:
        self.conversation_id = conversation_id
        self.messages = messages
        """The window loaded from the store, to pass as ``message_history``."""
        self._added: list[ModelMessage] = []

    def extend(self, messages: Sequence[ModelMessage]) -> None:
        """Add ``messages`` (typically ``result.new_messages()``); written when the block exits.

        Raises ``TypeError``, adding none of them, when one is not a pydantic-ai
        ``ModelRequest`` or ``ModelResponse``.
        """
        for index, message in enumerate(messages):
            if not isinstance(message, ModelRequest | ModelResponse):
                raise TypeError(
                    f"message {index} is a {type(message).__name__}, not a pydantic-ai "
                    "ModelRequest or ModelResponse; nothing was added"
                )
        self._added.extend(messages)


class ToubaConversations:
    """pydantic-ai conversations kept in a touba store, one reservation per run.

    ``namespace`` comes from trusted configuration; ``max_messages`` and
    ``max_bytes`` bound the window :meth:`open` loads (``None``: unbounded),
    ``max_retained_bytes`` what one conversation keeps (refused atomically
    beyond, ``DecisionHistoryLimitExceeded``). Raises ``ConfigurationError``
    on a bad argument, at construction.
    """

    def __init__(
        self,
        store: HistoryStore,
        *,
        namespace: str,
        max_messages: int | None = None,
        max_bytes: int | None = None,
        max_retained_bytes: int = 8 * MiB,
    ) -> None:
        self.store = check_store(store)
        self.namespace = check_id("namespace", namespace)
        self._max_messages = check_bound("max_messages", max_messages)
        self._max_bytes = check_bound("max_bytes", max_bytes)
        self.max_retained_bytes = check_limit("max_retained_bytes", max_retained_bytes)

    def key(self, conversation_id: str) -> str:
        """The store key of a conversation (for ``store.recover`` or ``touba history``)."""
        return conversation_store_key(
            self.namespace, INTEGRATION, check_id("conversation_id", conversation_id)
        )

    def open(self, conversation_id: str) -> AbstractAsyncContextManager[ToubaConversation]:
        """Reserve, load and, on a clean exit, save one conversation (an async context manager).

        Entering raises ``DecisionHistoryBusy`` when another holder has the
        conversation, ``DecisionHistoryRecordInvalid`` for a record this
        touba cannot read, ``DecisionHistoryLimitExceeded`` when the last
        exchange alone exceeds the load bounds; leaving raises
        ``DecisionHistoryLimitExceeded`` when the save would exceed
        ``max_retained_bytes`` or the store's capacity (nothing written).
        """
        return _Opening(self, check_id("conversation_id", conversation_id))

    async def messages(self, conversation_id: str) -> list[ModelMessage]:
        """Every stored message of a conversation (a short transaction; ``[]`` if none)."""
        key = self.key(conversation_id)
        if isinstance(self.store, LogStore):

            async def read_log(
                snapshot: LogSnapshot | None, usage: StoreUsage | None
            ) -> tuple[LogWrite | None, list[Record]]:
                if snapshot is None:
                    return None, []
                self._check(snapshot.head, conversation_id)
                rows = await snapshot.exchanges(0, snapshot.exchange_count)
                return LogWrite(head=snapshot.head), [m for exchange in rows for m in exchange]

            with contextlib.suppress(Legacy):
                return _validate(await self.store.transact_log(key, read_log))

        async def read(record: Record | None) -> tuple[Record | None, list[Record]]:
            return record, self._stored(record, conversation_id)

        return _validate(await self.store.transact(key, read))

    def _check(self, head: Record, conversation_id: str) -> None:
        check_head(head, kind=KIND, namespace=self.namespace, conversation_id=conversation_id)

    def _stored(self, record: Record | None, conversation_id: str) -> list[Record]:
        if record is None:
            return []
        return stored_messages(
            record, kind=KIND, namespace=self.namespace, conversation_id=conversation_id
        )

    def _bounds(self) -> dict[str, int]:
        return {"max_messages": self._max_messages, "max_bytes": self._max_bytes}


def _validate(dumped: list[Record]) -> list[ModelMessage]:
    """Stored messages as pydantic-ai's; ``DecisionHistoryRecordInvalid`` when one is not."""
    try:
        messages: list[ModelMessage] = ModelMessagesTypeAdapter.validate_python(dumped)
    except ValidationError as e:
        first = e.errors(include_input=False, include_url=False)[0]
        where = ".".join(str(part) for part in first["loc"])
        raise corrupt(  # (not chained: pydantic's error quotes the stored content)
            KIND, f"a stored message is not a pydantic-ai message: {first['type']} at {where}"
        ) from None
    return messages


def _system(dumped: Sequence[Record], start: int = 0) -> list[tuple[int, list[Record]]]:
    """The system prompt parts of each request among ``dumped`` (indices from ``start``)."""
    found = []
    for index, message in enumerate(dumped, start):
        if message.get("kind") == "request":
            parts = [p for p in message.get("parts", ()) if p.get("part_kind") == "system-prompt"]
            if parts:
                found.append((index, parts))
    return found


def _moved(system: Sequence[Sequence[Any]], kept: set[int]) -> list[Any]:
    """The system prompt parts of the requests left out of a window, in order."""
    parts = [part for index, found in system if index not in kept for part in found]
    if not parts:
        return []
    request: list[ModelMessage] = _validate([{"kind": "request", "parts": parts}])
    return list(request[0].parts)


def _opened(window: list[ModelMessage], moved: list[Any]) -> list[ModelMessage]:
    """``window`` with ``moved`` at the start of its first request (see "System prompts")."""
    if moved and window and isinstance(window[0], ModelRequest):
        window[0] = dataclasses.replace(window[0], parts=[*moved, *window[0].parts])
    return window


class _Opening:
    """What :meth:`ToubaConversations.open` returns: the turn log on a built-in store
    (:mod:`touba.integrations._turns_log`), the whole record on a store that only
    offers ``transact`` or for a version 1 record (rewritten in version 2)."""

    def __init__(self, conversations: ToubaConversations, conversation_id: str) -> None:
        self._of = conversations
        self._id = conversation_id
        self._key = conversations.key(conversation_id)
        self._held: HeldLog[ToubaConversation] | Held[ToubaConversation] | None = None

    async def __aenter__(self) -> ToubaConversation:
        store = self._of.store
        if isinstance(store, LogStore):
            log = _LogTurn(self._of, self._id)
            held: HeldLog[ToubaConversation] | Held[ToubaConversation]
            held = HeldLog(store, self._key, log.load, log.save)
            try:
                conversation = await held.__aenter__()
            except Legacy:
                pass
            else:
                self._held = held
                return conversation
        whole = _WholeTurn(self._of, self._id)
        held = Held(store, self._key, whole.load, whole.save)
        conversation = await held.__aenter__()
        self._held = held
        return conversation

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._held is not None
        await self._held.__aexit__(exc_type, exc, tb)


class _LogTurn:
    """One run on the turn log: the window read from the tail, the new messages appended."""

    def __init__(self, conversations: ToubaConversations, conversation_id: str) -> None:
        self._of = conversations
        self._id = conversation_id
        self._head: Record = new_head(KIND, conversations.namespace, conversation_id)
        self._stored = False
        self._count = 0
        self._offset = 0  # the last turn's first message
        self._last: list[ModelMessage] = []
        self._last_sizes: list[int] = []
        self._conversation: ToubaConversation | None = None

    async def load(self, snapshot: LogSnapshot | None) -> ToubaConversation:
        window: list[ModelMessage] = []
        if snapshot is not None:
            head = snapshot.head
            self._of._check(head, self._id)
            self._head, self._stored, self._count = head, True, snapshot.exchange_count
            if self._count:
                window = await self._window(snapshot)
        self._conversation = ToubaConversation(self._id, window)
        return self._conversation

    async def _window(self, snapshot: LogSnapshot) -> list[ModelMessage]:
        head, count = self._head, self._count
        (last,) = await snapshot.exchanges(count - 1, count)
        self._last = _validate(last)
        self._last_sizes = [message_bytes(m) for m in last]
        self._offset = head["messages"] - len(last)
        if self._offset < 0:
            raise corrupt(KIND, "its message count is not its turns'")
        current = _shifted(_units(self._last, self._last_sizes), self._offset)
        first, starts, kept = await self._kept(snapshot, current)
        messages = dict(enumerate(self._last, self._offset))
        wanted = sorted(i for i in kept if i < self._offset)
        if wanted:  # earlier turns: read from the first one the window keeps
            turn = bisect.bisect_right(starts, wanted[0]) - 1
            rows = await snapshot.exchanges(first + turn, count - 1)
            flat = [m for exchange in rows for m in exchange]
            picked = _validate([flat[i - starts[turn]] for i in wanted])
            messages.update(zip(wanted, picked, strict=True))
        window = [messages[i] for i in sorted(kept)]
        return _opened(window, _moved(head["system"], kept))

    async def _kept(
        self, snapshot: LogSnapshot, current: list[TurnUnit]
    ) -> tuple[int, list[int], set[int]]:
        """The messages the window keeps, given the last turn's ``current`` units: the
        sizes read from turn ``first`` on (widened while the window keeps the oldest
        turn read, by :func:`~touba.integrations._turns_log.wider`), and the first
        message of each earlier turn read (turns ``first`` .. ``count - 2``)."""
        head, count, bounds = self._head, self._count, self._of._bounds()
        first = reach(count, **bounds)
        while True:
            sizes = await snapshot.sizes(first)
            try:
                if len(sizes) != count - first:
                    raise ValueError("its message count is not its turns'")
                earlier = earlier_units(head, first, sizes[:-1], self._offset)
            except ValueError as e:
                raise corrupt(KIND, str(e)) from e
            chosen = turn_window([*earlier, *current], **bounds, keep_pending_tail=True)
            kept = {i for unit in chosen for i in range(unit.start, unit.stop)}
            back = list(accumulate((s.messages for s in reversed(sizes[:-1])), initial=0))
            starts = [self._offset - n for n in reversed(back[1:])]
            second = starts[1] if len(starts) > 1 else self._offset
            if not starts or min(kept, default=self._offset) >= second:
                return first, starts, kept  # the oldest turn read left out: none before fits
            widened = wider(count, first, **bounds)
            if widened == first:
                return first, starts, kept
            first = widened

    def save(self) -> LogWrite | None:
        assert self._conversation is not None
        added = self._conversation._added
        if not added:  # a run that added nothing: its reservation was activity
            return LogWrite(head=self._head) if self._stored else None
        dumped = _dump(added)
        sizes = [message_bytes(m) for m in dumped]
        kept = len(self._last)
        units = _units([*self._last, *added], [*self._last_sizes, *sizes])
        planned = extend(
            self._head,
            self._count,
            units,
            self._offset,
            kept,
            dumped,
            sizes,
            _system(dumped, kept),
            max_retained_bytes=self._of.max_retained_bytes,
        )
        return LogWrite(head=planned.head, append=planned.rows)


def _shifted(units: Sequence[TurnUnit], offset: int) -> list[TurnUnit]:
    return [
        TurnUnit(
            dataclasses.replace(u.unit, start=u.unit.start + offset, stop=u.unit.stop + offset),
            u.is_input,
        )
        for u in units
    ]


class _WholeTurn:
    """One run on the whole record: loaded, windowed and saved in one piece."""

    def __init__(self, conversations: ToubaConversations, conversation_id: str) -> None:
        self._of = conversations
        self._id = conversation_id
        self._dumped: list[Record] = []
        self._stored: list[ModelMessage] = []
        self._conversation: ToubaConversation | None = None

    def load(self, record: Record | None) -> ToubaConversation:
        self._dumped = self._of._stored(record, self._id)
        self._stored = _validate(self._dumped)
        window = _window(self._stored, **self._of._bounds(), keep_pending_tail=True)
        self._conversation = ToubaConversation(self._id, window)
        return self._conversation

    def save(self, record: Record | None) -> Record | None:
        assert self._conversation is not None
        added = self._conversation._added
        if not added:
            return record
        dumped = [*self._dumped, *_dump(added)]
        sizes = [message_bytes(m) for m in dumped]
        return record_of(
            record,
            dumped,
            _units([*self._stored, *added], sizes),
            sizes,
            _system(dumped),
            kind=KIND,
            namespace=self._of.namespace,
            conversation_id=self._id,
            max_retained_bytes=self._of.max_retained_bytes,
        )

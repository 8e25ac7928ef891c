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
  makes its exchange incomplete.
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
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from touba.errors import ConfigurationError
from touba.history import ExchangeSize, HistoryStore, message_bytes
from touba.integrations._cut import UNBOUNDED, Unit, check_bound
from touba.integrations._records import (
    Held,
    Record,
    check_id,
    check_store,
    conversation_store_key,
    new_record,
    record_items,
)
from touba.integrations._turns import TurnUnit, turn_window

try:
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
            if returns and current is not None and any(current.open[r] > 0 for r in returns):
                for r in returns:
                    if current.open[r] > 0:
                        current.open[r] -= 1
                    else:
                        current.orphan = True
                continue
            close(index)
            current = _Open(index, is_input=not returns, orphan=bool(returns))
        else:
            if current is None or not +current.open:
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
    if moved and window and isinstance(window[0], ModelRequest):
        first = window[0]
        window[0] = dataclasses.replace(first, parts=[*moved, *first.parts])
    return window


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
        """Add ``messages`` (typically ``result.new_messages()``); written when the block exits."""
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
        if check_bound("max_retained_bytes", max_retained_bytes) == UNBOUNDED:
            raise ConfigurationError("max_retained_bytes must be a positive int")
        self.max_retained_bytes = max_retained_bytes

    def key(self, conversation_id: str) -> str:
        """The store key of a conversation (for ``store.recover`` or ``touba history``)."""
        return conversation_store_key(
            self.namespace, INTEGRATION, check_id("conversation_id", conversation_id)
        )

    def _stored(self, record: Record | None, conversation_id: str) -> list[Record]:
        return record_items(
            record, kind=KIND, namespace=self.namespace, conversation_id=conversation_id
        )

    def open(self, conversation_id: str) -> Held[ToubaConversation]:
        """Reserve, load and, on a clean exit, save one conversation (an async context manager).

        Entering raises ``DecisionHistoryBusy`` when another holder has the
        conversation, ``DecisionHistoryRecordInvalid`` for a record this
        touba cannot read, ``DecisionHistoryLimitExceeded`` when the last
        exchange alone exceeds the load bounds; leaving raises
        ``DecisionHistoryLimitExceeded`` when the save would exceed
        ``max_retained_bytes`` or the store's capacity (nothing written).
        """
        key = self.key(conversation_id)
        box: list[ToubaConversation] = []

        def load(record: Record | None) -> ToubaConversation:
            stored = ModelMessagesTypeAdapter.validate_python(self._stored(record, conversation_id))
            window = _window(
                stored,
                max_messages=self._max_messages,
                max_bytes=self._max_bytes,
                keep_pending_tail=True,  # a run paused on deferred calls resumes from it
            )
            box.append(ToubaConversation(conversation_id, window))
            return box[0]

        def save(record: Record | None) -> Record | None:
            added = box[0]._added
            if not added:
                return record
            items = [*self._stored(record, conversation_id), *_dump(added)]
            return new_record(
                record,
                items,
                kind=KIND,
                namespace=self.namespace,
                conversation_id=conversation_id,
                max_retained_bytes=self.max_retained_bytes,
            )

        return Held(self.store, key, load, save)

    async def messages(self, conversation_id: str) -> list[ModelMessage]:
        """Every stored message of a conversation (a short transaction; ``[]`` if none)."""
        key = self.key(conversation_id)

        async def read(record: Record | None) -> tuple[Record | None, list[Record]]:
            return record, self._stored(record, conversation_id)

        stored = await self.store.transact(key, read)
        return ModelMessagesTypeAdapter.validate_python(stored)

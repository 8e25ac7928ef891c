"""``Runtime.stream``: an invocation's events as they happen, then its result.

``async with runtime.stream(agent, input=...) as stream:`` runs the very
invocation :meth:`Runtime.invoke` runs (same checks, budgets, approvals,
history and trace), in a task of its own, and ``async for event in stream``
yields, in order:

- :class:`TextDelta`: a piece of a plain-text reply, as the model writes it
  (a structured final output is not streamed: it comes whole in the result);
- :class:`DecisionCompleted`: a decision was received, checked and saved;
- :class:`ToolCallStarted` / :class:`ToolCallFinished`: a call starts running /
  its observation (``status`` as the observation's: ``ok``, ``error``,
  ``denied``);
- :class:`ApprovalRequired`: the invocation stopped for approval (a checkpoint);
- :class:`InvocationFinished`: last, with the ``InvocationResult`` ``invoke``
  would have returned (also ``stream.result`` once the iteration ended).

A delegate's events carry its own ``agent`` and ``invocation_id``. Events wait
in a bounded buffer: a consumer that reads slowly makes the model's stream
wait, nothing is lost. Leaving the ``async with`` before the end cancels the
invocation: the vendor's HTTP response is closed and nothing of the unfinished
decision is stored.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from touba.errors import ConfigurationError
from touba.history._model import JSON, CapabilityCall
from touba.providers._stream import StreamedText
from touba.runtime._results import InvocationResult

__all__ = [
    "ApprovalRequired",
    "DecisionCompleted",
    "InvocationFinished",
    "InvocationStream",
    "StreamEvent",
    "TextDelta",
    "ToolCallFinished",
    "ToolCallStarted",
    "current_channel",
    "report_note",
    "stream_text",
]


@dataclass(frozen=True, slots=True)
class TextDelta:
    """A piece of the reply the agent ``agent`` (its ``invocation_id``) is writing."""

    text: str
    agent: str
    invocation_id: str


@dataclass(frozen=True, slots=True)
class ToolCallStarted:
    """A call passed its checks and starts running."""

    call_id: str
    name: str
    arguments: JSON
    agent: str = ""
    invocation_id: str = ""


@dataclass(frozen=True, slots=True)
class ToolCallFinished:
    """A call's observation: ``status`` is ``"ok"``, ``"error"`` or ``"denied"``."""

    call_id: str
    name: str
    status: str
    agent: str = ""
    invocation_id: str = ""


@dataclass(frozen=True, slots=True)
class ApprovalRequired:
    """The invocation stopped: ``calls`` await approval; resume ``checkpoint_id``."""

    checkpoint_id: str
    calls: tuple[CapabilityCall, ...]


@dataclass(frozen=True, slots=True)
class DecisionCompleted:
    """A decision was received and saved: ``final`` when it ends the invocation."""

    final: bool
    agent: str = ""
    invocation_id: str = ""


@dataclass(frozen=True, slots=True)
class InvocationFinished:
    """The last event: what ``invoke`` (or ``resume``) would have returned."""

    result: InvocationResult


StreamEvent = (
    TextDelta
    | ToolCallStarted
    | ToolCallFinished
    | ApprovalRequired
    | DecisionCompleted
    | InvocationFinished
)

BUFFER = 64
"""Text deltas buffered before the model's stream waits for the consumer."""


class _Channel:
    """Events from the invocation's task to the consumer, in order.

    ``put`` (text deltas) waits while ``BUFFER`` events are unread; ``push``
    (the few events of decisions and calls, bounded by the agent's budgets)
    never waits, so the runtime's synchronous trace notes can report them.
    """

    def __init__(self) -> None:
        self._items: deque[StreamEvent] = deque()
        self._readable = asyncio.Event()
        self._writable = asyncio.Event()
        self._closed = False

    def push(self, event: StreamEvent) -> None:
        self._items.append(event)
        self._readable.set()

    async def put(self, event: StreamEvent) -> None:
        while len(self._items) >= BUFFER:
            self._writable.clear()
            await self._writable.wait()
        self.push(event)

    async def get(self) -> StreamEvent | None:
        while not self._items:
            if self._closed:
                return None
            self._readable.clear()
            await self._readable.wait()
        event = self._items.popleft()
        self._writable.set()
        return event

    def close(self) -> None:
        self._closed = True
        self._readable.set()


current_channel: ContextVar[_Channel | None] = ContextVar("touba_stream_channel", default=None)
"""The channel of the stream the current invocation reports to (None: not streamed)."""


class InvocationStream:
    """An invocation streamed (see the module docstring); use it as ``async with``."""

    def __init__(self, start: Callable[[], Awaitable[InvocationResult]]) -> None:
        self._start = start
        self._channel = _Channel()
        self._task: asyncio.Task[None] | None = None
        self._result: InvocationResult | None = None
        self._error: BaseException | None = None

    async def __aenter__(self) -> InvocationStream:
        if self._task is not None:
            raise ConfigurationError("a stream can be entered only once")
        self._task = asyncio.create_task(self._produce())
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        task = self._task
        if task is not None and not task.done():
            task.cancel()  # the consumer left early: the invocation stops here
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _produce(self) -> None:
        current_channel.set(self._channel)
        try:
            result = await self._start()
            if result.status == "awaiting_approval" and result.checkpoint_id is not None:
                self._channel.push(ApprovalRequired(result.checkpoint_id, result.pending))
            self._result = result
            self._channel.push(InvocationFinished(result))
        except Exception as e:  # a misuse the runtime raises (ConfigurationError...)
            self._error = e
        finally:
            self._channel.close()

    def __aiter__(self) -> InvocationStream:
        return self

    async def __anext__(self) -> StreamEvent:
        if self._task is None:
            raise ConfigurationError("enter the stream first: async with runtime.stream(...)")
        event = await self._channel.get()
        if event is None:
            if self._error is not None:
                raise self._error
            raise StopAsyncIteration
        return event

    @property
    def result(self) -> InvocationResult:
        """The ``InvocationResult``, once the events were read to the end."""
        if self._result is None:
            raise ConfigurationError(
                "the stream has not finished: read its events to the end (InvocationFinished)"
            )
        return self._result


def stream_text(agent: str, invocation_id: str) -> Callable[[Any], Awaitable[None]] | None:
    """The provider sink of a streamed invocation's decision (None when not streamed)."""
    channel = current_channel.get()
    if channel is None:
        return None

    async def sink(delta: Any) -> None:
        if isinstance(delta, StreamedText):
            await channel.put(TextDelta(delta.text, agent, invocation_id))

    return sink


def report_note(kind: str, agent: str, invocation_id: str, data: dict[str, Any]) -> None:
    """The stream event of one trace note of a streamed invocation, if it has one."""
    channel = current_channel.get()
    if channel is None:
        return
    if kind == "decision":
        channel.push(DecisionCompleted(bool(data.get("final")), agent, invocation_id))
    elif kind == "call":
        channel.push(
            ToolCallStarted(
                str(data.get("call_id")),
                str(data.get("name")),
                data.get("arguments"),
                agent,
                invocation_id,
            )
        )
    elif kind == "observation":
        channel.push(
            ToolCallFinished(
                str(data.get("call_id")),
                str(data.get("name")),
                str(data.get("status")),
                agent,
                invocation_id,
            )
        )

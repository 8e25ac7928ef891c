"""``ChatSession``: chat turns over the runtime, with short-term memory and key events.

One turn is one user message and the agent's reply or replies, run as ONE
invocation of the agent (SPEC sections 8 and 9, seed 004). For each turn the
session gives the runtime an :class:`~touba.runtime.InvocationContext`:

- ``prior_turns``: the last ``short_term_turns`` turns of this session as
  text, the last ``full_context_turns`` of them with their whole tool trace
  (:func:`~touba.memory.select_prior_turns`); 0 turns: the agent forgets the
  previous turn;
- ``instructions``: the owner's key events (up to 5 not closed, most
  recently updated first), as quoted data, when key events are active (the
  switch on and at least one type), for every agent kind;
- ``tools`` (``kind="loop"`` only, key events active): ``create_key_event``,
  ``update_key_event`` and ``query_key_events``, run within the turn through
  the runtime's checks. A wrong parameter becomes an ``error`` observation
  whose message says what to fix (a wrong type names the allowed types); an
  id of another owner reads as not found. The ``type`` parameter lists the
  types in its description but carries no ``enum``, so that a wrong type
  reaches the key-event validation and its precise message rather than a
  generic schema refusal.

Decisions (documented here because they are behaviour):

- **Settings.** At the start of each turn (and of :meth:`ChatSession.end`)
  the session reads its agent's settings saved in the memory store (by the
  memory panel, ``store.save_memory_config``); saved settings win over the
  program's ``MemoryConfig``, so a change applies from the next turn of every
  running session, without a restart. A turn resumed after an approval keeps
  the context it started with.
- **What a turn was given.** Each stored turn carries a record (its
  ``context``, :mod:`touba.memory._turn_context`) of what its invocation was
  given: the settings in effect and where they came from (program, defaults,
  saved, with the save's time and author), the earlier turns sent (their
  numbers, which with their trace), the key events injected (ids, titles,
  statuses), the system prompt's size and each decision's window (read from
  the invocation's trace). Sizes, ids and settings only, never content; built
  from what the turn already read, so it never grows with the stored history.
  A turn resumed after an approval keeps the record it started with.

- **Storage.** A turn is stored when its invocation ends: completed, or failed
  after running at least one call (its effects happened; the memory says so,
  with no reply). A turn that failed before any call is not stored: nothing
  happened, the user may simply send again.
- **Streaming.** :meth:`ChatSession.stream` runs the same turn as ``send``
  (same context, same storage, same context record) under
  :meth:`~touba.Runtime.stream`'s events; the turn is concluded (stored, its
  decision history deleted) before ``InvocationFinished`` is yielded, and
  ``stream.turn`` is then the ``ChatTurn`` ``send`` would have returned.
- **Cancelled turns.** A consumer that stops before the invocation ends (it
  leaves the ``async with``, ``break``s, its task is cancelled) cancels the
  turn: the invocation is cancelled (the vendor's response closed, nothing of
  the unfinished decision stored), the turn is not stored, nothing blocks the
  session (its lock is released on leaving: the next ``send`` or ``stream``
  runs at once), and ``stream.turn`` is a ``ChatTurn`` with ``status ==
  "cancelled"``, no reply, ``stored`` None; its ``result`` is the runtime's for
  the stopped invocation (status ``cancelled``, its trace ending with
  ``decision_cancelled``). Once a decision was saved or a call ran, the
  runtime keeps a ``cancelled`` checkpoint (``result.checkpoint_id``):
  ``resume(checkpoint_id=...)`` finishes that turn, running no call twice, and
  stores it. The decision history of the invocations the stream reported is
  deleted, as a stored turn's is, unless it is retained
  (``retain_decision_history``) or that checkpoint was kept (its resume needs
  it). A stop
  that comes once the invocation has ended is too late: the turn is concluded
  anyway (the conclusion is shielded from the cancellation, so that a turn is
  stored whole or not at all) and ``stream.turn`` is that turn.
- **Approvals and retries.** A turn whose invocation awaits approval, or
  failed with a retryable error after calls ran (it then has a checkpoint:
  a provider or store was down), is not stored yet and blocks the session
  (``send`` and ``end`` refuse) until :meth:`ChatSession.resume`, which
  resumes with the same context (running no call twice) and stores the turn
  once the invocation ends. ``resume(checkpoint_id=...)`` resumes a turn
  paused by another process (durable checkpoints), after checking that the
  checkpoint belongs to this session.
- **Decision history.** Once a turn is stored (its text and trace are what
  later turns see), the decision history of its invocation and of its
  delegates is deleted from the provider's history store, so that chat
  traffic never fills it (``max_sessions``): the store holds only the turns
  running now. ``retain_decision_history=True`` keeps them until they expire
  (the seed's rule for a finished conversation). A turn awaiting approval or
  a retry keeps its history until it ends.
- **Preview.** ``mode="preview"`` sends no prior turn, injects no key event,
  offers no key-event tool and writes no key event, on every turn. Its turns
  are stored in a session of its own, marked ``preview`` (the store refuses
  to reopen a live session as preview, or the reverse), so a debugging
  preview never enters a live session's memory, and is never extracted.
- **Extraction** (``kind="agent"``/``"flow"``, live, key events active):
  :meth:`ChatSession.end` queues one durable job per session end. With
  ``extract_in_background=True`` (default) the session also runs that job
  in-process, in a task it owns: one attempt after another, waiting out the
  queue's backoff, until the job is done or failed; :meth:`close` lets the
  current attempt finish and stops retrying (the job stays queued for
  ``touba worker``). With ``False`` only ``touba worker`` runs it.
- **Idle time.** ``idle_seconds`` ends the session after that long without a
  turn, from a timer task the session owns (never while a turn runs or awaits
  approval). It lives in this process only: a server that drops the session
  object should end idle sessions itself.
- **Identity.** Each turn is an invocation with ``run_id`` = the session id
  and a new ``invocation_id``; its context carries the session id and the
  user id, the trusted keys of business resources' ``session`` and ``user``
  scopes (:mod:`touba.runtime._resources`), in preview too: a capability's
  resource writes are effects like any other.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import TracebackType
from typing import Any, Final

from touba._closing import AsyncClosing
from touba.errors import (
    ConfigurationError,
    DecisionHistoryLimitExceeded,
    KeyEventInvalid,
    MemoryStoreUnavailable,
)
from touba.history._model import JSON, canonical_json
from touba.memory._config import MemoryConfig
from touba.memory._extraction import ExtractionQueue
from touba.memory._fork import fork_stored_session
from touba.memory._key_events import (
    TOOL_NAMES,
    KeyEventService,
    owner_for,
    render_key_events_block,
)
from touba.memory._model import (
    EffectiveMemoryConfig,
    ExtractionJob,
    KeyEvent,
    SessionMeta,
    SessionMode,
    StoredTurn,
)
from touba.memory._store import MemoryStore, check_mode, resolve_memory_settings
from touba.memory._turn_context import given_context, turn_context
from touba.memory._window import select_prior_turns
from touba.memory._worker import ExtractionWorker, new_worker_id
from touba.providers._types import CapabilitySpec, TraceCall
from touba.runtime._context import InvocationContext, InvocationTool, ToolCall
from touba.runtime._results import InvocationResult
from touba.runtime._runtime import Runtime
from touba.runtime._stream import InvocationStream, StreamEvent, current_channel
from touba.runtime._trace import Trace

__all__ = ["ChatSession", "ChatStream", "ChatTurn", "turn_replies", "turn_trace"]

logger = logging.getLogger("touba.memory")
_EXTRACTED_KINDS: Final = ("agent", "flow")
_RETRY_FLOOR_SECONDS: Final = 0.01


@dataclass(frozen=True, slots=True)
class ChatTurn:
    """What :meth:`ChatSession.send` (or ``resume``) returns.

    ``replies``: the agent's texts of this turn (texts said along its calls,
    then the final output; JSON outputs as compact JSON). ``result``: the
    invocation's :class:`~touba.InvocationResult` (status, trace, pending
    calls). ``stored``: the turn as stored in the memory store (user message,
    replies, complete tool trace), or None while it awaits approval, when a
    turn that ran no call failed, or when it was cancelled.

    ``cancelled``: the consumer of :meth:`ChatSession.stream` stopped before
    the invocation ended. Such a turn has no reply and is not stored; its
    ``result`` is the runtime's for the stopped invocation (status
    ``cancelled``, a ``checkpoint_id`` when a decision was saved or a call ran;
    when the stop came before the invocation began, one made here with the
    invocations the stream reported); ``status`` is ``"cancelled"``.
    """

    session_id: str
    user: str
    replies: tuple[str, ...]
    result: InvocationResult
    stored: StoredTurn | None
    cancelled: bool = False

    @property
    def status(self) -> str:
        """``"cancelled"`` for a cancelled turn, else the invocation's status
        (``result.status``): completed, awaiting_approval or failed."""
        return "cancelled" if self.cancelled else self.result.status

    @property
    def reply(self) -> str | None:
        """The last reply (the final answer of a completed turn), or None."""
        return self.replies[-1] if self.replies else None


@dataclass(frozen=True, slots=True)
class _Paused:
    user: str
    checkpoint_id: str
    context: InvocationContext
    given: Mapping[str, JSON]
    failed: bool = False


def _reply_text(output: JSON) -> str | None:
    if output is None:
        return None
    return output if isinstance(output, str) else canonical_json(output)


def turn_replies(result: InvocationResult) -> tuple[str, ...]:
    """The replies of a turn: texts of its decisions with calls, then the final output."""
    replies: list[str] = []
    for entry in result.trace.of_kind("decision", invocation_id=result.invocation_id):
        text = entry.get("text")
        if not entry.get("final") and isinstance(text, str) and text.strip():
            replies.append(text)
    final = _reply_text(result.output) if result.status == "completed" else None
    if final is not None:
        replies.append(final)
    return tuple(replies)


def turn_trace(trace: Trace, invocation_id: str) -> tuple[tuple[TraceCall, ...], ...]:
    """The calls of one invocation grouped by decision, each with its observation.

    A flow's capability step (``flow_step_started`` with its call) counts as
    a decision of one call. A call without an observation (not run: the
    invocation stopped first) is left out, so the trace never holds an orphan
    call; an empty group too.
    """
    groups: list[tuple[TraceCall, ...]] = []
    calls: list[Any] = []
    answers: dict[str, Mapping[str, Any]] = {}

    def flush() -> None:
        group = tuple(
            TraceCall(
                call_id=call["call_id"],
                name=call["name"],
                arguments=dict(call["arguments"]),
                status=answers[call["call_id"]]["status"],
                result=answers[call["call_id"]].get("result"),
                error=answers[call["call_id"]].get("error"),
            )
            for call in calls
            if call["call_id"] in answers
        )
        if group:
            groups.append(group)

    for entry in trace:
        if entry.invocation_id != invocation_id:
            continue
        flow_call = entry.kind == "flow_step_started" and "calls" in entry.data
        if entry.kind == "decision" or flow_call:
            flush()
            found = entry.get("calls")
            calls = list(found) if isinstance(found, list) else []
            answers = {}
        elif entry.kind == "observation":
            answers[str(entry["call_id"])] = entry.data
    flush()
    return tuple(groups)


def _offered(spec: CapabilitySpec) -> CapabilitySpec:
    """The spec without the ``enum`` on ``type``: a wrong type gets the precise error."""
    properties = spec.parameters.get("properties")
    if not isinstance(properties, dict) or not isinstance(properties.get("type"), dict):
        return spec
    kept = {k: v for k, v in properties["type"].items() if k != "enum"}
    parameters = {**spec.parameters, "properties": {**properties, "type": kept}}
    return CapabilitySpec(spec.name, spec.description, parameters)


def _settled() -> InvocationResult | None:
    """How the runtime settled the invocation of the current stream, if it did."""
    channel = current_channel.get()
    return None if channel is None else channel.result


class ChatStream:
    """One turn of a :class:`ChatSession`, streamed (see :meth:`ChatSession.stream`).

    ``async with`` it once: entering takes the session (its turns run one at
    a time) and starts the turn; iterating yields the events of
    :meth:`~touba.Runtime.stream`; leaving gives the session back, after
    cancelling the turn if it had not ended. ``session`` and ``text``: the
    session and the user's message.
    """

    def __init__(self, session: ChatSession, text: str) -> None:
        self.session = session
        self.text = text
        self._turn: ChatTurn | None = None
        self._raised = False
        self._inner: InvocationStream | None = None
        self._entered = False
        self._left = False
        self._invocations: dict[tuple[str, str], None] = {}  # (invocation_id, agent) seen

    async def __aenter__(self) -> ChatStream:
        if self._entered:
            raise ConfigurationError("a chat stream can be entered only once")
        self._entered = True
        session = self.session
        await session._lock.acquire()
        try:
            context, given = await session._prepare()
            inner = InvocationStream(lambda: session._streamed_turn(self, context, given))
            await inner.__aenter__()
        except BaseException:
            session._lock.release()
            raise
        self._inner = inner
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        session = self.session
        try:
            if self._inner is not None:
                await self._inner.__aexit__(exc_type, exc, tb)
        finally:
            self._left = True
            try:
                if self._turn is None and not self._raised:
                    self._turn = await self._cancelled()
            finally:
                session._touch()
                session._lock.release()

    async def _cancelled(self) -> ChatTurn:
        """The turn the consumer stopped: not stored. Its result is the runtime's for the
        stopped invocation (``status == "cancelled"``, with the checkpoint the runtime kept
        when a decision was saved or a call ran). Its decision history is deleted, as a
        stored turn's, unless it is retained or that checkpoint may still be resumed."""
        session = self.session
        result: InvocationResult | None = None
        if self._inner is not None:
            with contextlib.suppress(ConfigurationError):  # none: stopped before it began
                result = self._inner.result
        if result is None:  # stopped before the invocation began: nothing ran
            trace = Trace()
            for invocation_id, agent in self._invocations:
                trace.add("invocation_started", session.session_id, invocation_id, agent)
            root = next((i for i, agent in self._invocations if agent == session.agent), "")
            result = InvocationResult(
                status="cancelled",
                run_id=session.session_id,
                invocation_id=root,
                agent_ref=session.agent,
                trace=trace,
            )
        kept = result.checkpoint_id is not None
        if self._invocations and not kept and not session.retain_decision_history:
            await session.runtime.discard_history(result)
        return ChatTurn(session.session_id, self.text, (), result, None, cancelled=True)

    def __aiter__(self) -> ChatStream:
        return self

    async def __anext__(self) -> StreamEvent:
        if self._inner is None or self._left:
            raise ConfigurationError("enter the stream first: async with session.stream(text)")
        event = await self._inner.__anext__()
        invocation_id = getattr(event, "invocation_id", "")
        if invocation_id:
            self._invocations[(invocation_id, getattr(event, "agent", ""))] = None
        return event

    @property
    def turn(self) -> ChatTurn:
        """The :class:`ChatTurn`: once the events were read to the end, or once the
        ``async with`` was left (a turn left before its end has ``status ==
        "cancelled"``). ``ConfigurationError`` before that, or when the turn raised."""
        if self._turn is None:
            raise ConfigurationError(
                "the turn has not finished: read the stream's events to the end "
                "(InvocationFinished)"
            )
        return self._turn


class ChatSession(AsyncClosing):
    """A chat session of one agent for one user (or an anonymous visitor).

    ``runtime`` runs the agent named ``agent``; its ``MemoryConfig`` (the
    defaults when it has none) sets the short-term window, full context and
    key events. ``user_id`` comes from trusted host configuration (None: an
    anonymous or channel session, whose key events belong to the session
    alone). ``session_id`` names the session in ``store`` (None: a new one);
    reusing it continues the session. See the module documentation for
    storage, approvals, preview, extraction and idle time.

    Use ``async with ChatSession(...) as session:`` or call :meth:`close`;
    closing does not end the session (:meth:`end` does).
    """

    def __init__(
        self,
        runtime: Runtime,
        agent: str,
        user_id: str | None = None,
        session_id: str | None = None,
        *,
        store: MemoryStore,
        mode: SessionMode = "live",
        extract_in_background: bool = True,
        idle_seconds: float | None = None,
        queue: ExtractionQueue | None = None,
        retain_decision_history: bool = False,
    ) -> None:
        if not isinstance(runtime, Runtime):
            raise ConfigurationError("ChatSession needs a touba.Runtime")
        definition = runtime.agent(agent)
        if not isinstance(store, MemoryStore):
            raise ConfigurationError(
                "store must be a touba.memory store, e.g. SqliteMemoryStore(filename) or "
                "PostgresMemoryStore(dsn=...)"
            )
        check_mode(mode)
        if session_id is None:
            session_id = str(uuid.uuid4())
        owner = owner_for(user_id, session_id)
        if not isinstance(extract_in_background, bool):
            raise ConfigurationError("extract_in_background must be a bool")
        if not isinstance(retain_decision_history, bool):
            raise ConfigurationError("retain_decision_history must be a bool")
        if idle_seconds is not None and (
            isinstance(idle_seconds, bool)
            or not isinstance(idle_seconds, int | float)
            or not idle_seconds > 0
        ):
            raise ConfigurationError(
                f"idle_seconds must be None or a positive number, got {idle_seconds!r}"
            )
        if queue is not None and (
            not isinstance(queue, ExtractionQueue) or queue.store is not store
        ):
            raise ConfigurationError("queue must be an ExtractionQueue over the same store")
        self.runtime = runtime
        self.agent = definition.name
        self.kind = definition.kind
        self._program_config = definition.memory
        self._instructions = definition.instructions
        self.config = definition.memory if definition.memory is not None else MemoryConfig()
        self._settings = EffectiveMemoryConfig(
            self.config, "program" if definition.memory is not None else "defaults"
        )
        self.user_id = user_id
        self.session_id = session_id
        self.owner = owner
        self.store = store
        self.mode: SessionMode = mode
        self.events = KeyEventService(store, self.config.key_events, read_only=mode == "preview")
        self.queue = queue if queue is not None else ExtractionQueue(store)
        self.extract_in_background = extract_in_background
        self.idle_seconds = idle_seconds
        self.retain_decision_history = retain_decision_history
        self._tools = self._key_event_tools()
        self._lock = asyncio.Lock()
        self._meta: SessionMeta | None = None
        self._ended = False
        self._closed = False
        self._paused: _Paused | None = None
        self._job: ExtractionJob | None = None
        self._extraction: asyncio.Task[ExtractionJob | None] | None = None
        self._extraction_error: BaseException | None = None
        self._stop = asyncio.Event()
        self._idle: asyncio.Task[None] | None = None
        self._last_active = 0.0

    async def _refresh_config(self) -> None:
        """Take the agent's saved settings, if they changed (see the module docstring)."""
        settings = await resolve_memory_settings(self.store, self.agent, self._program_config)
        config = settings.config
        if config == self.config:
            self._settings = settings  # the same settings may have a new source
            return
        events = KeyEventService(self.store, config.key_events, read_only=self.mode == "preview")
        previous = self.config, self.events
        self.config, self.events = config, events
        try:
            self._tools = self._key_event_tools()
        except ConfigurationError:
            self.config, self.events = previous
            raise
        self._settings = settings

    def _key_event_tools(self) -> tuple[InvocationTool, ...]:
        if self.mode == "preview" or self.kind != "loop" or not self.events.active:
            return ()
        taken = sorted(set(TOOL_NAMES) & set(self.runtime.program.capabilities))
        if taken:
            raise ConfigurationError(
                f"the program defines capabilities named {taken}, the key-event tools of agent "
                f"{self.agent!r}; rename them or turn its key events off"
            )
        return tuple(InvocationTool(_offered(s), self._run_tool) for s in self.events.tools())

    # -- state ---------------------------------------------------------------------------

    @property
    def ended(self) -> bool:
        """True once the session has ended (by :meth:`end`, the idle timer, or in the store
        when it was opened): ``send`` then raises ``ConfigurationError``."""
        return self._ended

    @property
    def pending_checkpoint(self) -> str | None:
        """The checkpoint of the turn awaiting approval, if any."""
        return self._paused.checkpoint_id if self._paused is not None else None

    @property
    def extraction_job(self) -> ExtractionJob | None:
        """The extraction job queued by :meth:`end`, as it was queued."""
        return self._job

    async def open(self) -> SessionMeta:
        """Open (create or continue) the session in the store; ``send`` does it as needed."""
        if self._meta is None:
            self._meta = await self.store.open_session(
                self.session_id, owner=self.owner, agent_ref=self.agent, mode=self.mode
            )
            self._ended = self._ended or self._meta.ended_at is not None
            self._touch()
            watch = self.idle_seconds is not None and self._idle is None
            if watch and not self._ended and not self._closed:
                assert self.idle_seconds is not None
                self._idle = asyncio.create_task(self._watch_idle(self.idle_seconds))
        return self._meta

    def _usable(self) -> None:
        if self._closed:
            raise ConfigurationError("this ChatSession is closed; create a new one")
        if self._ended:
            raise ConfigurationError(
                f"chat session {self.session_id!r} has ended; start a new session"
            )
        if self._paused is not None and self._paused.failed:
            raise ConfigurationError(
                f"the last turn of session {self.session_id!r} failed with a retryable error "
                f"after running calls (checkpoint {self._paused.checkpoint_id}); call "
                "session.resume() to retry it first"
            )
        if self._paused is not None:
            raise ConfigurationError(
                f"a turn of session {self.session_id!r} awaits approval (checkpoint "
                f"{self._paused.checkpoint_id}); call session.resume(approvals) first"
            )

    # -- turns ---------------------------------------------------------------------------

    async def send(self, text: str) -> ChatTurn:
        """Run one turn: the agent answers ``text`` with its memory of this session.

        The turn is stored once it completes (or fails after running calls); a turn
        awaiting approval is stored by :meth:`resume`. ``ConfigurationError`` for an
        empty ``text`` or when the session is closed, ended, or holds a turn awaiting
        approval or a retry; the runtime's and the store's errors propagate.
        """
        if not isinstance(text, str) or not text.strip():
            raise ConfigurationError("a chat message must be a non-empty str")
        async with self._lock:
            context, given = await self._prepare()
            try:
                result = await self.runtime.invoke(
                    self.agent, input=text, run_id=self.session_id, context=context
                )
            finally:
                self._touch()
            return await self._conclude(text, result, context, given)

    def stream(self, text: str) -> ChatStream:
        """One turn, as :meth:`send`, streamed: ``async with session.stream(text) as
        stream: async for event in stream`` yields :meth:`~touba.Runtime.stream`'s events
        (``TextDelta``... ``InvocationFinished`` last, once the turn is stored), then
        ``stream.turn`` is the :class:`ChatTurn`.

        Leaving early cancels the turn (see the module docstring: ``stream.turn``
        then has ``status == "cancelled"``, nothing is stored). The same
        ``ConfigurationError`` as ``send``, raised on entering the ``async with``.
        """
        if not isinstance(text, str) or not text.strip():
            raise ConfigurationError("a chat message must be a non-empty str")
        return ChatStream(self, text)

    async def _prepare(self) -> tuple[InvocationContext, dict[str, JSON]]:
        """Under the lock: check the session can take a turn; the turn's context."""
        self._usable()
        await self.open()
        self._usable()
        await self._refresh_config()
        return await self._context()

    async def _streamed_turn(
        self, stream: ChatStream, context: InvocationContext, given: Mapping[str, JSON]
    ) -> InvocationResult:
        """The turn of ``stream``, in the stream's task: invoke, then conclude (shielded)."""
        try:
            stop: asyncio.CancelledError | None = None
            try:
                result = await self.runtime.invoke(
                    self.agent, input=stream.text, run_id=self.session_id, context=context
                )
            except asyncio.CancelledError as stopped:
                # A stop after the invocation's last decision: the runtime finished it
                # (its result, not a cancelled one, went to the stream): store it whole.
                ended = _settled()
                if ended is None or ended.status == "cancelled":
                    raise
                result, stop = ended, stopped
            concluding = asyncio.ensure_future(self._conclude(stream.text, result, context, given))
            try:
                turn = await asyncio.shield(concluding)
            except asyncio.CancelledError:
                stream._turn = await concluding  # too late to cancel: store it whole
                raise
            if stop is not None:
                stream._turn = turn
                raise stop
        except Exception:
            stream._raised = True  # the reader gets the error; there is no turn to give
            raise
        finally:
            self._touch()
        stream._turn = turn
        return turn.result

    async def resume(
        self,
        approvals: Mapping[str, bool] | None = None,
        *,
        checkpoint_id: str | None = None,
        worker_stopped: bool = False,
        actor: str | None = None,
    ) -> ChatTurn:
        """Resume the turn awaiting approval (``approvals``: call id -> True/False).

        ``checkpoint_id`` resumes a turn of this session paused by another
        process; by default, the one this object paused. ``worker_stopped`` and
        ``actor`` are passed to :meth:`~touba.Runtime.resume` (take over a turn
        whose worker crashed and was checked gone; who decided the approvals).
        ``ConfigurationError`` when the session is closed, when no turn (or another
        checkpoint) awaits, or when the session ended meanwhile; the runtime's and
        the store's errors propagate.
        """
        async with self._lock:
            if self._closed:
                raise ConfigurationError("this ChatSession is closed; create a new one")
            paused = self._paused
            if checkpoint_id is None or (paused and paused.checkpoint_id == checkpoint_id):
                if paused is None:
                    raise ConfigurationError(
                        f"no turn of session {self.session_id!r} awaits approval or a retry"
                    )
            else:
                if paused is not None:
                    raise ConfigurationError(
                        f"this session awaits approval on checkpoint {paused.checkpoint_id}, "
                        f"not {checkpoint_id}"
                    )
                await self.open()
                if self._ended:
                    raise ConfigurationError(
                        f"chat session {self.session_id!r} has ended; its paused turn cannot be "
                        "stored. Resume it with runtime.resume if its calls must still run"
                    )
                await self._refresh_config()
                user = await self._paused_user(checkpoint_id)
                context, given = await self._context()
                given["rebuilt_at_resume"] = True  # what the turn started with lived elsewhere
                paused = _Paused(user, checkpoint_id, context, given)
            result = await self.runtime.resume(
                paused.checkpoint_id,
                approvals,
                context=paused.context,
                worker_stopped=worker_stopped,
                actor=actor,
            )
            self._touch()
            return await self._conclude(paused.user, result, paused.context, paused.given)

    async def _paused_user(self, checkpoint_id: str) -> str:
        checkpoint = await self.runtime.checkpoints.get(checkpoint_id)
        if checkpoint is None:
            raise ConfigurationError(
                f"no checkpoint {checkpoint_id!r}: it is unknown or was already resumed"
            )
        user = checkpoint.get("input")
        mine = (checkpoint.get("run_id"), checkpoint.get("agent_ref")) == (
            self.session_id,
            self.agent,
        )
        if not mine or not isinstance(user, str):
            raise ConfigurationError(
                f"checkpoint {checkpoint_id!r} is not a turn of session {self.session_id!r} "
                f"of agent {self.agent!r}"
            )
        return user

    # -- fork and rewind -----------------------------------------------------------------

    async def fork(self, at_turn: int, *, session_id: str | None = None) -> ChatSession:
        """A new chat session holding turns 1 .. ``at_turn`` of this one, each whole
        (its text, replies, tool trace and ``context``), continued from there.

        The copy is made in the store in one transaction
        (``store.fork_session``); this session is not changed, and it may be
        ended or hold a turn awaiting approval (a turn not yet stored is not
        copied). The new session (``session_id``, or a new uuid4) has the same
        runtime, agent, user, mode and settings; its next turn is turn
        ``at_turn + 1`` and sees only the kept turns. Key events are per user and
        not forked: a user's serve both sessions; an anonymous session's fork is
        owned by itself (:mod:`touba.memory._fork`). Not yet opened: use it with
        ``async with`` or close it.

        ``ConfigurationError`` (nothing written) when this object is closed, the
        session was never stored, ``at_turn`` is not an int from 1 to its turn
        count, or ``session_id`` is already used; the store's errors propagate.
        """
        if self._closed:
            raise ConfigurationError("this ChatSession is closed; create a new one")
        meta = await fork_stored_session(self.store, self.session_id, at_turn, session_id)
        logger.info("chat session forked at turn %d", at_turn)
        return ChatSession(
            self.runtime,
            self.agent,
            self.user_id,
            meta.session_id,
            store=self.store,
            mode=self.mode,
            extract_in_background=self.extract_in_background,
            idle_seconds=self.idle_seconds,
            queue=self.queue,
            retain_decision_history=self.retain_decision_history,
        )

    async def rewind(self, to_turn: int) -> int:
        """Keep turns 1 .. ``to_turn`` of this session and delete the later ones, each
        whole, in one store transaction (``store.rewind_session``); return how many
        turns were deleted. The next turn is turn ``to_turn + 1`` and sees only the
        kept turns. Key events (per user) are not rewound.

        Refused with ``ConfigurationError``, nothing changed: while a turn of this
        object runs, while a turn awaits approval or a retry (here, or as a
        checkpoint of this session in the runtime's checkpoint store, when that
        store can list them: resume or discard it first), when the session is
        closed, ended or was never stored, or for a ``to_turn`` that is not an int
        from 0 to its turn count. A turn run by another process that has no
        checkpoint yet cannot be seen: rewind a session only while no one uses it.
        """
        if self._closed:
            raise ConfigurationError("this ChatSession is closed; create a new one")
        if self._lock.locked():
            raise ConfigurationError(
                f"a turn of session {self.session_id!r} is running; rewind once it has ended"
            )
        async with self._lock:
            self._usable()
            await self.open()
            self._usable()
            waiting = await self._checkpoint_of_session()
            if waiting is not None:
                raise ConfigurationError(
                    f"a turn of session {self.session_id!r} is kept at checkpoint {waiting} "
                    "(awaiting approval, a retry or a resume); resume it with "
                    "session.resume(checkpoint_id=...) first. Nothing was changed"
                )
            dropped = await self.store.rewind_session(self.session_id, to_turn=to_turn)
            logger.info("chat session rewound to turn %d (%d turns removed)", to_turn, dropped)
            return dropped

    async def _checkpoint_of_session(self) -> str | None:
        """A checkpoint of a turn of this session in the runtime's store, if it can tell."""
        store: Any = self.runtime.checkpoints
        listing = getattr(store, "list", None)
        if not callable(listing):
            return None
        for info in await listing(run_id=self.session_id):
            if getattr(info, "agent_ref", None) in (None, self.agent):
                return str(info.checkpoint_id)
        return None

    async def _context(self) -> tuple[InvocationContext, dict[str, JSON]]:
        """The turn's invocation context, and the record of what it gives."""
        settings = self._settings
        config = self.config
        stored: tuple[StoredTurn, ...] = ()
        events: list[KeyEvent] = []
        if self.mode != "preview":
            if config.short_term_turns:
                stored = await self.store.recent_turns(self.session_id, config.short_term_turns)
            events = await self.events.open_for_prompt(self.owner)
        block = render_key_events_block(events)
        given = given_context(
            mode=self.mode,
            config=config,
            source=settings.source,
            saved_at=settings.saved_at,
            saved_by=settings.saved_by,
            recent=stored,
            key_events=events,
            agent_instructions=self._instructions,
            injected=block,
        )
        if self.mode == "preview":
            return InvocationContext(session_id=self.session_id, user_id=self.user_id), given
        context = InvocationContext(
            prior_turns=select_prior_turns(
                stored, config.short_term_turns, config.full_context_turns
            ),
            instructions=block,
            tools=self._tools,
            session_id=self.session_id,
            user_id=self.user_id,
        )
        return context, given

    async def _conclude(
        self,
        user: str,
        result: InvocationResult,
        context: InvocationContext,
        given: Mapping[str, JSON],
    ) -> ChatTurn:
        replies = turn_replies(result)
        result = self._explained(result)
        if result.checkpoint_id is not None:  # awaiting approval, or failed and resumable
            failed = result.status == "failed"
            self._paused = _Paused(user, result.checkpoint_id, context, given, failed)
            return ChatTurn(self.session_id, user, replies, result, None)
        self._paused = None
        trace = turn_trace(result.trace, result.invocation_id)
        stored = None
        if result.status == "completed" or trace:
            stored = await self.store.append_turn(
                self.session_id,
                user=user,
                replies=replies,
                trace=trace,
                invocation_id=result.invocation_id,
                context=turn_context(
                    given,
                    result.trace,
                    result.invocation_id,
                    retained=self.retain_decision_history,
                ),
            )
        if not self.retain_decision_history:
            await self.runtime.discard_history(result)
        return ChatTurn(self.session_id, user, replies, result, stored)

    def _explained(self, result: InvocationResult) -> InvocationResult:
        """Say, on a full history store, that chat turns fill it and what to change."""
        error = result.error
        if not isinstance(error, DecisionHistoryLimitExceeded) or error.limit != "max_sessions":
            return result
        held = (
            "while it runs and after it ends (retain_decision_history=True)"
            if self.retain_decision_history
            else "while it runs"
        )
        explained = DecisionHistoryLimitExceeded(
            f"{error.message} Under a ChatSession each turn is an invocation whose decision "
            f"history takes one conversation of agent {self.agent!r}'s history store {held}: "
            "give that store a max_sessions above the turns running at once (and, with "
            "retained history, the turns of a ttl_seconds period), or keep "
            "retain_decision_history=False",
            limit="max_sessions",
        )
        explained.__cause__ = error
        return replace(result, error=explained)

    async def _run_tool(self, call: ToolCall) -> JSON:
        op_id = f"{call.invocation_id}:{call.decision}:{call.call.call_id}"
        try:
            return await self.events.call_tool(
                self.owner, self.session_id, call.call.name, call.call.arguments, op_id=op_id
            )
        except KeyEventInvalid:
            raise
        except MemoryStoreUnavailable as e:
            logger.warning("key-event tool %s failed: %s", call.call.name, e)
            raise MemoryStoreUnavailable(
                "the key-event store is unavailable; nothing was written. Tell the user it "
                "could not be recorded now"
            ) from e

    # -- end, extraction, idle -----------------------------------------------------------

    async def end(self) -> ExtractionJob | None:
        """End the session; for ``kind="agent"``/``"flow"`` (live, key events active,
        at least one turn) queue its extraction job, and run it in the background
        unless ``extract_in_background=False``. Idempotent: returns the same job.
        ``ConfigurationError`` while a turn awaits approval (resume it first)."""
        async with self._lock:
            return await self._end()

    async def _end(self) -> ExtractionJob | None:
        if self._paused is not None:
            raise ConfigurationError(
                f"a turn of session {self.session_id!r} awaits approval; resume it (approvals "
                "may refuse every call) before ending the session"
            )
        await self.open()
        await self._refresh_config()
        meta = await self.store.end_session(self.session_id)
        self._meta, self._ended = meta, True
        self._stop_idle()
        extracted = self.kind in _EXTRACTED_KINDS and self.config.key_events.active
        if self.mode != "live" or not extracted or meta.turns == 0:
            return None
        job = await self.queue.enqueue(
            self.session_id, self.owner, self.agent, f"{self.session_id}@{meta.turns}"
        )
        self._job = job
        start = self.extract_in_background and self._extraction is None and not self._closed
        if start and job.status in ("pending", "running"):
            self._extraction = asyncio.create_task(self._extract(job.id))
        return job

    async def _extract(self, job_id: str) -> ExtractionJob | None:
        """Attempts of one job until done or failed, waiting out the backoff."""
        worker = ExtractionWorker(
            self.runtime.program,
            self.store,
            queue=self.queue,
            worker_id=f"session:{new_worker_id()}",
        )
        try:
            while True:
                await worker.run_job(job_id=job_id)
                job = await self.queue.get(job_id)
                if job is None or job.status in ("done", "failed") or self._stop.is_set():
                    return job
                due = job.next_attempt_at
                if job.status == "running" and job.lease_expires_at is not None:
                    due = job.lease_expires_at  # another worker holds it
                delay = max((due - self.store.now()).total_seconds(), _RETRY_FLOOR_SECONDS)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(delay):
                        await self._stop.wait()
                if self._stop.is_set():
                    return job
        except Exception as e:
            logger.exception("background extraction of job %s stopped", job_id)
            self._extraction_error = e
            return None

    async def wait_extraction(self) -> ExtractionJob | None:
        """Wait for the background extraction (through its retries) and return the job.

        None when no job was queued. Raises what stopped the background task
        (a store failure, say); a failed job is returned, ``status="failed"``.
        """
        if self._extraction is not None:
            job = await self._extraction
            if self._extraction_error is not None:
                raise self._extraction_error
            return job
        return None if self._job is None else await self.queue.get(self._job.id)

    def _touch(self) -> None:
        with contextlib.suppress(RuntimeError):
            self._last_active = asyncio.get_running_loop().time()

    def _stop_idle(self) -> None:
        """Cancel the idle timer (kept, to be awaited by ``close``), unless it is ending us."""
        if self._idle is not None and self._idle is not asyncio.current_task():
            self._idle.cancel()

    async def _watch_idle(self, seconds: float) -> None:
        loop = asyncio.get_running_loop()
        while True:
            delay = self._last_active + seconds - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
                continue
            if self._lock.locked() or self._paused is not None:
                self._touch()  # a turn runs or awaits approval: not idle
                continue
            try:
                async with self._lock:
                    if self._paused is None and not self._ended:
                        await self._end()
            except Exception:
                logger.exception("ending idle session %s failed", self.session_id)
            return

    async def close(self) -> None:
        """Stop the idle timer and background retries; wait for a running attempt.

        Does not end the session. Idempotent.
        """
        self._closed = True
        self._stop.set()
        idle, self._idle = self._idle, None
        if idle is not None:
            idle.cancel()
            await asyncio.wait([idle])
        if self._extraction is not None:
            await self._extraction

    async def _enter(self) -> None:
        await self.open()

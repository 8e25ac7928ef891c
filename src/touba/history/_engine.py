"""The decision-history step: one transaction per model decision.

``DecisionHistory.step`` reserves the conversation, checks the stored record
against the identity and the runtime's observations, appends the results,
selects the window (bounded, complete exchanges only), optionally summarises
what left it, lets the provider generate from that window, then appends the
new decision. It reads only the tail of the conversation it needs and appends
deltas, so the cost of a decision does not grow with retained history.

Capacity is refused before anything is paid (no count request, no summary, no
generation) whenever the refusal is already certain:

- ``max_sessions``: a built-in store refuses to reserve a key without a record
  when all its places are held; the operation never runs.
- ``max_store_bytes``: the reservation reports the store's usage; the step
  refuses when that usage, plus the observations it appends and the smallest
  head it could save, already exceeds the bound.
- ``max_retained_bytes``: the conversation's retained bytes plus the
  observations.

The decision's own message is only known after generation: one that pushes a
bound over is refused when saving, after the model was paid. The save-time
checks stay the atomic guarantee (concurrent writers may fill the store
between reservation and save). A custom store offering only ``transact``
reports no usage, so its own save is its only capacity check.

When the reservation shows the store over 80 % of either limit, a
``history_store_pressure`` event goes out (at most once a minute per store,
see :mod:`touba.history._pressure`). It is emitted before any window exists,
so its ``message_count`` and ``bytes`` are 0.

Each saved decision also adds its figures (sizes, counts, the guard's verdict;
never content) to a bounded ring in the record head, for the memory panel's
plot (:mod:`touba.history._plot`).
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import operator
import time
from collections.abc import Awaitable, Callable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from typing import Any, Final

from touba import _telemetry as telemetry
from touba.errors import (
    ConfigurationError,
    DecisionHistoryBusy,
    DecisionHistoryLimitExceeded,
    DecisionHistoryMismatch,
    DecisionHistorySummaryInvalid,
    ToubaError,
)
from touba.history._config import HistoryConfig, HistoryEvent, SummaryRequest
from touba.history._fork import check_original, fork_appends, plan_fork
from touba.history._identity import ConversationIdentity
from touba.history._integrity import check_decision_json, check_observations, check_window
from touba.history._memory import MemoryHistoryStore
from touba.history._model import (
    CapabilityCall,
    DataMessage,
    DecisionMessage,
    Message,
    Observation,
    ResultMessage,
    SummaryMessage,
    canonical_json,
    message_bytes,
    message_from_dict,
    message_to_dict,
)
from touba.history._plot import PLOT_KEY, DecisionPoint, add_point
from touba.history._pressure import STORE_PRESSURE, under_pressure
from touba.history._record import check_head, new_head, now_iso
from touba.history._store import LogSnapshot, LogWrite, Record, StoreUsage, as_log_store
from touba.history._window import ExchangeSize, select_window

__all__ = ["DecisionHistory", "HistoryWindow", "event_observer", "fingerprint_exchanges"]

logger = logging.getLogger("touba.history")

event_observer: ContextVar[Callable[[HistoryEvent], Any] | None] = ContextVar(
    "touba_history_event_observer", default=None
)
"""Who else hears this task's history events: the runtime sets it around a
decision so that the events land in that invocation's trace."""

PRIVATE_NAMESPACE = "touba.private"

_MESSAGES: Final = operator.attrgetter("messages")
_BYTES: Final = operator.attrgetter("bytes")

_counting: ContextVar[_Step | None] = ContextVar("touba_history_counting", default=None)
"""The step whose context guard is running in this task: it keeps the guard's
last count for the decision's plot point."""


@dataclass(frozen=True, slots=True)
class HistoryWindow:
    """What a provider sends from history for one decision, in order.

    ``summary`` (if any) comes first, then ``exchanges``: complete ones, the
    last holding the current observations. Instructions, catalog and input
    are the provider's to add. ``sizes`` weigh each exchange by SPEC section
    3's measure; ``start`` is the index of the first exchange sent and
    ``retained`` weighs every exchange the conversation retains.
    """

    session_key: str
    summary: SummaryMessage | None
    exchanges: tuple[tuple[Message, ...], ...]
    sizes: tuple[ExchangeSize, ...]
    start: int = 0
    retained: ExchangeSize = field(default_factory=lambda: ExchangeSize(0, 0))

    @property
    def messages(self) -> list[Message]:
        """What the model is sent: the summary (when there is one), then every
        message of the window's exchanges, oldest first."""
        out: list[Message] = [self.summary] if self.summary else []
        for exchange in self.exchanges:
            out.extend(exchange)
        return out

    @property
    def size(self) -> ExchangeSize:
        """What the window weighs: its messages and bytes, the summary included."""
        summary = self.summary_size
        messages = sum(map(_MESSAGES, self.sizes))
        return ExchangeSize(summary.messages + messages, summary.bytes + self.exchanges_bytes)

    @property
    def summary_size(self) -> ExchangeSize:
        """What the summary weighs (nothing without one)."""
        return (
            ExchangeSize(0, 0)
            if self.summary is None
            else ExchangeSize(1, message_bytes(self.summary))
        )

    @property
    def exchanges_bytes(self) -> int:
        """What the exchanges weigh, summary excluded."""
        return sum(map(_BYTES, self.sizes))

    @property
    def droppable(self) -> int:
        """Units the context guard may drop: the summary, then all but the last exchange."""
        return (self.summary is not None) + max(len(self.exchanges) - 1, 0)

    def dropping(self, units: int) -> HistoryWindow:
        """The window less its ``units`` oldest units (see :attr:`droppable`)."""
        if not 0 <= units <= self.droppable:
            raise ValueError(f"cannot drop {units} of {self.droppable} droppable units")
        window = self
        if units and window.summary is not None:
            window = replace(window, summary=None)
            units -= 1
        return replace(
            window,
            exchanges=window.exchanges[units:],
            sizes=window.sizes[units:],
            start=window.start + units,
        )


Generate = Callable[[HistoryWindow], Awaitable[DecisionMessage]]
Fit = Callable[[HistoryWindow], Awaitable[HistoryWindow]]


def fingerprint_exchanges(previous: str | None, exchanges: Sequence[Sequence[Record]]) -> str:
    """Chain a fingerprint over newly covered exchanges' canonical JSON.

    ``sha256(previous || canonical_json(exchanges))``: equal to a plain sha256
    of the canonical JSON for a first summary, and extended without reloading
    older exchanges for each later one.
    """
    digest = hashlib.sha256()
    if previous:
        digest.update(previous.encode("ascii"))
    digest.update(canonical_json([list(ex) for ex in exchanges]).encode("utf-8"))
    return "sha256:" + digest.hexdigest()


def _projected(message: Record) -> dict[str, Any]:
    return {k: v for k, v in message.items() if k not in ("opaque", "provider")}


class DecisionHistory:
    """Runs decisions of one provider against its configured history."""

    def __init__(self, config: HistoryConfig | None) -> None:
        self.config = config or HistoryConfig()
        self.namespace = self.config.namespace or PRIVATE_NAMESPACE
        self.store = self.config.store or MemoryHistoryStore()
        self._log = as_log_store(self.store)

    async def emit(self, event: HistoryEvent) -> None:
        """Deliver ``event`` to ``on_event`` and to the caller's observer, if any."""
        telemetry.history_event(event)
        step = _counting.get()
        if step is not None and event.kind == "provider_context_count":
            step.count_seen(event)
        for callback in (self.config.on_event, event_observer.get()):
            if callback is None:
                continue
            try:
                outcome = callback(event)
                if inspect.isawaitable(outcome):
                    await outcome
            except Exception as e:  # a host callback must not break a decision
                logger.warning("event callback failed for %s: %s", event.kind, type(e).__name__)

    async def discard(self, identity: ConversationIdentity) -> bool:
        """Delete the conversation of ``identity``; False when there was none.

        Built-in stores delete it with ``delete`` (``DecisionHistoryBusy``
        while a decision holds it); a custom adapter through ``transact``.
        """
        key = self._key(identity)
        delete = getattr(self.store, "delete", None)
        if callable(delete):
            return bool(await delete(key))

        async def drop(record: Record | None) -> tuple[Record | None, bool]:
            return None, record is not None

        return await self.store.transact(key, drop)

    async def recover(self, identity: ConversationIdentity) -> tuple[tuple[str, str], ...]:
        """Free a reservation of ``identity`` left by a stopped worker, if any, and
        return the calls its stored conversation awaits results for, as
        ``(call_id, name)``. Only for a caller who knows that worker is gone."""
        key = self._key(identity)
        recover = getattr(self.store, "recover", None)
        if callable(recover):
            await recover(key, worker_stopped=True)

        async def pending(
            snapshot: LogSnapshot | None, usage: StoreUsage | None
        ) -> tuple[LogWrite | None, tuple[tuple[str, str], ...]]:
            if snapshot is None:
                return None, ()
            check_head(snapshot.head, identity, exchange_count=snapshot.exchange_count)
            return None, tuple((p["call_id"], p["name"]) for p in snapshot.head["pending"])

        return await self._log.transact_log(key, pending)

    async def saved_final(
        self, identity: ConversationIdentity, answered: Sequence[str]
    ) -> DecisionMessage | None:
        """The final decision the conversation of ``identity`` saved right after the
        results of exactly the calls ``answered`` (their ids), or, with no
        ``answered``, as its only exchange; None otherwise.

        For a worker's recovery (the runtime's ``resume(..., worker_stopped=True)``):
        a worker stopped after its last decision was saved and before it reported
        it leaves that decision as the conversation's last exchange, no call
        pending, the exchange before ending with the results it was given (or
        none: the invocation's first decision). Nothing is written.
        """
        key = self._key(identity)
        wanted = set(answered)

        async def final(
            snapshot: LogSnapshot | None, usage: StoreUsage | None
        ) -> tuple[LogWrite | None, DecisionMessage | None]:
            if snapshot is None:
                return None, None
            check_head(snapshot.head, identity, exchange_count=snapshot.exchange_count)
            count = snapshot.exchange_count
            if snapshot.head["pending"] or (count < 2 if wanted else count != 1):
                return None, None
            *before, last = await snapshot.exchanges(count - (2 if wanted else 1), count)
            if len(last) != 1 or last[0].get("kind") != "decision":
                return None, None
            decision = message_from_dict(last[0])
            if not isinstance(decision, DecisionMessage) or not decision.final:
                return None, None
            ids = [m.get("call_id") for ex in before for m in ex if m.get("kind") == "result"]
            if len(ids) != len(wanted) or set(ids) != wanted:
                return None, None
            return None, decision

        return await self._log.transact_log(key, final)

    async def fork(self, key: str, new_identity: ConversationIdentity, *, at_exchange: int) -> str:
        """Copy the first ``at_exchange`` exchanges of conversation ``key`` to a new
        conversation of ``new_identity``, in this history's store; return its key.

        The copy ends on a complete exchange (a decision and the result of each of
        its calls), never between a call and its result; it is checked as the
        pre-send window check does, and gets a fresh head (no pending call, no
        plot); the original's summary is kept only when it covers kept exchanges
        alone (:mod:`touba.history._fork`). The original is read once,
        consistently, without a reservation: nothing is written to it. A built-in
        store refuses to read a conversation while a decision holds it
        (:class:`DecisionHistoryBusy`: retry once it is released); a custom
        adapter offering only ``transact`` is read through it, which saves the
        record back unchanged. The new conversation claims its place and is
        saved within the store's bounds, like a first decision.

        Raises :class:`ConfigurationError` when ``key`` holds no conversation, when
        ``at_exchange`` is not an int from 1 to the number of complete exchanges,
        when ``new_identity`` is of another namespace or the conversation of the
        original, or when a conversation of ``new_identity`` already exists;
        :class:`DecisionHistoryRecordInvalid` when the original is not a readable
        decision history of this namespace's kind or its kept exchanges are
        damaged; :class:`DecisionHistoryLimitExceeded` when the copy would exceed
        ``max_retained_bytes``, ``max_sessions`` or ``max_store_bytes`` (nothing
        is written then).
        """
        new_key = self._key(new_identity)
        if not isinstance(key, str) or not key:
            raise ConfigurationError("key must be the session_key of a stored conversation")
        if new_key == key:
            raise ConfigurationError(
                "new_identity names the original conversation; give the copy an identity "
                "of its own (another invocation_id, say)"
            )
        record = await self._read_whole(key)
        if record is None:
            raise ConfigurationError(
                f"there is no conversation {key} in this history's store (it may have "
                "expired or been deleted); nothing was copied"
            )
        original = check_original(key, record)
        if original.namespace != self.namespace:
            raise ConfigurationError(
                f"conversation {key} belongs to another namespace; fork it with a "
                "DecisionHistory of that namespace"
            )
        plan = plan_fork(key, record, new_identity, at_exchange)
        if plan.retained_bytes > self.config.max_retained_bytes:
            raise DecisionHistoryLimitExceeded(
                f"the copy would retain {plan.retained_bytes} bytes, over "
                f"max_retained_bytes={self.config.max_retained_bytes}; nothing was written. "
                "Fork at an earlier exchange or raise max_retained_bytes",
                limit="max_retained_bytes",
            )

        async def create(
            snapshot: LogSnapshot | None, usage: StoreUsage | None
        ) -> tuple[LogWrite | None, None]:
            if snapshot is not None:
                raise ConfigurationError(
                    f"a conversation {new_key} already exists; fork to a new identity, or "
                    "delete that conversation first. Nothing was written"
                )
            return LogWrite(head=plan.head, append=fork_appends(plan), bodies=plan.bodies), None

        await self._log.transact_log(new_key, create)
        logger.info("conversation %s forked at exchange %d into %s", key, at_exchange, new_key)
        return new_key

    async def _read_whole(self, key: str) -> Record | None:
        """The record of ``key``, read without a reservation (built-in stores), or
        through ``transact`` (a custom adapter's only access, which saves it back)."""
        read = getattr(self.store, "read", None)
        if callable(read):
            found: Record | None = await read(key, purge=False)
            return found

        async def same(record: Record | None) -> tuple[Record | None, Record | None]:
            return record, record

        return await self.store.transact(key, same)

    def _key(self, identity: ConversationIdentity) -> str:
        if identity.namespace != self.namespace:
            raise ConfigurationError("identity namespace differs from the history namespace")
        return identity.key

    async def step(
        self,
        identity: ConversationIdentity,
        observations: Sequence[Observation],
        generate: Generate,
        *,
        fit: Fit | None = None,
        data: Sequence[Observation] = (),
    ) -> DecisionMessage:
        """Run one decision; see the module docstring.

        ``fit`` (the provider's context guard) may narrow the bounded window
        before it is announced in events and handed to ``generate``. ``data``
        (results the runtime obtained itself, e.g. a flow's earlier steps)
        opens a new exchange as a data message; it is refused with
        :class:`DecisionHistoryMismatch` while calls await observations.

        Raises :class:`DecisionHistoryLimitExceeded` before ``fit`` or
        ``generate`` is called when the store has no place for a new
        conversation (``max_sessions``), when what this step is sure to write
        cannot fit in the store (``max_store_bytes``) or in the conversation
        (``max_retained_bytes``); after ``generate`` when the decision's own
        bytes push a bound over. Nothing is written in either case.

        Raises :class:`ConfigurationError`, before anything is reserved, when an
        observation is not JSON data (naming the path of the bad value, e.g.
        ``observations[0].result["a"][3]``); :class:`DecisionHistoryRecordInvalid`
        before ``fit`` or ``generate`` when the stored exchanges of the window
        do not pair every call with its result (see
        :mod:`touba.history._integrity`).
        """
        check_observations(observations, data)
        key = self._key(identity)

        async def operation(
            snapshot: LogSnapshot | None, usage: StoreUsage | None
        ) -> tuple[LogWrite, DecisionMessage]:
            if usage is not None:
                await self._report_pressure(key, usage)
            step = _Step(self, identity, key, snapshot, usage)
            return await step.run(observations, generate, fit, data)

        with telemetry.span("touba.history.transaction", {"touba.session_key": key}):
            try:
                return await self._log.transact_log(key, operation)
            except (
                DecisionHistoryLimitExceeded,
                DecisionHistoryBusy,
                DecisionHistoryMismatch,
            ) as e:
                limit = getattr(e, "limit", None)
                logger.info(
                    "conversation %s refused: %s%s", key, e.code, f" ({limit})" if limit else ""
                )
                raise

    async def _report_pressure(self, key: str, usage: StoreUsage) -> None:
        if under_pressure(usage) and STORE_PRESSURE.admit(self.store):
            await self.emit(
                HistoryEvent(
                    kind="history_store_pressure",
                    session_key=key,
                    message_count=0,  # emitted before the window exists
                    bytes=0,
                    used_sessions=usage.sessions,
                    max_sessions=usage.max_sessions,
                    used_bytes=usage.bytes,
                    max_store_bytes=usage.max_store_bytes,
                )
            )


class _Step:
    def __init__(
        self,
        history: DecisionHistory,
        identity: ConversationIdentity,
        key: str,
        snapshot: LogSnapshot | None,
        usage: StoreUsage | None = None,
    ) -> None:
        self.history = history
        self.config = history.config
        self.key = key
        self.snapshot = snapshot
        self.usage = usage
        if snapshot is None:
            self.head = new_head(identity)
            self.count = 0
            self.stored_head_bytes = 0
        else:
            self.head = snapshot.head
            check_head(self.head, identity, exchange_count=snapshot.exchange_count)
            self.count = snapshot.exchange_count
            # The store measures the head as this same compact JSON; a snapshot
            # that read it as text says how long it was (no second encoding).
            stored = getattr(snapshot, "head_bytes", None)
            self.stored_head_bytes = (
                stored
                if isinstance(stored, int)
                else len(canonical_json(self.head).encode("utf-8"))
            )
        self.appends: list[tuple[int, Record]] = []
        self.bodies: list[str] = []  # the compact JSON of each of appends
        self.added = ExchangeSize(0, 0)
        self.summary_event: HistoryEvent | None = None
        self.counts: list[HistoryEvent] = []

    def count_seen(self, event: HistoryEvent) -> None:
        """A context-guard count of this decision (the last one is the verdict)."""
        if event.session_key == self.key:
            self.counts.append(event)

    def _append(self, index: int, message: Message) -> ExchangeSize:
        data = message_to_dict(message)
        body = canonical_json(data)  # measured here, stored as is (LogWrite.bodies)
        # surrogatepass: a lone surrogate is measured, not a crash; stores refuse it typed.
        size = ExchangeSize(1, len(body.encode("utf-8", "surrogatepass")))
        self.appends.append((index, data))
        self.bodies.append(body)
        self.added = self.added + size
        return size

    def _answer(
        self, observations: Sequence[Observation]
    ) -> tuple[ResultMessage | DataMessage, ...]:
        """Append the observations answering the pending calls; return them."""
        pending = self.head["pending"]
        if not pending:
            if not observations:
                return ()
            if self.snapshot is not None:
                raise DecisionHistoryMismatch(
                    "observations were given but the stored conversation has no pending "
                    "call; check that the runtime resumes the right invocation"
                )
            # The calls they answer are not in history (lost after a restart):
            # send them as plain data, never as orphan tool results.
            data = DataMessage(tuple(ResultMessage.from_observation(o) for o in observations))
            self._append(0, data)
            self.count = 1
            return (data,)
        by_id = {o.call_id: o for o in observations}
        expected = [p["call_id"] for p in pending]
        if len(by_id) != len(observations) or set(by_id) != set(expected):
            raise DecisionHistoryMismatch(
                f"the stored conversation awaits results for {len(expected)} call(s) but the "
                f"runtime gave {len(observations)} observation(s) with other call ids; the "
                "record was not modified"
            )
        results = []
        for entry in pending:
            observation = by_id[entry["call_id"]]
            if observation.name != entry["name"]:
                raise DecisionHistoryMismatch(
                    f"observation {entry['call_id']} names capability {observation.name!r} "
                    f"but the stored call was {entry['name']!r}; the record was not modified"
                )
            result = ResultMessage.from_observation(observation)
            self._append(self.count - 1, result)
            results.append(result)
        return tuple(results)

    def _open(
        self, observations: Sequence[Observation], data: Sequence[Observation]
    ) -> tuple[DataMessage]:
        """Start a new exchange with ``data``; only when no call awaits its result."""
        if observations or self.head["pending"]:
            raise DecisionHistoryMismatch(
                "data was given to open a new exchange but the stored conversation awaits "
                "results of its pending calls; answer them first. The record was not modified"
            )
        message = DataMessage(tuple(ResultMessage.from_observation(o) for o in data))
        self._append(self.count, message)
        self.count += 1
        return (message,)

    async def run(
        self,
        observations: Sequence[Observation],
        generate: Generate,
        fit: Fit | None,
        data: Sequence[Observation] = (),
    ) -> tuple[LogWrite, DecisionMessage]:
        resumed_lost = self.snapshot is None and bool(observations)
        current = self._open(observations, data) if data else self._answer(observations)
        current_size = self.added
        self._check_retained()
        self._check_store_room()

        summarizing = self.config.summarize is not None
        summary_state = self.head.get("summary") if summarizing else None
        through = summary_state["through"] if summary_state else 0
        first = max(through, self.count - self.config.max_messages)
        sizes = await self.snapshot.sizes(first) if self.snapshot and first < self.count else []
        if current:
            if len(sizes) == self.count - first and sizes:
                sizes[-1] = sizes[-1] + current_size
            else:  # the exchange holding them is new in this transaction
                sizes.append(current_size)
        reserve = (
            _summary_reserve(self.config.max_summary_bytes) if summarizing else ExchangeSize(0, 0)
        )
        start = first + select_window(
            sizes,
            max_messages=self.config.max_messages,
            max_bytes=self.config.max_bytes,
            reserve=reserve,
        )
        summary: SummaryMessage | None = None
        if summarizing:
            summary, start, first, sizes = await self._summarize(start, through, sizes, first)
        window = await self._window(start, first, sizes, current, summary)
        self._check_window(window)

        if fit is not None:
            counting = _counting.set(self)
            try:
                window = await fit(window)
            finally:
                _counting.reset(counting)
        sent = window.size
        await self._announce(window, sent, resumed_lost)
        decision = await generate(window)
        check_decision_json(decision)
        stored = self._stored(decision)
        self._append(self.count, stored)
        self._check_retained()
        head = dict(self.head)
        stats = head["stats"]
        head["stats"] = {
            "exchanges": self.count + 1,
            "messages": stats["messages"] + self.added.messages,
            "bytes": stats["bytes"] + self.added.bytes,
        }
        head["pending"] = (
            []
            if decision.final
            else [{"call_id": c.call_id, "name": c.name} for c in decision.calls]
        )
        head["updated_at"] = now_iso()
        add_point(head, self._point(head, window, sent))
        return LogWrite(head=head, append=self.appends, bodies=self.bodies), decision

    def _point(self, head: Record, window: HistoryWindow, sent: ExchangeSize) -> DecisionPoint:
        """This decision's figures for the plot (sizes and verdicts only); ``sent``
        is what ``window`` weighs."""
        stats = head["stats"]
        last = self.counts[-1] if self.counts else None
        return DecisionPoint(
            decision=stats["exchanges"],
            at=int(time.time()),
            retained_messages=stats["messages"],
            retained_bytes=stats["bytes"],
            sent_messages=sent.messages,
            sent_bytes=sent.bytes,
            trimmed_exchanges=window.start,
            summary_exchanges=window.summary.covered_exchanges if window.summary else 0,
            new_summary=self.summary_event is not None,
            guard_counts=len(self.counts),
            guard_count=None if last is None else last.count,
            guard_reserve=None if last is None else last.reserve,
            guard_window=None if last is None else last.window,
            guard_fits=None if last is None else last.fits,
        )

    async def _announce(
        self, window: HistoryWindow, size: ExchangeSize, resumed_lost: bool
    ) -> None:
        """Emit the events describing the window about to be sent (``size``: what
        it weighs)."""
        emit = self.history.emit
        # Like every event, each weighs the window being sent, summary included. Each is
        # built whole: a ``dataclasses.replace`` of one base event cost some 10 us a
        # decision here (bench/history_cost.py).
        if self.summary_event is not None:
            await emit(replace(self.summary_event, message_count=size.messages, bytes=size.bytes))
        if window.start > 0:
            summary = window.summary_size
            sent = ExchangeSize(size.messages - summary.messages, size.bytes - summary.bytes)
            await emit(
                HistoryEvent(
                    kind="history_trimmed",
                    session_key=self.key,
                    message_count=size.messages,
                    bytes=size.bytes,
                    removed_exchanges=window.start,
                    removed_messages=window.retained.messages - sent.messages,
                    removed_bytes=window.retained.bytes - sent.bytes,
                )
            )
        if resumed_lost:
            await emit(
                HistoryEvent(
                    kind="resumed_without_messages",
                    session_key=self.key,
                    message_count=size.messages,
                    bytes=size.bytes,
                )
            )
        await emit(
            HistoryEvent(
                kind="history_window",
                session_key=self.key,
                message_count=size.messages,
                bytes=size.bytes,
            )
        )

    def _stored(self, decision: DecisionMessage) -> DecisionMessage:
        """What history keeps of a decision: all of it, or projections only."""
        if self.config.continuity == "inline":
            return decision
        # opaque_refs: the runtime's projections win. Calls keep id and name;
        # their arguments are taken from the projected observations.
        calls = tuple(CapabilityCall(c.call_id, c.name, {}) for c in decision.calls)
        return DecisionMessage(
            text=decision.text, calls=calls, output=decision.output, final=decision.final
        )

    def _check_retained(self) -> None:
        retained = self.head["stats"]["bytes"] + self.added.bytes
        if retained > self.config.max_retained_bytes:
            raise DecisionHistoryLimitExceeded(
                f"this conversation would retain {retained} bytes, over "
                f"max_retained_bytes={self.config.max_retained_bytes}; nothing was written. "
                "End the invocation, delete old conversations or raise max_retained_bytes",
                limit="max_retained_bytes",
            )

    def _check_store_room(self) -> None:
        """Refuse now what the store will refuse at save whatever the model replies.

        The least this step can leave in the store: its usage at reservation,
        less this conversation's stored head, plus the smallest head it could
        save (:func:`_head_floor_bytes`) and the observations it appends.
        """
        usage = self.usage
        if usage is None:
            return
        # The floor is never larger than a stored head (touba writes heads in that
        # same compact JSON): with room for the appends on top of the usage now,
        # there is no need to measure it.
        if self.snapshot is not None and usage.bytes + self.added.bytes <= usage.max_store_bytes:
            return
        floor = (
            usage.bytes - self.stored_head_bytes + _head_floor_bytes(self.head) + self.added.bytes
        )
        if floor > usage.max_store_bytes:
            raise DecisionHistoryLimitExceeded(
                f"this decision would bring the store to at least {floor} bytes, over "
                f"max_store_bytes={usage.max_store_bytes}, before the model's reply is even "
                "counted; it was refused before any model call and nothing was written. "
                "Delete finished conversations or raise max_store_bytes",
                limit="max_store_bytes",
            )

    async def _load(self, start: int, stop: int) -> list[list[Record]]:
        """Stored exchanges ``start`` .. ``stop - 1`` plus this step's appends."""
        stored_stop = min(stop, self.snapshot.exchange_count if self.snapshot else 0)
        loaded = (
            await self.snapshot.exchanges(start, stored_stop)
            if self.snapshot and start < stored_stop
            else []
        )
        for index, message in self.appends:
            if start <= index < stop:
                position = index - start
                while len(loaded) <= position:
                    loaded.append([])
                loaded[position].append(message)
        return loaded

    async def _messages(self, start: int, stop: int) -> tuple[tuple[Message, ...], ...]:
        """The neutral messages of exchanges ``start`` .. ``stop - 1``, this step's
        appends included. A snapshot offering ``messages`` (the RAM store: parsed
        once, frozen, shared: a tuple per exchange) saves parsing what it holds;
        others give dicts."""
        stored = getattr(self.snapshot, "messages", None)
        if stored is None:
            loaded = await self._load(start, stop)
            return tuple(tuple(message_from_dict(m) for m in ex) for ex in loaded)
        assert self.snapshot is not None
        stored_stop = min(stop, self.snapshot.exchange_count)
        window: list[tuple[Message, ...]] = (
            await stored(start, stored_stop) if start < stored_stop else []
        )
        for index, message in self.appends:
            if start <= index < stop:
                while len(window) <= index - start:
                    window.append(())
                window[index - start] = (*window[index - start], message_from_dict(message))
        return tuple(window)

    def _check_window(self, window: HistoryWindow) -> None:
        """Refuse a window a provider would reject (:func:`check_window`).

        A snapshot offering ``well_formed`` (a store that keeps messages between
        decisions: the RAM store, the durable stores' tail cache; a mutable set
        of exchange indices) remembers the stored exchanges that passed,
        unchanged by this step, so that later decisions skip them.
        """
        known = getattr(self.snapshot, "well_formed", None)
        if not isinstance(known, set):
            check_window(self.key, window.start, window.exchanges)
            return
        check_window(self.key, window.start, window.exchanges, known)
        assert self.snapshot is not None
        stored = min(self.snapshot.exchange_count, window.start + len(window.exchanges))
        changed = {index for index, _message in self.appends}
        unchanged = min(stored, *changed) if changed else stored  # appends go at the end
        known.update(range(window.start, unchanged))
        known.update(i for i in range(max(window.start, unchanged), stored) if i not in changed)

    async def _summarize(
        self, start: int, through: int, sizes: list[ExchangeSize], first: int
    ) -> tuple[SummaryMessage | None, int, int, list[ExchangeSize]]:
        """The summary to send and the window's ``start``, ``first`` and ``sizes``.

        A summariser failure refuses the decision, or (``on_summary_failure=
        "trim"``) leaves the summary state as it was and re-selects the window
        as if no summariser were configured (:meth:`_without_summary`).
        """
        config = self.config
        state = self.head.get("summary")
        previous = state["text"] if state else None
        if start > through:
            left = await self._load(through, start)
            request = SummaryRequest(
                previous_summary=previous,
                turns=tuple(tuple(_projected(m) for m in ex) for ex in left),
                max_bytes=config.max_summary_bytes,
            )
            try:
                with telemetry.span(
                    "touba.history.summary",
                    {"touba.session_key": self.key, "touba.summary.new_exchanges": len(left)},
                ):
                    text = await self._summary_text(request)
            except Exception as e:
                if config.on_summary_failure == "trim":
                    return await self._without_summary(e, sizes, first)
                if isinstance(e, ToubaError):
                    raise  # touba's own summariser says what failed, with its code
                # A local refusal keeps its own code: the host callback failed, not the
                # provider, and no provider retry can help (the callback's error is chained;
                # its text stays out of the message, it may hold conversation content).
                raise DecisionHistorySummaryInvalid(
                    f"the summarize callback raised {type(e).__name__}; nothing was written "
                    '(HistoryConfig(on_summary_failure="trim") sends the decision without a '
                    "summary instead)"
                ) from e
            size = len(text.encode("utf-8"))
            fingerprint = fingerprint_exchanges(state["fingerprint"] if state else None, left)
            state = {
                "text": text,
                "through": start,
                "fingerprint": fingerprint,
                "bytes": size,
            }
            self.head["summary"] = state
            self.summary_event = HistoryEvent(  # announced with the window it ends up in
                kind="decision_history_summary",
                session_key=self.key,
                message_count=0,
                bytes=0,
                covered_exchanges=start,
                fingerprint=fingerprint,
                summary_bytes=size,
            )
        if state is None:
            return None, start, first, sizes
        message = SummaryMessage(state["text"], state["through"], state["fingerprint"])
        # JSON escaping can make the message larger than reserved: keep the
        # bounds by leaving more exchanges out (they stay retained).
        budget = ExchangeSize(config.max_messages - 1, config.max_bytes - message_bytes(message))
        window = sizes[start - first :]
        while len(window) > 1 and (
            sum(s.messages for s in window) > budget.messages
            or sum(s.bytes for s in window) > budget.bytes
        ):
            window = window[1:]
            start += 1
        if len(window) == 1 and (
            window[0].messages > budget.messages or window[0].bytes > budget.bytes
        ):
            return None, start, first, sizes  # no room for the summary next to the minimum
        return message, start, first, sizes

    async def _summary_text(self, request: SummaryRequest) -> str:
        """The callback's summary, or DecisionHistorySummaryInvalid (or its own error)."""
        config = self.config
        assert config.summarize is not None
        text: object = config.summarize(request)
        if inspect.isawaitable(text):
            text = await text
        if not isinstance(text, str) or not text.strip():
            raise DecisionHistorySummaryInvalid(
                "the summarize callback must return a non-empty str; nothing was written"
            )
        size = len(text.encode("utf-8"))
        if size > config.max_summary_bytes:
            raise DecisionHistorySummaryInvalid(
                f"the summarize callback returned {size} bytes, over "
                f"max_summary_bytes={config.max_summary_bytes}; nothing was written"
            )
        return text

    async def _without_summary(
        self, error: Exception, sizes: list[ExchangeSize], first: int
    ) -> tuple[None, int, int, list[ExchangeSize]]:
        """``on_summary_failure="trim"``: this decision's window as if no summariser
        were configured (no summary, no room reserved for one, exchanges a previous
        summary covered eligible again); the stored summary state is unchanged."""
        logger.warning(
            "summarize failed (%s); this decision is trimmed without a summary",
            getattr(error, "code", type(error).__name__),
        )
        config = self.config
        plain_first = max(0, self.count - config.max_messages)
        if plain_first < first:  # exchanges before a previous summary's end, all stored
            assert self.snapshot is not None
            older = await self.snapshot.sizes(plain_first)
            sizes = older[: first - plain_first] + sizes
        start = plain_first + select_window(
            sizes, max_messages=config.max_messages, max_bytes=config.max_bytes
        )
        self.summary_event = HistoryEvent(  # announced with the window it ends up in
            kind="decision_history_summary_failed",
            session_key=self.key,
            message_count=0,
            bytes=0,
        )
        return None, start, plain_first, sizes

    async def _window(
        self,
        start: int,
        first: int,
        sizes: list[ExchangeSize],
        current: tuple[ResultMessage | DataMessage, ...],
        summary: SummaryMessage | None,
    ) -> HistoryWindow:
        exchanges = await self._messages(start, self.count)
        stats = self.head["stats"]
        return HistoryWindow(
            session_key=self.key,
            summary=summary,
            exchanges=exchanges,
            sizes=tuple(sizes[start - first :]),
            start=start,
            retained=ExchangeSize(
                stats["messages"] + self.added.messages, stats["bytes"] + self.added.bytes
            ),
        )


def _head_floor_bytes(head: Record) -> int:
    """A lower bound of the bytes of the head a step saves, from its head now.

    A step replaces ``pending``, ``summary``, ``updated_at`` and ``plot`` (any of
    them may shrink: the plot's ring drops its oldest point) and only raises the
    ``stats`` counters; the other fields stay. The head without those fields is
    therefore never larger than the saved one.
    """
    replaced = ("pending", "summary", "updated_at", PLOT_KEY)
    kept = {k: v for k, v in head.items() if k not in replaced}
    return len(canonical_json(kept).encode("utf-8", "surrogatepass"))


def _summary_reserve(max_summary_bytes: int) -> ExchangeSize:
    """Room for one summary message whose text has ``max_summary_bytes`` bytes."""
    envelope = SummaryMessage("", 0, "sha256:" + "0" * 64)
    return ExchangeSize(1, message_bytes(envelope) + max_summary_bytes + 12)

"""``Runtime``: invoke agents and resume them after approval (SPEC section 7).

Misuse (unknown agent, non-JSON input, unknown or already consumed
checkpoint, approvals naming no pending call) raises
:class:`~touba.errors.ConfigurationError`; everything that happens while an
agent runs ends in an :class:`InvocationResult`: ``completed``, ``failed``
(with its typed error) or ``awaiting_approval``.

Approvals. A call of a ``requires_approval`` capability is checked, then not
run: the invocation finishes the decision's other calls and stops with a
checkpoint (see :mod:`touba.runtime._state` for its contents) saved in the
checkpoint store. ``resume(checkpoint_id, approvals={call_id: True})``
consumes it atomically, keeps the invocation identity, runs the approved
calls (checked again against the resuming program: grants, budgets,
arguments), answers refused or missing ones with ``denied`` observations,
and lets the model decide again (``DecisionRequest.resuming``).

Resources. ``resources`` is the binding that stores the program's business
resources (:mod:`touba.runtime._resources`); a
:class:`~touba.runtime.MemoryResourceBinding` by default. Their ``session``
and ``user`` scopes are keyed by the ``session_id`` and ``user_id`` of the
invocation's context, which its checkpoint keeps: a resume given other ids
raises ConfigurationError.

Failures and retries (:mod:`touba.runtime._journal`). A durable checkpoint
store records each batch of calls as started before it runs, and the answers
once obtained. An invocation that fails with a retryable error
(``error.retryable``: a provider or store down, a busy conversation, a full
store) after calls ran ends ``failed`` with a ``checkpoint_id``:
``resume(checkpoint_id)`` continues from the observations obtained, from any
process sharing the store, and runs no call twice. Other failures end it for
good. After a crash, ``store.list(run_id=...)`` shows its ``running``
checkpoint; once the dead worker is checked, ``resume(checkpoint_id,
worker_stopped=True)`` frees its history reservations and answers the calls it
had started with ``error`` observations of unknown outcome; when it had its final
decision saved in history and died before it removed its checkpoint, the resume
completes the invocation from that decision (the model is not asked again).

Cancellation. When the task running ``invoke`` or ``resume`` is cancelled
(a stream whose consumer stopped early, an ``asyncio.timeout``), the runtime
settles the invocation before the ``CancelledError`` goes on: what was
running is answered or put back (:meth:`Invocation.stopped`), the trace ends
with ``decision_cancelled``, and the invocation is saved as a ``cancelled``
checkpoint when a decision was saved or a call ran (or it was itself resumed),
its running journal removed; nothing is kept otherwise. ``stream.result``
reports it as an ``InvocationResult`` of status ``"cancelled"``. These writes
are finished even if the task is cancelled again meanwhile.

Retention. ``retain_finished_history=True`` (the seed's rule) leaves a
finished invocation's conversations in its provider's history store until
they expire or are deleted; False deletes them, its delegates' included, as
soon as it completes or fails for good (never while it awaits approval or
can be resumed). :meth:`Runtime.discard_history` does it for one result.

A delegated sub-invocation that awaits approval stops its parent too: the
parent's checkpoint nests the child's, and ``pending`` lists the child's
calls. ``resume`` resumes the children first (the same ``approvals``
mapping applies to every pending call of the tree, by call id); a child
that completes answers its parent's call with its output, one that pauses
again keeps the parent paused under a new checkpoint.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import replace
from typing import TypeVar

from touba.errors import ConfigurationError, InvocationBusy, ToubaError
from touba.history._model import JSON, Observation, json_problem
from touba.runtime._checkpoints import (
    CheckpointStore,
    MemoryCheckpointStore,
    revision_of,
    status_of,
)
from touba.runtime._context import InvocationContext, check_context
from touba.runtime._invocation import Invocation, Outcome, deny, new_id, observe
from touba.runtime._journal import Journal, JournalLost
from touba.runtime._program import AgentDefinition, Program
from touba.runtime._resources import MemoryResourceBinding, ResourceBinding, check_binding
from touba.runtime._results import InvocationResult
from touba.runtime._state import (
    InvocationState,
    Paused,
    Pending,
    PendingApproval,
    PendingApproved,
    PendingChild,
)
from touba.runtime._stream import InvocationStream, report_result
from touba.runtime._trace import Trace

__all__ = ["Runtime"]

_T = TypeVar("_T")

logger = logging.getLogger("touba.runtime")


class Runtime:
    """Runs a :class:`Program`'s agents; ``checkpoints`` keeps paused invocations.

    Building a Runtime checks the program as a whole (every delegated agent
    is defined, no delegation cycle) and seals it. ``checkpoints`` defaults to
    a :class:`~touba.runtime.MemoryCheckpointStore`; use
    :class:`~touba.runtime.SqliteCheckpointStore` or
    :class:`~touba.runtime.PostgresCheckpointStore` to resume from another
    process and after a crash. ``resources`` stores the business resources;
    it defaults to a :class:`~touba.runtime.MemoryResourceBinding`.
    ``retain_finished_history`` (see the module documentation) keeps finished
    invocations' decision history (True) or deletes it at once (False).
    ``worker_id`` names this worker in the checkpoints it runs (default
    ``host:pid``). The runtime does not close a store or binding it was given.
    """

    def __init__(
        self,
        program: Program,
        checkpoints: CheckpointStore | None = None,
        *,
        resources: ResourceBinding | None = None,
        retain_finished_history: bool = True,
        worker_id: str | None = None,
    ) -> None:
        if not isinstance(program, Program):
            raise ConfigurationError("Runtime needs a touba.Program")
        if checkpoints is None:
            checkpoints = MemoryCheckpointStore()
        elif not all(callable(getattr(checkpoints, m, None)) for m in ("save", "get", "take")):
            raise ConfigurationError(
                "checkpoints must be a checkpoint store (save, get, take), e.g. "
                "touba.runtime.SqliteCheckpointStore(filename=...)"
            )
        if not isinstance(retain_finished_history, bool):
            raise ConfigurationError("retain_finished_history must be True or False")
        if worker_id is not None and (not isinstance(worker_id, str) or not worker_id):
            raise ConfigurationError("worker_id must be a non-empty str, or None")
        program.seal()
        self._program = program
        self._checkpoints = checkpoints
        self._resources = MemoryResourceBinding() if resources is None else check_binding(resources)
        self.retain_finished_history = retain_finished_history
        self.worker_id = worker_id or f"{socket.gethostname()}:{os.getpid()}"

    @property
    def program(self) -> Program:
        """The program it runs (sealed when the runtime was built)."""
        return self._program

    @property
    def checkpoints(self) -> CheckpointStore:
        """Where paused invocations wait."""
        return self._checkpoints

    @property
    def resources(self) -> ResourceBinding:
        """Where the program's business resources are stored."""
        return self._resources

    def agent(self, name: str) -> AgentDefinition:
        """The agent named ``name``; ConfigurationError when the program has none."""
        agent = self._program.agents.get(name)
        if agent is None:
            raise ConfigurationError(
                f"unknown agent {name!r}; define it with program.agent({name!r}, ...)"
            )
        return agent

    def stream(
        self,
        agent: str,
        input: JSON = None,
        *,
        run_id: str | None = None,
        context: InvocationContext | None = None,
    ) -> InvocationStream:
        """``invoke``, streamed: ``async with runtime.stream(...) as stream: async for
        event in stream`` (see :mod:`touba.runtime._stream`); ``stream.result`` at the end
        is what ``invoke`` returns. Leaving early cancels the invocation: ``stream.result``
        is then of status ``"cancelled"``, with a ``checkpoint_id`` to resume when a
        decision was saved or a call ran (see the module documentation)."""
        return InvocationStream(lambda: self.invoke(agent, input, run_id=run_id, context=context))

    def stream_resume(
        self,
        checkpoint_id: str,
        approvals: Mapping[str, bool] | None = None,
        *,
        context: InvocationContext | None = None,
        worker_stopped: bool = False,
        actor: str | None = None,
    ) -> InvocationStream:
        """``resume``, streamed (as :meth:`stream`)."""
        return InvocationStream(
            lambda: self.resume(
                checkpoint_id,
                approvals,
                context=context,
                worker_stopped=worker_stopped,
                actor=actor,
            )
        )

    async def invoke(
        self,
        agent: str,
        input: JSON = None,
        *,
        run_id: str | None = None,
        context: InvocationContext | None = None,
    ) -> InvocationResult:
        """Run ``agent`` on ``input`` (JSON data) under a new invocation_id.

        ``context`` adds earlier chat turns, instructions and tools to this
        invocation only (see :class:`~touba.runtime.InvocationContext`).
        """
        definition = self.agent(agent)
        context = check_context(context, self._program.capabilities)
        problem = json_problem(input, "input")
        if problem is not None:
            raise ConfigurationError(f"input must be JSON data ({problem})")
        if run_id is None:
            run_id = new_id()
        elif not isinstance(run_id, str) or not run_id:
            raise ConfigurationError("run_id must be a non-empty str, or None for a new one")
        state = InvocationState(
            run_id=run_id,
            invocation_id=new_id(),
            agent_ref=definition.name,
            input=input,
            session_id=context.session_id if context is not None else None,
            user_id=context.user_id if context is not None else None,
        )
        invocation = self._root(
            definition,
            state,
            Trace(),
            context,
            Journal(self._checkpoints, worker_id=self.worker_id),
        )
        if context is None:
            invocation.note("invocation_started", input=input)
        else:
            invocation.note(
                "invocation_started",
                input=input,
                prior_turns=len(context.prior_turns),
                tools=list(context.tool_names),
            )
        return await self._drive(invocation, invocation.run, resumed=False)

    def _root(
        self,
        agent: AgentDefinition,
        state: InvocationState,
        trace: Trace,
        context: InvocationContext | None,
        journal: Journal,
    ) -> Invocation:
        invocation = Invocation(self, agent, state, trace, context, journal=journal)
        journal.snapshot = lambda: (invocation.snapshot(), invocation.trace)
        return invocation

    async def resume(
        self,
        checkpoint_id: str,
        approvals: Mapping[str, bool] | None = None,
        *,
        context: InvocationContext | None = None,
        worker_stopped: bool = False,
        actor: str | None = None,
    ) -> InvocationResult:
        """Resume a paused or failed invocation; ``approvals`` maps pending call ids to
        True/False.

        A call awaiting approval that ``approvals`` leaves out is refused. The
        checkpoint is consumed: a second resume of it raises
        ConfigurationError, as does an unknown id; a resume of a checkpoint
        that another worker is running raises :class:`~touba.errors.InvocationBusy`
        (a ConfigurationError) unless ``worker_stopped=True`` says that this
        worker crashed and was checked gone. The checkpoint does not keep an
        invocation's ``context``: pass the one it was invoked with.

        ``actor`` names who decided the approvals (``"operator"`` for the
        memory panel; None: not recorded). It is kept as the ``actor`` field of
        the trace's ``approval_granted`` and ``approval_refused`` entries, and a
        refused call's ``denied`` observation (what the model reads) names it.
        """
        context = check_context(context, self._program.capabilities)
        if actor is not None and (not isinstance(actor, str) or not actor.strip()):
            raise ConfigurationError("actor must be a non-empty str, or None")
        approvals = dict(approvals or {})
        if not all(isinstance(v, bool) for v in approvals.values()):
            raise ConfigurationError("approvals must map call ids to True or False")
        if not isinstance(checkpoint_id, str):
            raise ConfigurationError("checkpoint_id must be a str")
        if not isinstance(worker_stopped, bool):
            raise ConfigurationError("worker_stopped must be True or False")
        stored = await self._checkpoints.get(checkpoint_id)
        if stored is None:
            raise self._gone(checkpoint_id)
        paused = Paused.from_dict(stored)
        for name in paused.agents():
            self.agent(name)
        state = paused.state
        if context is not None and (context.session_id, context.user_id) != (
            state.session_id,
            state.user_id,
        ):
            raise ConfigurationError(
                f"checkpoint {checkpoint_id!r} was made with other session and user ids than "
                "this context's; resume it with the context it was invoked with (or none)"
            )
        awaiting = {c.call_id for c in paused.awaiting()}
        unknown = sorted(set(approvals) - awaiting)
        if unknown:
            raise ConfigurationError(
                f"approvals name calls that are not pending in this checkpoint: {unknown}; "
                f"pending: {sorted(awaiting)}"
            )
        recovering = status_of(stored) == "running"
        if recovering:
            await self._check_running(checkpoint_id, stored, worker_stopped)
            holder = stored.get("holder")
            logger.info(
                "taking over checkpoint %s from stopped worker %r",
                checkpoint_id,
                holder.get("worker_id") if isinstance(holder, dict) else None,
            )
        trace = Trace.from_dicts(stored.get("trace") or [])
        tree = decide_approvals(paused, approvals, trace, actor=actor)
        journal = Journal(
            self._checkpoints,
            worker_id=self.worker_id,
            checkpoint_id=checkpoint_id,
            revision=revision_of(stored),
        )
        agent = self.agent(paused.state.agent_ref)
        invocation = self._root(agent, tree.state, trace, context, journal)
        entered = False

        def current() -> tuple[Paused, Trace]:
            return (invocation.snapshot() if entered else tree), trace

        journal.snapshot = current
        claim = asyncio.ensure_future(journal.claim(tree, trace))
        try:
            claimed = await asyncio.shield(claim)
        except asyncio.CancelledError:  # the claim ends anyway: give the checkpoint back
            if await _unstoppable(claim):
                await _unstoppable(self._settle(self._cancelled(invocation, resumed=True)))
            raise
        if not claimed:
            raise self._gone(checkpoint_id)

        async def go_on() -> Outcome:
            if recovering:
                try:
                    await self._recover_histories(tree, trace, journal)
                except ToubaError as e:
                    return invocation.fail(e)
            nonlocal entered
            entered = True
            return await invocation.resume(tree)

        return await self._drive(invocation, go_on, resumed=True)

    async def _drive(
        self, invocation: Invocation, run: Callable[[], Awaitable[Outcome]], *, resumed: bool
    ) -> InvocationResult:
        """Run the invocation to its result; when its task is cancelled, settle it
        (:meth:`_cancelled`), tell its stream, and let the cancellation go on."""
        try:
            outcome = await invocation.traced(run, resumed=resumed)
        except asyncio.CancelledError:
            await _unstoppable(self._settle(self._cancelled(invocation, resumed=resumed)))
            raise
        return await _unstoppable(self._settle(self._finish(invocation, outcome)))

    @staticmethod
    async def _settle(ending: Awaitable[InvocationResult]) -> InvocationResult:
        result = await ending
        report_result(result)
        return result

    async def _cancelled(self, invocation: Invocation, *, resumed: bool) -> InvocationResult:
        """The end of an invocation whose task was cancelled (a stream stopped early).

        Settles what was running (:meth:`Invocation.stopped`), notes
        ``decision_cancelled`` last, then saves a ``cancelled`` checkpoint when
        a decision was saved or a call ran (in the tree), or the invocation was
        itself resumed from a checkpoint; otherwise (stopped during its first
        decision) removes its journal: nothing was kept, invoke again.
        """
        state, trace, journal = invocation.state, invocation.trace, invocation.journal
        report = invocation.stopped()
        tree = invocation.snapshot()
        keep = resumed or tree.ran_calls() or any(s.decisions for s in tree.invocations())
        invocation.note(
            "decision_cancelled", **report, checkpoint_id=journal.successor if keep else None
        )
        result = InvocationResult(
            status="cancelled",
            run_id=state.run_id,
            invocation_id=state.invocation_id,
            agent_ref=state.agent_ref,
        )
        if keep:
            assert journal.snapshot is not None, "set by _root"
            paused, _ = journal.snapshot()
            try:
                checkpoint_id = await journal.stop("cancelled")
            except ToubaError as e:
                logger.warning(
                    "could not save the checkpoint of cancelled invocation %s (%s); its last "
                    "running checkpoint, if any, stays in the store",
                    state.invocation_id,
                    e.code,
                )
            else:
                logger.info(
                    "invocation %s was cancelled after calls ran; checkpoint %s resumes it",
                    state.invocation_id,
                    checkpoint_id,
                )
                return replace(
                    result,
                    checkpoint_id=checkpoint_id,
                    pending=tuple(paused.awaiting()),
                    trace=trace.copy(),
                )
        else:
            try:
                await journal.finish()
            except ToubaError as e:
                logger.warning(
                    "could not remove the running checkpoint of invocation %s (%s)",
                    state.invocation_id,
                    e.code,
                )
        return replace(result, trace=trace.copy())  # no decision saved: no history to discard

    async def _check_running(
        self, checkpoint_id: str, stored: Mapping[str, JSON], worker_stopped: bool
    ) -> None:
        """Refuse to take over a running checkpoint unless its worker was declared stopped."""
        successor = stored.get("successor")
        if isinstance(successor, str) and await self._checkpoints.get(successor) is not None:
            raise ConfigurationError(
                f"checkpoint {checkpoint_id!r} was superseded by {successor!r} (its worker "
                "saved that one, then stopped before removing this one); resume "
                f"{successor!r} instead"
            )
        if worker_stopped:
            return
        holder = stored.get("holder")
        described = dict(holder) if isinstance(holder, dict) else {}
        raise InvocationBusy(
            f"checkpoint {checkpoint_id!r} is already being resumed or run by worker "
            f"{described.get('worker_id')!r} (pid {described.get('pid')}, host "
            f"{described.get('host')!r}, since {described.get('since')}). Wait for it; if it "
            "crashed, stop and check it, then resume with worker_stopped=True",
            checkpoint_id=checkpoint_id,
            holder=described,
        )

    async def _recover_histories(self, tree: Paused, trace: Trace, journal: Journal) -> None:
        """After a crash: free the tree's history reservations, answer the calls of a
        decision that history kept but the checkpoint never saw start, and take the
        final decision that history kept but the worker never reported
        (:meth:`_recover_final`)."""
        for node in _nodes(tree):
            state = node.state
            recover = getattr(self.agent(state.agent_ref).provider, "recover_history", None)
            if recover is None:
                continue
            pending: tuple[tuple[str, str], ...] = await recover(
                run_id=state.run_id, invocation_id=state.invocation_id, agent_ref=state.agent_ref
            )
            known = {o.call_id for o in state.observations}
            if not node.calls and not pending and (known or not state.decisions):
                await self._recover_final(state, journal)
                continue
            if node.calls or not pending or {call_id for call_id, _ in pending} == known:
                continue
            state.decisions += 1
            message = (
                "not run: the worker stopped after this decision was made and before its calls "
                "started. Nothing was done; call again if it is still needed"
            )
            state.observations = [
                observe(trace, state, Observation(call_id, name, {}, "error", error=message))
                for call_id, name in pending
            ]

    async def _recover_final(self, state: InvocationState, journal: Journal) -> None:
        """Keep in ``journal`` the final decision that the invocation of ``state``
        saved after its observations, if it did: the stopped worker had it saved and
        died before it removed its running checkpoint. The next decision of that
        invocation is then this one (the model is not asked again, and what the
        caller gets is what history holds)."""
        saved = getattr(self.agent(state.agent_ref).provider, "saved_final_decision", None)
        if saved is None:
            return
        decision = await saved(
            run_id=state.run_id,
            invocation_id=state.invocation_id,
            agent_ref=state.agent_ref,
            answered=tuple(o.call_id for o in state.observations),
        )
        if decision is not None:
            journal.recovered[state.invocation_id] = decision

    @staticmethod
    def _gone(checkpoint_id: str) -> ConfigurationError:
        return ConfigurationError(
            f"no checkpoint {checkpoint_id!r} in this runtime's checkpoint store: it is unknown "
            "or was already resumed (a checkpoint is consumed by its first resume)"
        )

    async def _finish(self, invocation: Invocation, outcome: Outcome) -> InvocationResult:
        state, trace, journal = invocation.state, invocation.trace, invocation.journal
        result = InvocationResult(
            status=outcome.status,
            run_id=state.run_id,
            invocation_id=state.invocation_id,
            agent_ref=state.agent_ref,
            output=outcome.output,
            error=outcome.error,
        )
        if outcome.paused is not None:
            checkpoint_id = await journal.stop("awaiting_approval")
            return replace(
                result,
                checkpoint_id=checkpoint_id,
                pending=tuple(outcome.paused.awaiting()),
                trace=trace.copy(),
            )
        error = outcome.error
        if isinstance(error, JournalLost):
            return replace(result, trace=trace.copy())  # another worker owns it now
        if error is not None and error.retryable and invocation.snapshot().ran_calls():
            try:
                checkpoint_id = await journal.stop("failed", error)
            except ToubaError as e:
                logger.warning(
                    "could not save the checkpoint of failed invocation %s (%s); its last "
                    "running checkpoint, if any, stays in the store",
                    state.invocation_id,
                    e.code,
                )
            else:
                logger.info(
                    "invocation %s failed with %s after calls ran; checkpoint %s resumes it",
                    state.invocation_id,
                    error.code,
                    checkpoint_id,
                )
                return replace(result, checkpoint_id=checkpoint_id, trace=trace.copy())
        else:
            try:
                await journal.finish()
            except ToubaError as e:
                logger.warning(
                    "could not remove the running checkpoint of invocation %s (%s)",
                    state.invocation_id,
                    e.code,
                )
            if not self.retain_finished_history:
                await self._discard(trace, state.run_id)
        return replace(result, trace=trace.copy())

    async def discard_history(self, result: InvocationResult) -> int:
        """Delete the decision history of a finished invocation and of its delegates
        from their providers' stores; return how many conversations were deleted.

        Refuses (ConfigurationError) a result that can still be resumed
        (awaiting approval, or failed with a checkpoint). A conversation that
        cannot be deleted now (busy, store down) is left and logged.
        """
        if result.status == "awaiting_approval" or result.checkpoint_id is not None:
            raise ConfigurationError(
                "this invocation can still be resumed; its history is needed until it ends"
            )
        return await self._discard(result.trace, result.run_id)

    async def _discard(self, trace: Trace, run_id: str) -> int:
        deleted = 0
        for invocation_id, agent_ref in _invocations(trace):
            agent = self._program.agents.get(agent_ref)
            discard = getattr(agent.provider, "discard_history", None) if agent else None
            if discard is None:
                continue
            try:
                deleted += bool(
                    await discard(run_id=run_id, invocation_id=invocation_id, agent_ref=agent_ref)
                )
            except ToubaError as e:
                logger.warning(
                    "could not delete the decision history of invocation %s (%s); it stays "
                    "until it expires",
                    invocation_id,
                    e.code,
                )
        return deleted


async def _unstoppable(ending: Awaitable[_T]) -> _T:
    """``await ending`` to its end even if the awaiting task is cancelled meanwhile
    (the cancellation is raised once it ended): a stop never cuts a checkpoint write."""
    task = asyncio.ensure_future(ending)
    cancelled = False
    while True:
        try:
            value = await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.done() and task.cancelled():
                raise
            cancelled = True
            continue
        if cancelled:
            raise asyncio.CancelledError
        return value


def decide_approvals(
    paused: Paused, approvals: Mapping[str, bool], trace: Trace, *, actor: str | None = None
) -> Paused:
    """``paused`` with every call awaiting a reviewer decided: approved calls become
    approved-not-started, the others ``denied`` observations (noted in ``trace``, with
    ``actor`` when given)."""
    state = paused.state
    identity = (state.run_id, state.invocation_id, state.agent_ref)
    by: dict[str, JSON] = {} if actor is None else {"actor": actor}
    done = dict(paused.done)
    pending: list[Pending] = []
    for item in paused.pending:
        call = item.call
        if isinstance(item, PendingChild):
            child = decide_approvals(item.child, approvals, trace, actor=actor)
            pending.append(PendingChild(call, child))
        elif not isinstance(item, PendingApproval):
            pending.append(item)
        elif approvals.get(call.call_id) is True:
            trace.add("approval_granted", *identity, call_id=call.call_id, name=call.name, **by)
            pending.append(PendingApproved(call))
        else:
            given = call.call_id in approvals
            trace.add(
                "approval_refused",
                *identity,
                call_id=call.call_id,
                name=call.name,
                given=given,
                **by,
            )
            if not given:
                why = " (no decision was given)"
            elif actor is not None:
                why = f" (refused by {actor})"
            else:
                why = ""
            done[call.call_id] = deny(
                trace,
                state,
                call,
                "not_approved",
                f"{call.name!r} needs approval and was not approved{why}",
            )
    return replace(paused, done=done, pending=tuple(pending))


def _nodes(tree: Paused) -> Iterator[Paused]:
    yield tree
    for item in tree.pending:
        if isinstance(item, PendingChild):
            yield from _nodes(item.child)


def _invocations(trace: Trace) -> list[tuple[str, str]]:
    """(invocation_id, agent_ref) of every invocation a trace started, once each."""
    seen: dict[tuple[str, str], None] = {}
    for entry in trace.of_kind("invocation_started"):
        seen[(entry.invocation_id, entry.agent_ref)] = None
    return list(seen)

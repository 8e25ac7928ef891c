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

A delegated sub-invocation that awaits approval stops its parent too: the
parent's checkpoint nests the child's, and ``pending`` lists the child's
calls. ``resume`` resumes the children first (the same ``approvals``
mapping applies to every pending call of the tree, by call id); a child
that completes answers its parent's call with its output, one that pauses
again keeps the parent paused under a new checkpoint.
"""

from __future__ import annotations

from collections.abc import Mapping

from touba.errors import ConfigurationError
from touba.history._model import JSON, canonical_json
from touba.runtime._checkpoints import CheckpointStore, MemoryCheckpointStore
from touba.runtime._context import InvocationContext, check_context
from touba.runtime._invocation import Invocation, Outcome, new_id
from touba.runtime._program import AgentDefinition, Program
from touba.runtime._resources import MemoryResourceBinding, ResourceBinding, check_binding
from touba.runtime._results import InvocationResult
from touba.runtime._state import InvocationState, Paused
from touba.runtime._trace import Trace

__all__ = ["Runtime"]


class Runtime:
    """Runs a :class:`Program`'s agents; ``checkpoints`` keeps paused invocations.

    Building a Runtime checks the program as a whole (every delegated agent
    is defined, no delegation cycle) and seals it. ``checkpoints`` defaults to
    a :class:`~touba.runtime.MemoryCheckpointStore`; use
    :class:`~touba.runtime.SqliteCheckpointStore` to resume from another
    process. ``resources`` stores the business resources; it defaults to a
    :class:`~touba.runtime.MemoryResourceBinding` (use
    :class:`~touba.runtime.SqliteResourceBinding` to keep them). The runtime
    does not close a store or binding it was given.
    """

    def __init__(
        self,
        program: Program,
        checkpoints: CheckpointStore | None = None,
        *,
        resources: ResourceBinding | None = None,
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
        program.seal()
        self._program = program
        self._checkpoints = checkpoints
        self._resources = MemoryResourceBinding() if resources is None else check_binding(resources)

    @property
    def program(self) -> Program:
        return self._program

    @property
    def checkpoints(self) -> CheckpointStore:
        return self._checkpoints

    @property
    def resources(self) -> ResourceBinding:
        return self._resources

    def agent(self, name: str) -> AgentDefinition:
        agent = self._program.agents.get(name)
        if agent is None:
            raise ConfigurationError(
                f"unknown agent {name!r}; define it with program.agent({name!r}, ...)"
            )
        return agent

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
        try:
            canonical_json(input)
        except (TypeError, ValueError) as e:
            raise ConfigurationError(f"input must be JSON data ({e})") from e
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
        trace = Trace()
        invocation = Invocation(self, definition, state, trace, context)
        if context is None:
            invocation.note("invocation_started", input=input)
        else:
            invocation.note(
                "invocation_started",
                input=input,
                prior_turns=len(context.prior_turns),
                tools=list(context.tool_names),
            )
        return await self._finish(invocation, await invocation.run())

    async def resume(
        self,
        checkpoint_id: str,
        approvals: Mapping[str, bool] | None = None,
        *,
        context: InvocationContext | None = None,
    ) -> InvocationResult:
        """Resume a paused invocation; ``approvals`` maps pending call ids to True/False.

        A call left out of ``approvals`` is refused. The checkpoint is consumed:
        a second resume of it raises ConfigurationError, as does an unknown id.
        The checkpoint does not keep an invocation's ``context``: pass the one
        it was invoked with.
        """
        context = check_context(context, self._program.capabilities)
        approvals = dict(approvals or {})
        if not all(isinstance(v, bool) for v in approvals.values()):
            raise ConfigurationError("approvals must map call ids to True or False")
        if not isinstance(checkpoint_id, str):
            raise ConfigurationError("checkpoint_id must be a str")
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
        taken = await self._checkpoints.take(checkpoint_id)
        if taken is None:
            raise self._gone(checkpoint_id)
        paused = Paused.from_dict(taken)
        trace = Trace.from_dicts(taken.get("trace") or [])
        agent = self.agent(paused.state.agent_ref)
        invocation = Invocation(self, agent, paused.state, trace, context)
        return await self._finish(invocation, await invocation.resume(paused, approvals))

    @staticmethod
    def _gone(checkpoint_id: str) -> ConfigurationError:
        return ConfigurationError(
            f"no checkpoint {checkpoint_id!r} in this runtime's checkpoint store: it is unknown "
            "or was already resumed (a checkpoint is consumed by its first resume)"
        )

    async def _finish(self, invocation: Invocation, outcome: Outcome) -> InvocationResult:
        state, trace = invocation.state, invocation.trace
        if outcome.paused is None:
            return InvocationResult(
                status=outcome.status,
                run_id=state.run_id,
                invocation_id=state.invocation_id,
                agent_ref=state.agent_ref,
                output=outcome.output,
                error=outcome.error,
                trace=trace.copy(),
            )
        paused = outcome.paused
        checkpoint = paused.to_dict()
        checkpoint["trace"] = trace.to_dicts()
        await self._checkpoints.save(paused.checkpoint_id, checkpoint)
        return InvocationResult(
            status="awaiting_approval",
            checkpoint_id=paused.checkpoint_id,
            run_id=state.run_id,
            invocation_id=state.invocation_id,
            agent_ref=state.agent_ref,
            pending=tuple(paused.awaiting()),
            trace=trace.copy(),
        )

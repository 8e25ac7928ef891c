"""One running invocation: the decision loop, the calls, delegation, resume.

Each decision: ask the provider (with the observations answering the
previous decision), then check every call it makes (see
:mod:`touba.runtime._checks`), ask for approval where required, and run the
accepted calls concurrently. A call that raises becomes an ``error``
observation; a delegated agent runs as a sub-invocation with a new
invocation_id. When some call awaits approval (here or in a sub-invocation)
the invocation stops once the other calls of the decision are done, as a
:class:`~touba.runtime._state.Paused` that the runtime saves as a checkpoint.

A ``kind="flow"`` agent runs its steps instead (:mod:`touba.runtime._flow`):
a capability step is a one-call decision answered by the same path
(:meth:`Invocation._answer`), a model step a decision loop with no catalog.
A capability taking :class:`~touba.runtime.Resources` gets a handle bound to
its call (:mod:`touba.runtime._resources`).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Literal, Protocol

from touba import _telemetry as telemetry
from touba.errors import (
    AgentBudgetExceeded,
    AgentDecisionProviderSchemaViolation,
    AgentDecisionProviderUnavailable,
    FlowStepFailed,
    ToubaError,
)
from touba.history._config import HistoryEvent
from touba.history._engine import event_observer
from touba.history._model import JSON, CapabilityCall, Observation, canonical_json
from touba.providers._base import DecisionProvider
from touba.providers._types import Decision, DecisionRequest
from touba.providers._validate import schema_validator
from touba.runtime._calls import observe_call, run_capability
from touba.runtime._capability import CapabilityDefinition
from touba.runtime._checks import Accepted, Denial, DenialReason, check_call
from touba.runtime._context import InvocationContext, InvocationTool, ToolCall
from touba.runtime._flow import CallStep, ModelStep, Unresolved, step_outputs
from touba.runtime._journal import Journal, JournalLost
from touba.runtime._program import AgentDefinition, Program
from touba.runtime._resources import ResourceAccess, ResourceBinding, Resources, ResourceScope
from touba.runtime._state import (
    InvocationState,
    Paused,
    Pending,
    PendingApproval,
    PendingApproved,
    PendingChild,
    PendingStarted,
    call_to_dict,
)
from touba.runtime._stream import report_note, stream_text
from touba.runtime._trace import Trace

__all__ = ["Invocation", "InvocationHost", "Outcome", "deny", "new_id", "observe"]

logger = logging.getLogger("touba.runtime")


def new_id() -> str:
    return str(uuid.uuid4())


def observe(trace: Trace, state: InvocationState, observation: Observation) -> Observation:
    """Note ``observation`` in ``trace`` for the invocation of ``state``; return it."""
    if observation.status == "ok":
        outcome: dict[str, JSON] = {"result": observation.result}
    else:
        outcome = {"error": observation.error}
    trace.add(
        "observation",
        state.run_id,
        state.invocation_id,
        state.agent_ref,
        call_id=observation.call_id,
        name=observation.name,
        status=observation.status,
        **outcome,
    )
    report_note(
        "observation",
        state.agent_ref,
        state.invocation_id,
        {"call_id": observation.call_id, "name": observation.name, "status": observation.status},
    )
    return observation


def deny(
    trace: Trace, state: InvocationState, call: CapabilityCall, reason: DenialReason, message: str
) -> Observation:
    """Note the refusal of ``call`` and return its ``denied`` observation."""
    identity = (state.run_id, state.invocation_id, state.agent_ref)
    trace.add(
        "denial", *identity, call_id=call.call_id, name=call.name, reason=reason, error=message
    )
    telemetry.current_event(
        "touba.denial",
        {"touba.call_id": call.call_id, "gen_ai.tool.name": call.name, "touba.reason": reason},
    )
    denied = Observation(call.call_id, call.name, dict(call.arguments), "denied", error=message)
    return observe(trace, state, denied)


@dataclass(frozen=True, slots=True)
class Outcome:
    status: Literal["completed", "awaiting_approval", "failed"]
    output: JSON = None
    error: ToubaError | None = None
    paused: Paused | None = None


Answer = Observation | PendingChild


@dataclass(slots=True)
class _Frame:
    """The decision in progress: its calls, the answers so far, the rest.

    ``items`` holds each unanswered call: pending (approval, approved,
    started) or the :class:`Invocation` of a delegate that runs it.
    """

    calls: tuple[CapabilityCall, ...]
    done: dict[str, Observation] = field(default_factory=dict)
    items: dict[str, Pending | Invocation] = field(default_factory=dict)


class InvocationHost(Protocol):
    """What an invocation needs of the runtime it runs under (:class:`~touba.Runtime` is one).

    Stated here, rather than importing the runtime, so that the runtime imports
    this module and not the other way round.
    """

    @property
    def program(self) -> Program:
        """The sealed program whose capabilities and resources the invocation uses."""
        ...

    @property
    def resources(self) -> ResourceBinding:
        """Where the program's business resources are stored."""
        ...

    def agent(self, name: str) -> AgentDefinition:
        """The agent named ``name``; ``ConfigurationError`` when none is."""
        ...


class Invocation:
    """An invocation of ``agent`` running under ``runtime``, writing into ``trace``.

    ``context`` (top-level invocations only) adds prior chat turns, instructions
    and tools: ``agent`` is then the agent as this invocation sees it.
    """

    def __init__(
        self,
        runtime: InvocationHost,
        agent: AgentDefinition,
        state: InvocationState,
        trace: Trace,
        context: InvocationContext | None = None,
        *,
        journal: Journal,
        root: bool = True,
    ) -> None:
        self.runtime = runtime
        self.agent = agent
        self.state = state
        self.trace = trace
        self.journal = journal
        self.root = root
        self.frame: _Frame | None = None
        self.node_id = new_id()
        # What a stop (the task cancelled) must know: see ``stopped``.
        self.deciding = False
        self.deltas = 0
        self.counted: set[str] = set()
        self.running: set[str] = set()
        self.resumed_children: dict[str, Paused] = {}
        self.capabilities: Mapping[str, CapabilityDefinition] = runtime.program.capabilities
        self.tools: dict[str, InvocationTool] = {}
        self.prior_turns = context.prior_turns if context is not None else ()
        if context is not None:
            self._extend(context)

    def _extend(self, context: InvocationContext) -> None:
        agent = self.agent
        self.tools = {t.spec.name: t for t in context.tools}
        definitions = {name: tool.definition() for name, tool in self.tools.items()}
        self.capabilities = {**self.capabilities, **definitions}
        instructions = "\n\n".join(t for t in (agent.instructions, context.instructions) if t)
        self.agent = replace(
            agent,
            instructions=instructions,
            capabilities=(*agent.capabilities, *definitions),
            specs=(*agent.specs, *(d.spec for d in definitions.values())),
        )

    def snapshot(self) -> Paused:
        """This invocation and its running delegates, as a checkpoint tree, now."""
        frame = self.frame
        pending: list[Pending] = []
        if frame is not None:
            for call in frame.calls:
                item = frame.items.get(call.call_id)
                if isinstance(item, Invocation):
                    pending.append(PendingChild(call, item.snapshot()))
                elif item is not None:
                    pending.append(item)
        return Paused(
            checkpoint_id=self.journal.successor if self.root else self.node_id,
            created_at=datetime.now(UTC).isoformat(),
            state=self.state,
            calls=frame.calls if frame is not None else (),
            done=dict(frame.done) if frame is not None else {},
            pending=tuple(pending),
        )

    def note(self, kind: str, **data: JSON) -> None:
        state = self.state
        self.trace.add(kind, state.run_id, state.invocation_id, state.agent_ref, **data)
        report_note(kind, state.agent_ref, state.invocation_id, data)

    # -- the loop ----------------------------------------------------------------------

    async def run(self, *, resuming: bool = False) -> Outcome:
        if self.agent.flow is not None:
            return await self._run_flow(resuming)
        agent, state = self.agent, self.state
        while True:
            if state.decisions >= agent.max_decisions:
                return self._budget_exceeded("")
            request = DecisionRequest(
                run_id=state.run_id,
                invocation_id=state.invocation_id,
                agent_ref=state.agent_ref,
                instructions=agent.instructions,
                input=state.input,
                capabilities=agent.specs,
                output_schema=agent.output_schema,
                observations=tuple(state.observations),
                prior_turns=self.prior_turns,
                resuming=resuming,
            )
            decision = await self._next_decision(request)
            if isinstance(decision, Outcome):
                return decision
            resuming = False
            if not decision.calls:
                return self._complete(decision.output)
            if state.decisions >= agent.max_decisions:
                return self._budget_exceeded("; the calls of its last decision were not run")
            outcome = await self._answer(decision.calls)
            if outcome is not None:
                return outcome

    async def _decide(self, request: DecisionRequest) -> Decision:
        def observe(event: HistoryEvent) -> None:
            fields = event.to_dict()
            self.note("history_event", event=fields.pop("kind"), **fields)

        token = event_observer.set(observe)
        try:
            provider = self.agent.provider
            text = stream_text(self.state.agent_ref, self.state.invocation_id)
            self.deciding, self.deltas = True, 0
            if text is not None and isinstance(provider, DecisionProvider):

                async def sink(delta: object) -> None:
                    self.deltas += 1
                    await text(delta)

                decision = await provider.decide(request, sink=sink)
            else:
                decision = await provider.decide(request)
        except asyncio.CancelledError:
            raise  # stopped while deciding: ``deciding`` stays True for ``stopped``
        except ToubaError:
            self.deciding = False
            raise
        except Exception as e:
            self.deciding = False
            raise AgentDecisionProviderUnavailable(
                f"the provider of agent {self.agent.name!r} raised {type(e).__name__}; no "
                "decision was received"
            ) from e
        finally:
            event_observer.reset(token)
        self.deciding = False
        if not isinstance(decision, Decision):
            raise AgentDecisionProviderSchemaViolation(
                "the provider returned something other than a touba Decision",
                provider_error_code="not_a_decision",
            )
        ids = [c.call_id for c in decision.calls]
        if len(set(ids)) != len(ids):
            raise AgentDecisionProviderSchemaViolation(
                "the decision repeats a call id", provider_error_code="duplicate_call_id"
            )
        return decision

    async def _next_decision(self, request: DecisionRequest) -> Decision | Outcome:
        """The provider's next decision, counted and traced; the invocation's failed
        outcome when the provider raises a typed error (traced as ``provider_error``).

        After a crash, the final decision history kept for this invocation and its
        stopped worker never reported (``journal.recovered``) is taken instead of
        asking the provider: ``decision_recovered`` in the trace."""
        decision = self.journal.recovered.pop(self.state.invocation_id, None)
        if decision is not None:
            self.note("decision_recovered", number=self.state.decisions + 1)
        else:
            try:
                decision = await self._decide(request)
            except ToubaError as e:
                self._note_error("provider_error", e)
                return self.fail(e)
        self.state.decisions += 1
        self._note_decision(decision)
        return decision

    def _note_decision(self, decision: Decision) -> None:
        self.note(
            "decision",
            number=self.state.decisions,
            calls=[call_to_dict(c) for c in decision.calls],
            final=not decision.calls,
            output=decision.output,
            text=decision.text,
            input_tokens=decision.usage.input_tokens,
            output_tokens=decision.usage.output_tokens,
        )

    def _complete(self, output: JSON) -> Outcome:
        error = self._mismatch(self.agent.output_schema, output, "the agent's output_schema")
        if error is not None:
            self._note_error("provider_error", error)
            return self.fail(error)
        self.note("invocation_completed", output=output)
        return Outcome("completed", output=output)

    @staticmethod
    def _mismatch(
        schema: Mapping[str, JSON] | None, output: JSON, what: str
    ) -> AgentDecisionProviderSchemaViolation | None:
        if schema is None:
            return None
        errors = sorted(schema_validator(schema, "output_schema").iter_errors(output), key=str)
        if not errors:
            return None
        return AgentDecisionProviderSchemaViolation(
            f"the final output does not match {what}",
            provider_error_code="output_schema_mismatch",
        )

    def _note_error(self, kind: str, error: ToubaError) -> None:
        self.note(
            kind,
            error_code=error.code,
            error=error.message,
            provider_error_code=getattr(error, "provider_error_code", None),
        )

    def fail(self, error: ToubaError) -> Outcome:
        self._note_error("invocation_failed", error)
        return Outcome("failed", error=error)

    def _budget_exceeded(self, detail: str) -> Outcome:
        limit = self.agent.max_decisions
        return self.fail(
            AgentBudgetExceeded(
                f"agent {self.agent.name!r} made its max_decisions={limit} decision(s) without a "
                f"final output{detail}. Raise max_decisions or simplify the task",
                max_decisions=limit,
            )
        )

    # -- one decision's calls ----------------------------------------------------------

    def _deny(self, call: CapabilityCall, reason: DenialReason, message: str) -> Observation:
        return deny(self.trace, self.state, call, reason, message)

    def _observe(self, observation: Observation) -> Observation:
        return observe(self.trace, self.state, observation)

    def _check(self, call: CapabilityCall, used: Mapping[str, int]) -> Accepted | Denial:
        return check_call(self.capabilities, self.agent, call, used)

    async def _answer(self, calls: Sequence[CapabilityCall]) -> Outcome | None:
        """Check and run a new decision's calls; an Outcome if the invocation stops."""
        frame = _Frame(tuple(calls))
        self.frame = frame
        accepted: list[tuple[CapabilityCall, Accepted]] = []
        tentative = dict(self.state.calls_used)  # approvals reserve within this decision
        for call in calls:
            checked = self._check(call, tentative)
            if isinstance(checked, Denial):
                frame.done[call.call_id] = self._deny(call, checked.reason, checked.message)
                continue
            tentative[call.name] = tentative.get(call.name, 0) + 1
            if checked.capability.requires_approval:
                self.note(
                    "approval_requested",
                    call_id=call.call_id,
                    name=call.name,
                    arguments=dict(call.arguments),
                )
                telemetry.current_event(
                    "touba.approval_requested",
                    {"touba.call_id": call.call_id, "gen_ai.tool.name": call.name},
                )
                frame.items[call.call_id] = PendingApproval(call)
                continue
            accepted.append((call, checked))
        return await self._run_batch(frame, accepted)

    async def _run_batch(
        self,
        frame: _Frame,
        accepted: Sequence[tuple[CapabilityCall, Accepted]],
        children: Sequence[tuple[CapabilityCall, Paused]] = (),
    ) -> Outcome | None:
        """Record ``accepted`` as started, run them and ``children`` concurrently, settle.

        Nothing starts unless the journal recorded it (see
        :mod:`touba.runtime._journal`); when that write fails the calls stay
        approved-not-started and the invocation fails with the store's error.
        """
        resumed = [self._child(call, paused.state) for call, paused in children]
        self.counted, self.running = set(), set()
        self.resumed_children = {call.call_id: paused for call, paused in children}
        for call, checked in accepted:
            delegate = checked.capability.delegate
            if delegate is None:
                frame.items[call.call_id] = PendingStarted(call)
            else:  # journaled with its own state from the start
                self._child(call, self._child_state(call, delegate))
        if accepted or children:
            try:
                await self.journal.sync()
            except ToubaError as e:
                for call, _ in accepted:  # nothing started
                    frame.items[call.call_id] = PendingApproved(call)
                for (call, paused), _ in zip(children, resumed, strict=True):
                    frame.items[call.call_id] = PendingChild(call, paused)
                return self.fail(e)
        jobs = [(call, self._start(call, checked)) for call, checked in accepted]
        jobs += [
            (call, self._resume_child(call, invocation, paused))
            for (call, paused), invocation in zip(children, resumed, strict=True)
        ]
        async with asyncio.TaskGroup() as group:
            for call, job in jobs:
                group.create_task(self._settle_one(frame, call, job))
        return await self._settled(frame)

    async def _settle_one(
        self, frame: _Frame, call: CapabilityCall, job: Awaitable[Answer]
    ) -> None:
        self.running.add(call.call_id)  # from here on, its effect may happen
        answer = await job
        if isinstance(answer, PendingChild):
            frame.items[answer.call.call_id] = answer
        else:
            frame.done[answer.call_id] = answer
            del frame.items[answer.call_id]

    async def _settled(self, frame: _Frame) -> Outcome | None:
        """Pause if anything is pending, else queue the answers for the next decision."""
        if frame.items:
            paused = self.snapshot()
            self.note(
                "awaiting_approval",
                checkpoint_id=paused.checkpoint_id,
                pending=[call_to_dict(c) for c in paused.awaiting()],
            )
            return Outcome("awaiting_approval", paused=paused)
        self.state.observations = [frame.done[c.call_id] for c in frame.calls]
        self.frame = None
        try:
            await self.journal.sync()  # the answers are kept even if the next decision fails
        except JournalLost as e:
            return self.fail(e)
        except ToubaError as e:  # still in memory: the invocation goes on
            logger.warning("could not record the answers of a decision: %s", e.code)
        return None

    def _start(self, call: CapabilityCall, accepted: Accepted) -> Awaitable[Answer]:
        used = self.state.calls_used
        used[call.name] = used.get(call.name, 0) + 1
        self.counted.add(call.call_id)
        self.note("call", call_id=call.call_id, name=call.name, arguments=dict(call.arguments))
        if accepted.capability.delegate is not None:
            return _traced_call(call, self._delegate(call, accepted.capability))
        tool = self.tools.get(call.name)
        if tool is not None:
            return _traced_call(call, self._run_tool(call, tool))
        return _traced_call(call, self._execute(call, accepted))

    async def traced(self, run: Callable[[], Awaitable[Outcome]], *, resumed: bool) -> Outcome:
        """``run()`` inside this invocation's ``invoke_agent`` span."""
        state = self.state
        attributes: dict[str, object] = {
            "gen_ai.operation.name": "invoke_agent",
            "gen_ai.agent.name": state.agent_ref,
            "gen_ai.conversation.id": state.run_id,
            "touba.invocation_id": state.invocation_id,
            "touba.resumed": resumed,
        }
        with telemetry.span(f"invoke_agent {state.agent_ref}", attributes) as span:
            try:
                outcome = await run()
            except asyncio.CancelledError:  # stopped: settled by the runtime
                telemetry.set_attributes(span, {"touba.status": "cancelled"})
                raise
            ended: dict[str, object] = {"touba.status": outcome.status}
            if outcome.error is not None:
                ended["touba.error_code"] = outcome.error.code
            telemetry.set_attributes(span, ended)
            return outcome

    async def _execute(self, call: CapabilityCall, accepted: Accepted) -> Observation:
        parameter = accepted.capability.parameters.resources
        if parameter is not None:
            handle = Resources(self._resource_access(call, accepted.capability))
            accepted = replace(accepted, kwargs={**accepted.kwargs, parameter: handle})
        return self._observe(await run_capability(call, accepted))

    def _resource_access(
        self, call: CapabilityCall, capability: CapabilityDefinition
    ) -> ResourceAccess:
        """What this call's resource operations are checked against and keyed by."""
        state = self.state
        keys: dict[ResourceScope, str | None] = {
            "run": state.run_id,
            "session": state.session_id,
            "user": state.user_id,
            "agent": state.agent_ref,
        }
        return ResourceAccess(
            definitions=self.runtime.program.resources,
            binding=self.runtime.resources,
            agent=self.agent.name,
            grants=self.agent.grants,
            capability=capability.name,
            declared=frozenset(capability.permissions),
            scope_keys=keys,
            call_id=call.call_id,
            note=self.note,
        )

    async def _run_tool(self, call: CapabilityCall, tool: InvocationTool) -> Observation:
        state = self.state
        info = ToolCall(state.run_id, state.invocation_id, state.agent_ref, state.decisions, call)
        return self._observe(await observe_call(call, lambda: tool.handler(info)))

    # -- delegation --------------------------------------------------------------------

    def _child(self, call: CapabilityCall, state: InvocationState) -> Invocation:
        """The invocation of a delegate answering ``call``, known to this frame at once."""
        agent = self.runtime.agent(state.agent_ref)
        child = Invocation(self.runtime, agent, state, self.trace, journal=self.journal, root=False)
        assert self.frame is not None
        self.frame.items[call.call_id] = child
        return child

    def _child_state(self, call: CapabilityCall, agent: str) -> InvocationState:
        return InvocationState(
            run_id=self.state.run_id,
            invocation_id=new_id(),
            agent_ref=agent,
            input=call.arguments["input"],
            session_id=self.state.session_id,
            user_id=self.state.user_id,
        )

    async def _delegate(self, call: CapabilityCall, capability: CapabilityDefinition) -> Answer:
        assert self.frame is not None
        child = self.frame.items[call.call_id]
        assert isinstance(child, Invocation), "_run_batch creates the delegate's invocation"
        state = child.state
        self.note(
            "sub_invocation_started",
            call_id=call.call_id,
            child_invocation_id=state.invocation_id,
            child_agent_ref=state.agent_ref,
        )
        child.note(
            "invocation_started", input=state.input, parent_invocation_id=self.state.invocation_id
        )
        return self._child_answer(call, child, await child.traced(child.run, resumed=False))

    def _child_answer(self, call: CapabilityCall, child: Invocation, outcome: Outcome) -> Answer:
        self.note(
            "sub_invocation_finished",
            call_id=call.call_id,
            child_invocation_id=child.state.invocation_id,
            child_agent_ref=child.agent.name,
            status=outcome.status,
        )
        arguments = dict(call.arguments)
        if outcome.paused is not None:
            return PendingChild(call, outcome.paused)
        if outcome.status == "completed":
            return self._observe(
                Observation(call.call_id, call.name, arguments, "ok", result=outcome.output)
            )
        assert outcome.error is not None
        message = f"the delegated agent {child.agent.name!r} failed: {outcome.error.code}: " + (
            outcome.error.message
        )
        return self._observe(
            Observation(call.call_id, call.name, arguments, "error", error=message)
        )

    # -- flows -------------------------------------------------------------------------

    async def _run_flow(self, resuming: bool) -> Outcome:
        """Run the flow's steps from the first unfinished one (see ``touba.runtime._flow``)."""
        flow, state = self.agent.flow, self.state
        assert flow is not None
        step = flow.steps[len(state.flow_results)] if resuming else None
        if isinstance(step, CallStep):  # the paused capability step: its call is answered now
            (observation,) = state.observations
            failed = self._finish_call_step(step, observation)
            if failed is not None:
                return failed
        while len(state.flow_results) < len(flow.steps):
            index = len(state.flow_results)
            step = flow.steps[index]
            if isinstance(step, CallStep):
                outcome = await self._call_step(index, step)
            else:
                outcome = await self._model_step(index, step, resuming)
                resuming = False
            if outcome is not None:
                return outcome
        outputs = step_outputs(flow.steps, state.flow_results)
        try:
            output = flow.result(state.input, outputs)
        except Unresolved as e:
            problem = f"{e}; fix the flow's output reference"
        else:
            if self._mismatch(self.agent.output_schema, output, "its output_schema") is None:
                return self._complete(output)
            problem = "it does not match the agent's output_schema"
        return self.fail(
            FlowStepFailed(f"the output of flow {self.agent.name!r}: {problem}", step="output")
        )

    async def _call_step(self, index: int, step: CallStep) -> Outcome | None:
        flow, state = self.agent.flow, self.state
        assert flow is not None
        call_id = f"flow-{index + 1}-{uuid.uuid4().hex[:12]}"
        try:
            arguments = flow.resolve_arguments(
                index, state.input, step_outputs(flow.steps, state.flow_results)
            )
        except Unresolved as e:
            self.note("flow_step_started", step=step.name, index=index, type="call", calls=[])
            message = f"the arguments of step {step.name!r}: {e}"
            return self._finish_call_step(
                step, Observation(call_id, step.capability, {}, "error", error=message)
            )
        call = CapabilityCall(call_id, step.capability, arguments)
        started = {"step": step.name, "index": index, "type": "call"}
        self.note("flow_step_started", **started, calls=[call_to_dict(call)])
        outcome = await self._answer((call,))
        if outcome is not None:
            return outcome  # awaiting approval: resumed by _run_flow
        (observation,) = state.observations
        return self._finish_call_step(step, observation)

    def _finish_call_step(self, step: CallStep, observation: Observation) -> Outcome | None:
        state = self.state
        index = len(state.flow_results)
        state.observations = []
        state.flow_results.append(observation)
        ok = observation.status == "ok"
        details: dict[str, JSON] = {} if ok else {"error": observation.error}
        self.note(
            "flow_step_finished",
            step=step.name,
            index=index,
            status=observation.status,
            output=observation.result if ok else None,
            **details,
        )
        if ok or step.on_error == "continue":
            return None
        return self.fail(
            FlowStepFailed(
                f"step {step.name!r} of flow {self.agent.name!r} did not complete: its call of "
                f"{step.capability!r} ended {observation.status!r} ({observation.error}). Fix "
                "the cause, or mark the step on_error='continue'",
                step=step.name,
            )
        )

    async def _model_step(self, index: int, step: ModelStep, resuming: bool) -> Outcome | None:
        agent, state = self.agent, self.state
        self.note("flow_step_started", step=step.name, index=index, type="model")
        instructions = "\n\n".join(t for t in (agent.instructions, step.instructions) if t)
        # The step's own denials wait in the state (kept by a checkpoint); the
        # earlier steps' results open the step's first decision only.
        observations = tuple(state.observations)
        data: tuple[Observation, ...] = () if observations else tuple(state.flow_results)
        while True:
            if state.decisions >= agent.max_decisions:
                return self._budget_exceeded(f" in model step {step.name!r}")
            request = DecisionRequest(
                run_id=state.run_id,
                invocation_id=state.invocation_id,
                agent_ref=state.agent_ref,
                instructions=instructions,
                input=state.input,
                output_schema=step.output_schema,
                observations=observations,
                data=data,
                prior_turns=self.prior_turns,
                resuming=resuming,
            )
            decision = await self._next_decision(request)
            if isinstance(decision, Outcome):
                return decision
            data, resuming = (), False
            if not decision.calls:
                break
            message = (
                f"step {step.name!r} of flow {agent.name!r} asks the model for its output; "
                "it may not call capabilities. Answer with the step's output"
            )
            observations = tuple(
                self._deny(c, "calls_not_allowed", message) for c in decision.calls
            )
            state.observations = list(observations)
        state.observations = []
        output = decision.output
        error = self._mismatch(step.output_schema, output, f"the output_schema of {step.name!r}")
        if error is not None:
            self._note_error("provider_error", error)
            return self.fail(error)
        state.flow_results.append(
            Observation(f"flow:{step.name}", step.name, {}, "ok", result=output)
        )
        self.note("flow_step_finished", step=step.name, index=index, status="ok", output=output)
        return None

    # -- a stop ------------------------------------------------------------------------

    def stopped(self) -> dict[str, JSON]:
        """Settle this invocation (and its delegates) after its task was cancelled.

        What it was doing is answered so that a resume runs nothing twice: a
        call that had begun running is answered with an ``error`` observation
        (its effect is unknown; it is not run again); a call recorded but not
        begun goes back to approved-not-started (it runs once on resume); a
        delegate that had begun is settled the same way, inside. Notes each
        delegate's ``decision_cancelled``; returns this invocation's fields
        of that entry (the caller notes it, with its checkpoint id).
        """
        state, frame = self.state, self.frame
        stage = "deciding" if self.deciding else "calls" if frame is not None else "between"
        report: dict[str, JSON] = {
            "number": state.decisions + 1 if self.deciding else state.decisions,
            "stage": stage,
            "deltas": self.deltas if self.deciding else 0,
        }
        if frame is None:
            return report
        interrupted = not_started = 0
        for call in frame.calls:
            call_id = call.call_id
            item = frame.items.get(call_id)
            if item is None or not isinstance(item, PendingStarted | Invocation):
                continue
            if call_id in self.running and isinstance(item, Invocation):
                item.note("decision_cancelled", **item.stopped())
            elif call_id in self.running:
                interrupted += 1
                frame.done[call_id] = self._interrupted(call)
                del frame.items[call_id]
            else:
                not_started += 1
                if call_id in self.resumed_children:
                    frame.items[call_id] = PendingChild(call, self.resumed_children[call_id])
                    continue
                frame.items[call_id] = PendingApproved(call)
                if call_id in self.counted:
                    self.counted.discard(call_id)
                    state.calls_used[call.name] -= 1
                    if not state.calls_used[call.name]:
                        del state.calls_used[call.name]
        report.update(
            calls=len(frame.calls),
            answered=len(frame.done) - interrupted,
            interrupted=interrupted,
            not_started=not_started,
        )
        return report

    def _interrupted(self, call: CapabilityCall) -> Observation:
        """The answer to a call whose invocation was cancelled while it ran."""
        message = (
            f"this call of {call.name!r} was interrupted: the invocation was stopped while it "
            "ran, so its effect is unknown. It was not run again; check its effect before "
            "calling it again"
        )
        return self._observe(
            Observation(call.call_id, call.name, dict(call.arguments), "error", error=message)
        )

    # -- resume ------------------------------------------------------------------------

    async def resume(self, paused: Paused) -> Outcome:
        """Go on from a checkpoint whose approvals were applied (see ``Runtime.resume``).

        Between two decisions, decide again with the saved observations;
        otherwise run the approved calls (checked again), resume the
        delegates, and settle the decision.
        """
        self.note("invocation_resumed", checkpoint_id=paused.checkpoint_id)
        if not paused.calls:
            return await self.run(resuming=True)
        frame = _Frame(paused.calls, dict(paused.done))
        self.frame = frame
        accepted: list[tuple[CapabilityCall, Accepted]] = []
        children: list[tuple[CapabilityCall, Paused]] = []
        tentative = dict(self.state.calls_used)
        for item in paused.pending:
            call = item.call
            if isinstance(item, PendingChild):
                children.append((call, item.child))
            elif isinstance(item, PendingApproved):
                checked = self._check(call, tentative)
                if isinstance(checked, Denial):
                    frame.done[call.call_id] = self._deny(call, checked.reason, checked.message)
                else:
                    tentative[call.name] = tentative.get(call.name, 0) + 1
                    accepted.append((call, checked))
            elif isinstance(item, PendingStarted):
                frame.done[call.call_id] = self._unknown(call)
            else:
                frame.items[call.call_id] = item  # still awaiting its reviewer
        outcome = await self._run_batch(frame, accepted, children)
        if outcome is not None:
            return outcome
        return await self.run(resuming=True)

    def _unknown(self, call: CapabilityCall) -> Observation:
        """The answer to a call that started in a worker that stopped before reporting."""
        self.note("call_outcome_unknown", call_id=call.call_id, name=call.name)
        message = (
            f"the outcome of this call of {call.name!r} is unknown: the worker running it "
            "stopped before reporting. It was not run again; check its effect before "
            "calling it again"
        )
        return self._observe(
            Observation(call.call_id, call.name, dict(call.arguments), "error", error=message)
        )

    async def _resume_child(
        self, call: CapabilityCall, child: Invocation, paused: Paused
    ) -> Answer:
        outcome = await child.traced(lambda: child.resume(paused), resumed=True)
        return self._child_answer(call, child, outcome)


async def _traced_call(call: CapabilityCall, job: Awaitable[Answer]) -> Answer:
    """``job`` (one call) inside its ``execute_tool`` span."""
    attributes: dict[str, object] = {
        "gen_ai.operation.name": "execute_tool",
        "gen_ai.tool.name": call.name,
        "gen_ai.tool.call.id": call.call_id,
    }
    content = telemetry.capture_content()
    if content:
        attributes["gen_ai.tool.call.arguments"] = canonical_json(dict(call.arguments))
    with telemetry.span(f"execute_tool {call.name}", attributes) as span:
        answer = await job
        if isinstance(answer, PendingChild):
            telemetry.set_attributes(span, {"touba.call.status": "awaiting_approval"})
            return answer
        ended: dict[str, object] = {"touba.call.status": answer.status}
        if content:
            ended["gen_ai.tool.call.result"] = canonical_json(
                answer.result if answer.status == "ok" else answer.error
            )
        telemetry.set_attributes(span, ended)
        return answer

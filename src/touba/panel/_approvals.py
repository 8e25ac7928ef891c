"""The approvals pages: invocations waiting for a reviewer, approved or denied by the operator.

- ``GET /approvals`` lists what waits in the runtime's checkpoint store (see
  :mod:`touba.panel._waiting`): agent, user, the pending calls with their
  arguments, since when, the checkpoint id.
- ``GET /approval?id=...`` shows one checkpoint with a choice per pending
  call (approve or deny) and a confirmation box; ``POST /approval/decide``
  resumes it with ``actor="operator"``: the runtime records the actor in the
  trace's ``approval_granted`` / ``approval_refused`` entries and a denied
  call's observation tells the model that the operator refused it.
- A checkpoint held by a dead worker (or one on another host, which cannot
  be checked from here) offers ``recover`` instead (``POST
  /approval/recover``): it resumes with ``worker_stopped=True`` behind a
  confirmation that the worker was stopped and checked.
- The invocation resumes through the runtime the panel was started with
  (``touba panel --program`` naming a Runtime, or ``--checkpoints-db``): a
  chat turn (its ``run_id`` is a live chat session of the panel's memory
  store) through :meth:`~touba.memory.ChatSession.resume`, so the turn is
  stored in the session; anything else, and a turn whose session has ended
  since (a session that ended stores no more turns), through
  :meth:`~touba.Runtime.resume`.
- Errors (no checkpoint store, the checkpoint gone or resumed by someone
  else, a worker running it now, a decision missing, no confirmation) are a
  one-line message and change nothing: every check happens before the
  resume, and the runtime's own refusals happen before it claims anything.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Final

from fastapi import APIRouter, Request, Response
from fastapi.exceptions import HTTPException

from touba.errors import ToubaError
from touba.memory import ChatSession
from touba.panel._auth import OperatorSession
from touba.panel._routes import _back, _form, _operator, _panel, _shown
from touba.panel._state import Panel
from touba.panel._waiting import Waiting, find_waiting, list_waiting
from touba.runtime import InvocationResult, Runtime

__all__ = ["ACTOR", "router"]

logger = logging.getLogger("touba.panel")

ACTOR: Final = "operator"
SHOWN: Final = 200
NO_RUNTIME: Final = (
    "No checkpoint store was given: start the panel with --checkpoints-db PATH (the "
    "application's SqliteCheckpointStore file), or with a --program naming the "
    "application's touba.Runtime (or a factory of one)."
)

router = APIRouter()


def _runtime(panel: Panel) -> Runtime | None:
    return panel.approvals


async def _find(panel: Panel, runtime: Runtime, checkpoint_id: str) -> Waiting:
    try:
        return await find_waiting(runtime, panel.memory, checkpoint_id)
    except ToubaError as e:
        raise HTTPException(404, e.message) from e


@router.get("/approvals")
async def approvals(request: Request) -> Response:
    panel = _panel(request)
    runtime = _runtime(panel)
    found: list[Waiting] = []
    total = 0
    problem = None
    durable = True
    if runtime is None:
        problem = NO_RUNTIME
    else:
        durable = bool(getattr(runtime.checkpoints, "durable", True))
        try:
            found, total = await list_waiting(runtime, panel.memory, limit=SHOWN)
        except ToubaError as e:
            problem = e.message
    return panel.render(
        request,
        "approvals.html",
        items=found,
        more=max(total - SHOWN, 0),
        problem=problem,
        durable=durable,
        shown=_shown,
    )


@router.get("/approval")
async def approval(request: Request) -> Response:
    panel = _panel(request)
    runtime = _runtime(panel)
    if runtime is None:
        raise HTTPException(404, NO_RUNTIME)
    waiting = await _find(panel, runtime, request.query_params.get("id", ""))
    return panel.render(request, "approval.html", item=waiting, shown=_shown)


def _decisions(form: dict[str, str], waiting: Waiting) -> dict[str, bool] | str:
    """The operator's decision for every pending call, or what is wrong with the form."""
    decided: dict[str, bool] = {}
    for call in waiting.calls:
        choice = form.get(f"call:{call.call_id}")
        if choice not in ("approve", "deny"):
            return f"Nothing done: choose approve or deny for every call ({call.name} has none)."
        decided[call.call_id] = choice == "approve"
    named = {k.removeprefix("call:") for k in form if k.startswith("call:")}
    if named - set(decided):
        return "Nothing done: the page was out of date (it names calls that are not pending)."
    return decided


async def _resume(
    panel: Panel,
    runtime: Runtime,
    waiting: Waiting,
    approvals: dict[str, bool],
    *,
    worker_stopped: bool,
) -> str:
    """Resume ``waiting`` through the chat session or the runtime; what happened, in a line."""
    meta = waiting.session
    ended = meta is not None and meta.ended_at is not None
    if meta is not None and not ended and isinstance(waiting.input, str):
        async with ChatSession(
            runtime,
            waiting.agent,
            waiting.user_id,
            meta.session_id,
            store=panel.memory,
            extract_in_background=False,
        ) as chat:
            turn = await chat.resume(
                approvals,
                checkpoint_id=waiting.checkpoint_id,
                worker_stopped=worker_stopped,
                actor=ACTOR,
            )
        said = _outcome(turn.result, "The chat turn")
        if turn.stored is None:
            return said
        return f"{said} It is stored as turn {turn.stored.index + 1} of session {meta.session_id}."
    result = await runtime.resume(
        waiting.checkpoint_id, approvals, worker_stopped=worker_stopped, actor=ACTOR
    )
    said = _outcome(result, "The invocation")
    if ended:
        return f"{said} Its chat session had ended: the turn is not stored in it."
    return said


def _outcome(result: InvocationResult, subject: str) -> str:
    if result.status == "awaiting_approval":
        return f"{subject} paused again, awaiting approval: checkpoint {result.checkpoint_id}."
    if result.status == "failed":
        error = result.error
        code = f"{error.code}: {error.message}" if error is not None else "failed"
        retry = (
            f" It can be retried (checkpoint {result.checkpoint_id})."
            if result.checkpoint_id
            else ""
        )
        return f"{subject} failed ({code}).{retry}"
    return f"{subject} completed."


@dataclass(frozen=True)
class _Posted:
    """An approval form, checked (CSRF), with its checkpoint found waiting as ``action``."""

    panel: Panel
    session: OperatorSession
    form: dict[str, str]
    runtime: Runtime
    waiting: Waiting


async def _posted(request: Request, action: str, not_now: str) -> _Posted | Response:
    """The form and its waiting checkpoint, or the redirect saying why nothing was done
    (no runtime, a checkpoint gone, or one not waiting for ``action``: ``not_now``)."""
    panel = _panel(request)
    form = await _form(request)
    session = _operator(request)
    checkpoint_id = form.get("id", "")
    runtime = _runtime(panel)
    if runtime is None:
        session.flash("error", NO_RUNTIME)
        return _back("/approvals")
    try:
        waiting = await find_waiting(runtime, panel.memory, checkpoint_id)
    except ToubaError as e:
        session.flash("error", f"Nothing done: {e.message}")
        return _back("/approvals")
    if waiting.action != action:
        session.flash("error", f"Nothing done: checkpoint {checkpoint_id} {not_now}.")
        return _back("/approval", id=checkpoint_id)
    return _Posted(panel, session, form, runtime, waiting)


@router.post("/approval/decide")
async def decide(request: Request) -> Response:
    posted = await _posted(request, "decide", "is not awaiting approval now")
    if isinstance(posted, Response):
        return posted
    session, form, waiting = posted.session, posted.form, posted.waiting
    checkpoint_id = waiting.checkpoint_id
    decided = _decisions(form, waiting)
    if isinstance(decided, str):
        session.flash("error", decided)
        return _back("/approval", id=checkpoint_id)
    if form.get("confirm") != "yes":
        session.flash(
            "error", "Nothing done: tick the confirmation box (approved calls run at once)."
        )
        return _back("/approval", id=checkpoint_id)
    try:
        said = await _resume(posted.panel, posted.runtime, waiting, decided, worker_stopped=False)
    except ToubaError as e:
        session.flash("error", f"Nothing done: {e.message}")
        return _back("/approvals")
    approved = sum(decided.values())
    logger.info(
        "checkpoint %s: %d call(s) approved and %d denied by the operator",
        checkpoint_id,
        approved,
        len(decided) - approved,
    )
    session.flash("ok", f"Approved {approved}, denied {len(decided) - approved}. {said}")
    return _back("/approvals")


@router.post("/approval/recover")
async def recover(request: Request) -> Response:
    posted = await _posted(
        request,
        "recover",
        "is not held by a stopped worker (its worker is alive, or it awaits approval)",
    )
    if isinstance(posted, Response):
        return posted
    session, waiting = posted.session, posted.waiting
    checkpoint_id = waiting.checkpoint_id
    if posted.form.get("worker_stopped") != "yes":
        session.flash(
            "error",
            "Nothing done: confirm that you stopped and checked the worker that holds it.",
        )
        return _back("/approval", id=checkpoint_id)
    try:
        said = await _resume(posted.panel, posted.runtime, waiting, {}, worker_stopped=True)
    except ToubaError as e:
        session.flash("error", f"Nothing done: {e.message}")
        return _back("/approvals")
    logger.info("checkpoint %s recovered from a stopped worker by the operator", checkpoint_id)
    session.flash("ok", f"Recovered. {said}")
    return _back("/approvals")

"""``touba chat``: an interactive chat session in the terminal (one line, one turn).

Lines are read from standard input. Commands, handled here and never sent
to the model: ``/help`` lists them, ``/events`` lists the key events the
session sees, ``/end`` ends the session (``kind="agent"``/``"flow"``: its key
events are extracted now, in-process, and the job stays queued for ``touba
worker`` if that fails), ``/quit`` or end of input leaves without ending it
(continue it later with ``--session``). Any other ``/word`` alone on its
line is refused as an unknown command; a line that only starts with ``/``
("/etc/hosts is empty") is a message. A call awaiting approval is asked
about, ``y`` approving it.

``/context`` says what the last stored turn's invocation was given (earlier
turns, memory settings and where they came from, key events, system prompt
size, decision windows), in the panel's words.

``--json`` prints each turn on standard output as one JSON object (its
number, status, user message, replies, tool trace and its ``context``
record), and ``/context`` as the record's JSON; everything meant for a
person (prompts, notices) then goes to standard error.

An ended session is refused before anything else is printed. The command
exits 1 when a turn failed (after the session goes on to its end: the other
turns are kept) and 0 otherwise.

The memory store (turns, key events, jobs) is a SQLite file (``--db``) or
PostgreSQL (``--dsn`` or ``TOUBA_DSN``), created if absent. Checkpoints stay
in RAM: an approval is answered in the same process.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import sys
from collections.abc import Iterator
from typing import Annotated, Any

import typer
from rich.markup import escape

from touba.cli._common import console, errors
from touba.cli._events import Db, PrefixOption, memory_target
from touba.cli._programs import ProgramOption, load_program
from touba.cli._stores import DsnOption, open_memory
from touba.cli._worker import report_job
from touba.history._model import canonical_json
from touba.memory import ChatSession, ChatTurn, ExtractionWorker, MemoryStore, StoredTurn
from touba.memory._turn_context import describe_context, describe_history, describe_windows
from touba.runtime import Runtime

COMMANDS = {
    "/help": "list these commands",
    "/events": "the key events this session sees",
    "/context": "what the last stored turn was given (turns, settings, key events, windows)",
    "/end": "end the session (key events of an agent or flow are extracted now)",
    "/quit": "leave; the session stays open (continue it with --session)",
}
_COMMAND = re.compile(r"/\w+")


async def _line(prompt: str) -> str | None:
    console.print(prompt, end="")
    line = await asyncio.to_thread(sys.stdin.readline)
    return line.strip() if line else None


def _show(turn: ChatTurn) -> None:
    stored = turn.stored.trace if turn.stored is not None else ()
    for group in stored:
        for call in group:
            console.print(
                f"  [dim]· {call.name}({escape(canonical_json(dict(call.arguments)))}) → "
                f"{call.status}[/]"
            )
    for reply in turn.replies:
        console.print("[bold green]agent>[/] ", end="")
        console.print(reply, markup=False)
    error = turn.result.error
    if turn.status == "failed" and error is not None:
        console.print(f"[bold red]{error.code}[/]: ", end="")
        console.print(error.message, markup=False)


async def _approve(session: ChatSession, turn: ChatTurn) -> ChatTurn:
    """Ask for each approval, and offer to retry a turn that failed retryably.

    A retry resumes the turn's checkpoint: calls that ran are not run again.
    Declining leaves the turn pending; the session then refuses new messages
    until it is retried (in this process: the checkpoints live in its RAM).
    """
    while turn.result.checkpoint_id is not None:
        approvals: dict[str, bool] = {}
        if turn.status == "failed":
            answer = await _line("the turn failed after running calls; retry it? [Y/n] ")
            if (answer or "y").lower() not in ("y", "yes"):
                return turn
        for call in turn.result.pending:
            question = f"approve {call.name}({canonical_json(dict(call.arguments))})? [y/N] "
            answer = await _line(escape(question))
            approvals[call.call_id] = (answer or "").lower() in ("y", "yes")
        turn = await session.resume(approvals)
        _show(turn)
    return turn


def _turn_data(turn: ChatTurn) -> dict[str, Any]:
    """A turn as ``--json`` prints it: the stored turn with its context record."""
    stored = turn.stored
    error = turn.result.error
    return {
        "session_id": turn.session_id,
        "turn": stored.index + 1 if stored is not None else None,
        "status": turn.status,
        "user": turn.user,
        "replies": list(turn.replies),
        "trace": [
            [
                {"name": c.name, "arguments": dict(c.arguments), "status": c.status}
                | ({"result": c.result} if c.status == "ok" else {"error": c.error})
                for c in group
            ]
            for group in (stored.trace if stored is not None else ())
        ],
        "context": dict(stored.context) if stored and stored.context is not None else None,
        "error": error.code if error is not None else None,
    }


def _print_json_line(data: object) -> None:
    sys.stdout.write(json.dumps(data, ensure_ascii=False, separators=(",", ":")) + "\n")
    sys.stdout.flush()


@contextlib.contextmanager
def _people_on_stderr(on: bool) -> Iterator[None]:
    """With ``--json``, what is meant for a person goes to standard error."""
    if not on:
        yield
        return
    console.file = sys.stderr
    try:
        yield
    finally:
        console.file = None  # type: ignore[assignment]  # back to the current sys.stdout


async def _context(session: ChatSession, as_json: bool) -> None:
    """``/context``: what the last stored turn's invocation was given."""
    last: tuple[StoredTurn, ...] = await session.store.recent_turns(session.session_id, 1)
    if as_json:
        _print_json_line(dict(last[0].context) if last and last[0].context else None)
        return
    if not last:
        console.print("no turn stored yet in this session")
        return
    turn = last[0]
    console.print(f"turn {turn.index + 1}: ", end="")
    console.print(describe_context(turn.context), markup=False)
    for line in describe_windows(turn.context):
        console.print(f"  {line}", markup=False)
    history = describe_history(turn.context)
    if history is not None:
        console.print(f"  {history}", markup=False)


async def _command(session: ChatSession, text: str, as_json: bool = False) -> None:
    """``/help``, ``/events``, ``/context``, or an unknown command (never sent to the
    model)."""
    if text == "/events":
        await _events(session)
    elif text == "/context":
        await _context(session, as_json)
    elif text == "/help":
        for name, what in COMMANDS.items():
            console.print(f"  {name}: {what}", markup=False)
    else:
        errors.print(
            f"unknown command {escape(text)} (not sent to the agent); /help lists the commands"
        )


async def _end(runtime: Runtime, store: MemoryStore, session: ChatSession) -> None:
    """End the session; an agent or flow's key events are extracted now (one attempt:
    a retry is the worker's)."""
    job = await session.end()
    console.print("session ended")
    if job is not None:
        worker = ExtractionWorker(runtime, store, queue=session.queue)
        done = await worker.run_job(job_id=job.id)
        report_job(done if done is not None else job)


async def _events(session: ChatSession) -> None:
    if session.mode == "preview":
        console.print("[dim](preview: the model sees none of these)[/]")
    events = await session.store.query_events(session.owner)
    if not events:
        console.print(f"no open key event for {escape(session.owner)}")
    for event in events:
        kind = escape(f"[{event.type}]")
        console.print(f"  {event.id} {kind} {escape(event.title)} ({event.status})")


def chat(
    agent: Annotated[str, typer.Option("--agent", "-a", help="The agent to talk to.")],
    db: Db = None,
    dsn: DsnOption = None,
    prefix: PrefixOption = None,
    program: ProgramOption = None,
    user: Annotated[
        str | None, typer.Option("--user", "-u", help="The user id (none: anonymous).")
    ] = None,
    session_id: Annotated[
        str | None, typer.Option("--session", "-s", help="Continue this session.")
    ] = None,
    preview: Annotated[
        bool,
        typer.Option("--preview", help="Preview mode: blank memory, no key event written."),
    ] = False,
    as_json: Annotated[
        bool,
        typer.Option(
            "--json",
            help="Print each turn (and /context) as one JSON object; prompts go to stderr.",
        ),
    ] = False,
) -> None:
    """Chat with an agent of your program, with its chat memory and key events."""
    loaded = load_program(program)
    target = memory_target(db, dsn, prefix)

    async def go() -> None:
        # Checkpoints stay in this process's RAM: approvals and retries are answered
        # inline, in this conversation.
        runtime = Runtime(loaded)
        async with (
            open_memory(target.backend, prefix=target.prefix, create=True) as store,
            ChatSession(
                runtime,
                agent,
                user,
                session_id,
                store=store,
                mode="preview" if preview else "live",
                extract_in_background=False,
            ) as session,
        ):
            if session.ended:
                errors.print(
                    f"session {escape(session.session_id)} has ended; start a new one "
                    "(omit --session)"
                )
                raise typer.Exit(1)
            mode = "preview" if preview else "live"
            console.print(
                f"session {escape(session.session_id)} ({mode}), agent {escape(agent)}, "
                f"owner {escape(session.owner)}. Type /help for the commands."
            )
            failed = 0
            ended = False
            while (text := await _line("[bold]you>[/] ")) is not None:
                if not text:
                    continue
                if _COMMAND.fullmatch(text):
                    if text == "/quit":
                        break
                    if text == "/end":
                        await _end(runtime, store, session)
                        ended = True
                        break
                    await _command(session, text, as_json)
                    continue
                turn = await session.send(text)
                _show(turn)
                turn = await _approve(session, turn)
                if as_json:
                    _print_json_line(_turn_data(turn))
                if session.pending_checkpoint is not None:
                    errors.print("the failed turn was not retried; it is lost with this process")
                    raise typer.Exit(1)
                failed += turn.status == "failed"
            if not ended:
                console.print(f"left; continue with --session {escape(session.session_id)}")
            if failed:
                errors.print(f"{failed} turn(s) failed")
                raise typer.Exit(1)

    try:
        with _people_on_stderr(as_json):
            target.backend.run(go())
    except KeyboardInterrupt:
        console.print("interrupted; the session stays open")

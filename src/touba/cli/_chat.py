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

Replies stream: the agent's text is printed as the model writes it
(:meth:`~touba.memory.ChatSession.stream`), each call it makes as its answer
comes; a structured final output, which is not streamed, is printed whole at the
end. Only the session's agent's own text is printed (a delegate's is not a reply
of the turn, as in the stored turn).

Continuing and leaving. ``--session ID`` continues a session of this store: an
unknown id is refused (a typo would otherwise start an empty session) unless
``--new`` says to start it, and ``--new`` refuses an id that exists. A session
continued with another ``--user``, ``--agent`` or ``--preview`` than it was
started with is refused, naming which of owner, agent and mode differs. One
Ctrl-C during a reply cancels that reply: the turn is not stored and the session
goes on (:mod:`touba.cli._terminal`): the streamed turn is cancelled (its
``ChatTurn`` has status ``cancelled``; the part already printed stays on the
screen but is in no memory). Ctrl-C at a prompt leaves at once, as end
of input (Ctrl-D) and ``/quit`` do, printing the ``--session`` to continue with.
"""

from __future__ import annotations

import contextlib
import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape

from touba.cli._common import console, errors
from touba.cli._events import Db, PrefixOption, memory_target
from touba.cli._programs import ProgramOption, load_program
from touba.cli._stores import DsnOption, open_memory
from touba.cli._terminal import Interrupted, Terminal
from touba.cli._worker import report_job
from touba.history._model import canonical_json
from touba.memory import (
    ChatSession,
    ChatTurn,
    ExtractionWorker,
    MemoryStore,
    StoredTurn,
    owner_for,
)
from touba.memory._model import SessionMeta
from touba.memory._turn_context import describe_context, describe_history, describe_windows
from touba.runtime import (
    DecisionCompleted,
    Runtime,
    StreamEvent,
    TextDelta,
    ToolCallFinished,
    ToolCallStarted,
)

COMMANDS = {
    "/help": "list these commands",
    "/events": "the key events this session sees",
    "/context": "what the last stored turn was given (turns, settings, key events, windows)",
    "/end": "end the session (key events of an agent or flow are extracted now)",
    "/quit": "leave; the session stays open (continue it with --session)",
}
_COMMAND = re.compile(r"/\w+")


async def _line(terminal: Terminal, prompt: str) -> str | None:
    """The next line typed after ``prompt``, stripped; None at end of input.
    :class:`Interrupted` on Ctrl-C."""
    console.print(prompt, end="")
    line = await terminal.line()
    return line.strip() if line is not None else None


def _show_call(name: str, arguments: object, status: str) -> None:
    console.print(f"  [dim]· {name}({escape(canonical_json(arguments))}) → {status}[/]")


def _show(turn: ChatTurn, printed: tuple[str, ...] | None = None) -> None:
    """The turn's calls and replies, then its error (its full text: a provider error
    shows the server's message to the one who typed the turn); ``printed``: the replies already
    streamed (their calls too), so that only the rest is printed."""
    stored = turn.stored.trace if turn.stored is not None and printed is None else ()
    for group in stored:
        for call in group:
            _show_call(call.name, dict(call.arguments), call.status)
    for reply in turn.replies:
        if printed is not None and reply in printed:
            continue
        console.print("[bold green]agent>[/] ", end="")
        console.print(reply, markup=False)
    error = turn.result.error
    if turn.status == "failed" and error is not None:
        console.print(f"[bold red]{error.code}[/]: ", end="")
        console.print(str(error), markup=False)  # with what a model server said, if it did


async def _approve(session: ChatSession, turn: ChatTurn, terminal: Terminal) -> ChatTurn:
    """Ask for each approval, and offer to retry a turn that failed retryably.

    A retry resumes the turn's checkpoint: calls that ran are not run again.
    Declining leaves the turn pending; the session then refuses new messages
    until it is retried (in this process: the checkpoints live in its RAM).
    """
    while turn.result.checkpoint_id is not None:
        approvals: dict[str, bool] = {}
        if turn.status == "failed":
            answer = await _line(terminal, "the turn failed after running calls; retry it? [Y/n] ")
            if (answer or "y").lower() not in ("y", "yes"):
                return turn
        for call in turn.result.pending:
            question = f"approve {call.name}({canonical_json(dict(call.arguments))})? [y/N] "
            answer = await _line(terminal, escape(question))
            approvals[call.call_id] = (answer or "").lower() in ("y", "yes")
        turn = await terminal.reply(session.resume(approvals))
        _show(turn)
    return turn


class _Printer:
    """Prints a streamed turn as it comes: the agent's text, and each call once answered."""

    def __init__(self, agent: str) -> None:
        self.agent = agent
        self.texts: list[str] = []  # of each decision of the agent, as printed
        self._writing = False
        self._arguments: dict[str, object] = {}

    def show(self, event: StreamEvent) -> None:
        if isinstance(event, TextDelta) and event.agent == self.agent:
            if not self._writing:
                console.print("[bold green]agent>[/] ", end="")
                self._writing = True
                self.texts.append("")
            self.texts[-1] += event.text
            console.print(event.text, end="", markup=False, highlight=False, soft_wrap=True)
        elif isinstance(event, DecisionCompleted) and event.agent == self.agent:
            self.end_line()
        elif isinstance(event, ToolCallStarted) and event.agent == self.agent:
            self._arguments[event.call_id] = event.arguments
        elif isinstance(event, ToolCallFinished) and event.agent == self.agent:
            self.end_line()
            _show_call(event.name, self._arguments.pop(event.call_id, {}), event.status)

    def end_line(self) -> None:
        if self._writing:
            console.print()
            self._writing = False


async def _streamed(session: ChatSession, text: str) -> ChatTurn:
    """One turn, printed as it streams (see the module docstring)."""
    printer = _Printer(session.agent)
    try:
        async with session.stream(text) as stream:
            async for event in stream:
                printer.show(event)
    finally:
        printer.end_line()
    turn = stream.turn
    _show(turn, printed=tuple(printer.texts))
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


async def _end(
    runtime: Runtime, store: MemoryStore, session: ChatSession, terminal: Terminal
) -> None:
    """End the session; an agent or flow's key events are extracted now (one attempt:
    a retry is the worker's; Ctrl-C stops it and leaves the job queued)."""
    job = await session.end()
    console.print("session ended")
    if job is not None:
        worker = ExtractionWorker(runtime, store, queue=session.queue)
        try:
            done = await terminal.reply(worker.run_job(job_id=job.id))
        except Interrupted:
            errors.print(
                f"extraction interrupted; job {escape(job.id)} stays queued for `touba worker`"
            )
            return
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


def _refusal(
    session_id: str,
    found: SessionMeta | None,
    *,
    new: bool,
    user: str | None,
    agent: str,
    mode: str,
) -> str | None:
    """Why ``--session session_id`` cannot be used as given (None: it can); see the
    module documentation. Names what differs, never the session's owner."""
    shown = escape(session_id)
    if found is None:
        if new:
            return None
        return (
            f"no session {shown} in this store; nothing was started. Start it with --new, "
            "or omit --session for a new session"
        )
    if new:
        return f"session {shown} already exists; continue it without --new"
    differ: list[str] = []
    if found.owner != owner_for(user, session_id):
        if found.owner.startswith("session:"):
            differ.append("owner (it is an anonymous session: continue it without --user)")
        elif user is None:
            differ.append("owner (it belongs to a user: give the --user it was started with)")
        else:
            differ.append(
                f"owner (it belongs to another user than {escape(user)}: give the --user it "
                "was started with)"
            )
    if found.agent_ref != agent:
        differ.append(f"agent (it is a session of --agent {escape(found.agent_ref)})")
    if found.mode != mode:
        how = "with --preview" if found.mode == "preview" else "without --preview"
        differ.append(f"mode (it is a {found.mode} session: continue it {how})")
    if not differ:
        return None
    return f"session {shown} was started with another " + "; another ".join(differ)


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
        str | None,
        typer.Option("--session", "-s", help="Continue this session (it must exist)."),
    ] = None,
    new: Annotated[
        bool,
        typer.Option("--new", help="Start the session --session names (refused if it exists)."),
    ] = False,
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
    """Chat with an agent of your program, with its chat memory and key events.

    Ctrl-C during a reply cancels it (the turn is not stored); at the prompt it leaves.
    """
    loaded = load_program(program)
    target = memory_target(db, dsn, prefix)
    mode = "preview" if preview else "live"
    continuing = session_id is not None and not new
    if continuing and target.backend.kind == "sqlite" and not Path(target.backend.address).exists():
        assert session_id is not None
        errors.print(
            f"{_refusal(session_id, None, new=False, user=user, agent=agent, mode=mode)} "
            f"(there is no memory database at {escape(target.backend.address)} yet)"
        )
        raise typer.Exit(1)

    async def go() -> None:
        # Checkpoints stay in this process's RAM: approvals and retries are answered
        # inline, in this conversation.
        runtime = Runtime(loaded)
        name = runtime.agent(agent).name
        async with open_memory(
            target.backend, prefix=target.prefix, create=not continuing
        ) as store:
            found = None if session_id is None else await store.get_session(session_id)
            if session_id is not None:
                refused = _refusal(session_id, found, new=new, user=user, agent=name, mode=mode)
                if refused is not None:
                    errors.print(refused)
                    raise typer.Exit(1)
            async with ChatSession(
                runtime,
                agent,
                user,
                session_id,
                store=store,
                mode="preview" if preview else "live",
                extract_in_background=False,
            ) as session:
                await _converse(
                    runtime, store, session, 0 if found is None else found.turns, as_json
                )

    try:
        with _people_on_stderr(as_json):
            target.backend.run(go())
    except KeyboardInterrupt:
        console.print("interrupted; the session stays open")


async def _converse(
    runtime: Runtime, store: MemoryStore, session: ChatSession, stored: int, as_json: bool
) -> None:
    """The chat loop, once the session is open (``stored``: its turns so far; ``as_json``:
    each turn printed as one JSON object)."""
    if session.ended:
        errors.print(
            f"session {escape(session.session_id)} has ended; start a new one (omit --session)"
        )
        raise typer.Exit(1)
    console.print(
        f"session {escape(session.session_id)} ({session.mode}), agent {escape(session.agent)}, "
        f"owner {escape(session.owner)}. Type /help for the commands."
    )
    left = f"left; continue with --session {escape(session.session_id)}"
    failed = 0
    ended = False
    terminal = Terminal()
    with terminal.handling_ctrl_c():
        while True:
            try:
                text = await _line(terminal, "[bold]you>[/] ")
            except Interrupted:
                console.print()  # after the ^C the terminal echoed
                break
            if text is None:
                console.print()  # end the prompt's line
                break
            if not text:
                continue
            if _COMMAND.fullmatch(text):
                if text == "/quit":
                    break
                if text == "/end":
                    await _end(runtime, store, session, terminal)
                    ended = True
                    break
                await _command(session, text, as_json)
                continue
            try:
                turn = await terminal.reply(_streamed(session, text))
            except Interrupted:
                stored = await _cancelled(store, session, stored)
                continue
            try:
                turn = await _approve(session, turn, terminal)
            except Interrupted:
                console.print()
                errors.print("interrupted; the turn awaiting an answer was not stored")
                console.print(left)
                raise typer.Exit(1) from None
            if as_json:
                _print_json_line(_turn_data(turn))
            if session.pending_checkpoint is not None:
                errors.print("the failed turn was not retried; it is lost with this process")
                raise typer.Exit(1)
            failed += turn.status == "failed"
            stored += turn.stored is not None
    if not ended:
        console.print(left)
    if failed:
        errors.print(f"{failed} turn(s) failed")
        raise typer.Exit(1)


async def _cancelled(store: MemoryStore, session: ChatSession, stored: int) -> int:
    """Say that Ctrl-C cancelled a reply and whether its turn was stored anyway (the
    store's write had begun): the session's turn count says. Returns that count."""
    meta = await store.get_session(session.session_id)
    now = stored if meta is None else meta.turns
    console.print()
    if now > stored:
        errors.print("reply cancelled too late: the turn was already stored")
    else:
        errors.print("reply cancelled; this turn was not stored (the session goes on)")
    return now

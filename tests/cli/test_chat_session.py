"""`touba chat` under a person's hands: Ctrl-C in a real terminal, `--session` and `--new`.

The Ctrl-C tests run `touba chat` in a pseudo-terminal of its own (its controlling
terminal, so that the byte ^C the test types becomes SIGINT, as a keyboard's does)
with a program whose model answers at once, or sleeps on a message that says
"slow" until Ctrl-C cancels it.
"""

from __future__ import annotations

import asyncio
import os
import re
import select
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from touba.cli._app import app
from touba.memory import SqliteMemoryStore

runner = CliRunner()

PROGRAM = textwrap.dedent(
    '''
    """A program for the test: the model echoes, or sleeps on "slow" (then Ctrl-C)."""
    import asyncio
    import pathlib

    from touba.errors import AgentDecisionProviderUnavailable
    from touba.providers import create_function_decision_provider
    from touba.runtime import Program

    THINKING = pathlib.Path(__file__).with_name("thinking")


    async def model(messages, schema):
        users = [str(m["content"]) for m in messages if m["role"] == "user"]
        if messages[-1]["role"] == "tool":
            return {"action": "final", "output": "refunded"}
        if "refund" in users[-1]:
            return {"action": "call", "calls": [{"name": "refund", "arguments": {}}]}
        if "refused" in users[-1]:
            raise AgentDecisionProviderUnavailable(
                "the server at http://127.0.0.1:8080/v1 answered HTTP 500",
                status_code=500,
                server_message="body.response_format.type: Input should be 'text'",
                retryable=False,
            )
        if "slow" in users[-1]:
            THINKING.write_text("yes")
            await asyncio.sleep(120)
        return {
            "action": "final",
            "output": f"echo {users[-1]} | earlier: {', '.join(users[:-1]) or 'none'}",
        }


    def program():
        program = Program()

        @program.capability(requires_approval=True)
        async def refund() -> str:
            return "refunded"

        for name in ("echo", "other"):
            program.agent(
                name,
                provider=create_function_decision_provider(
                    generate=model, name="echo-model", decision_interface="native"
                ),
                capabilities=("refund",),
            )
        return program
    '''
)
# Make the pseudo-terminal on standard input the controlling terminal of the new
# session (start_new_session), then become the command.
CONTROLLING = (
    "import fcntl, os, sys, termios; fcntl.ioctl(0, termios.TIOCSCTTY, 0); "
    "os.execvp(sys.argv[1], sys.argv[1:])"
)
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


@pytest.fixture
def place(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A directory holding the program module (importable here too) and a private
    state directory."""
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "slowprog", raising=False)
    os.chmod(tmp_path, 0o700)
    (tmp_path / "slowprog.py").write_text(PROGRAM)
    (tmp_path / "state").mkdir(mode=0o700)
    return tmp_path


class Screen:
    """A command running in a pseudo-terminal: type into it, wait for what it prints."""

    def __init__(self, argv: list[str], cwd: Path) -> None:
        master, slave = os.openpty()
        env = {**os.environ, "COLUMNS": "200", "TERM": "dumb", "PYTHONPATH": str(cwd)}
        self.process = subprocess.Popen(
            [sys.executable, "-c", CONTROLLING, *argv],
            stdin=slave,
            stdout=slave,
            stderr=slave,
            cwd=cwd,
            env=env,
            start_new_session=True,
        )
        os.close(slave)
        self.fd = master
        self.seen = ""

    def type(self, data: bytes) -> None:
        os.write(self.fd, data)

    def wait_for(self, text: str, timeout: float = 20) -> str:
        """Read until ``text`` appears after what was already waited for; return the
        output up to and including it."""
        deadline = time.monotonic() + timeout
        while text not in self.seen:
            left = deadline - time.monotonic()
            assert left > 0, f"{text!r} never came; the screen shows:\n{self.seen}"
            ready, _, _ = select.select([self.fd], [], [], left)
            if ready:
                try:
                    chunk = os.read(self.fd, 4096)
                except OSError:  # the command ended: the terminal closed
                    chunk = b""
                if not chunk:
                    assert text in self.seen, f"{text!r} never came:\n{self.seen}"
                self.seen += ANSI.sub("", chunk.decode(errors="replace")).replace("\r", "")
        head, _, self.seen = self.seen.partition(text)
        return head + text

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        os.close(self.fd)


@pytest.fixture
def screens() -> Iterator[list[Screen]]:
    opened: list[Screen] = []
    yield opened
    for screen in opened:
        screen.close()


def chat(place: Path, *args: str) -> list[str]:
    db = place / "state" / "memory.db"
    return ["-m", "touba.cli", "chat", "--db", str(db), "-p", "slowprog:program", *args]


def _stored(db: Path, session_id: str) -> list[str]:
    async def read() -> list[str]:
        async with SqliteMemoryStore(db) as store:
            return [turn.user for turn in await store.recent_turns(session_id, 10)]

    return asyncio.run(read())


def test_ctrl_c_cancels_a_reply_then_leaves_at_the_prompt(
    place: Path, screens: list[Screen]
) -> None:
    screen = Screen([sys.executable, *chat(place, "-a", "echo", "-u", "ada")], place)
    screens.append(screen)
    banner = screen.wait_for("you> ")
    (session_id,) = re.findall(r"session (\S+) \(live\)", banner)
    screen.type(b"hello\n")
    screen.wait_for("agent> echo hello | earlier: none")
    screen.wait_for("you> ")
    screen.type(b"slow one\n")
    deadline = time.monotonic() + 20
    while not (place / "thinking").exists():  # the model is in the middle of its reply
        assert time.monotonic() < deadline, screen.seen
        time.sleep(0.05)
    screen.type(b"\x03")
    screen.wait_for("reply cancelled; this turn was not stored (the session goes on)")
    screen.wait_for("you> ")
    screen.type(b"after\n")  # the session is usable, and never saw the cancelled turn
    screen.wait_for("agent> echo after | earlier: hello\n")
    screen.wait_for("you> ")
    pressed = time.monotonic()
    screen.type(b"\x03")
    screen.wait_for(f"left; continue with --session {session_id}")
    assert screen.process.wait(timeout=10) == 0
    assert time.monotonic() - pressed < 5  # at once, not after another line
    assert _stored(place / "state" / "memory.db", session_id) == ["hello", "after"]
    again = runner.invoke(
        app,
        [*chat(place, "-a", "echo", "-u", "ada", "--session", session_id)[2:]],
        input="again\n",
        env={"COLUMNS": "200"},
    )
    assert again.exit_code == 0, again.output
    assert "agent> echo again | earlier: hello, after" in again.output


def test_ctrl_c_at_the_first_prompt_leaves_at_once_with_the_session_id(
    place: Path, screens: list[Screen]
) -> None:
    screen = Screen([sys.executable, *chat(place, "-a", "echo")], place)
    screens.append(screen)
    (session_id,) = re.findall(r"session (\S+) \(live\)", screen.wait_for("you> "))
    screen.type(b"\x03")
    screen.wait_for(f"left; continue with --session {session_id}")
    assert screen.process.wait(timeout=10) == 0
    assert "Traceback" not in screen.seen


def test_ctrl_d_at_the_prompt_leaves_with_the_session_id(
    place: Path, screens: list[Screen]
) -> None:
    screen = Screen([sys.executable, *chat(place, "-a", "echo")], place)
    screens.append(screen)
    (session_id,) = re.findall(r"session (\S+) \(live\)", screen.wait_for("you> "))
    screen.type(b"\x04")
    screen.wait_for(f"left; continue with --session {session_id}")
    assert screen.process.wait(timeout=10) == 0


def test_ctrl_c_at_an_approval_prompt_leaves_without_storing_the_turn(
    place: Path, screens: list[Screen]
) -> None:
    screen = Screen([sys.executable, *chat(place, "-a", "echo", "-u", "ada")], place)
    screens.append(screen)
    (session_id,) = re.findall(r"session (\S+) \(live\)", screen.wait_for("you> "))
    screen.type(b"a refund please\n")
    screen.wait_for("approve refund({})? [y/N] ")
    screen.type(b"\x03")
    screen.wait_for("interrupted; the turn awaiting an answer was not stored")
    screen.wait_for(f"left; continue with --session {session_id}")
    assert screen.process.wait(timeout=10) == 1
    assert _stored(place / "state" / "memory.db", session_id) == []


def _invoke(place: Path, *args: str, input: str = "hi\n") -> tuple[int, str]:
    result = runner.invoke(app, chat(place, *args)[2:], input=input, env={"COLUMNS": "200"})
    return result.exit_code, result.output


def test_an_unknown_session_is_refused_unless_new(place: Path) -> None:
    db = place / "state" / "memory.db"
    code, out = _invoke(place, "-a", "echo", "-u", "ada", "-s", "s-typo")
    assert code == 1
    assert "no session s-typo in this store; nothing was started" in out
    assert "--new" in out
    assert not db.exists()  # nothing created for a refused command
    code, out = _invoke(place, "-a", "echo", "-u", "ada", "-s", "s-1", "--new")
    assert code == 0, out
    assert "session s-1 (live)" in out
    assert "agent> echo hi | earlier: none" in out
    code, out = _invoke(place, "-a", "echo", "-u", "ada", "-s", "s-typo")
    assert code == 1  # the store exists now: still refused, still nothing started
    assert "no session s-typo" in out
    code, out = _invoke(place, "-a", "echo", "-u", "ada", "-s", "s-1", "--new")
    assert code == 1
    assert "session s-1 already exists; continue it without --new" in out
    code, out = _invoke(place, "-a", "echo", "-u", "ada", "-s", "s-1", input="again\n")
    assert code == 0, out
    assert "agent> echo again | earlier: hi" in out
    assert _stored(db, "s-1") == ["hi", "again"]
    assert _stored(db, "s-typo") == []


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ("-a", "echo", "-u", "bob"),
            "another owner (it belongs to another user than bob: give the --user it was "
            "started with)",
        ),
        (
            ("-a", "echo"),
            "another owner (it belongs to a user: give the --user it was started with)",
        ),
        (("-a", "other", "-u", "ada"), "another agent (it is a session of --agent echo)"),
        (
            ("-a", "echo", "-u", "ada", "--preview"),
            "another mode (it is a live session: continue it without --preview)",
        ),
        (
            ("-a", "other", "-u", "bob", "--preview"),
            "another owner (it belongs to another user than bob: give the --user it was "
            "started with); another agent (it is a session of --agent echo); another mode",
        ),
    ],
)
def test_continuing_with_another_owner_agent_or_mode_says_which(
    place: Path, args: tuple[str, ...], expected: str
) -> None:
    code, out = _invoke(place, "-a", "echo", "-u", "ada", "-s", "s-ada", "--new")
    assert code == 0, out
    code, out = _invoke(place, *args, "-s", "s-ada", input="hello?\n")
    assert code == 1
    assert f"session s-ada was started with {expected}" in " ".join(out.split())
    assert "user:ada" not in out  # the session's owner is not shown
    assert "you>" not in out
    assert _stored(place / "state" / "memory.db", "s-ada") == ["hi"]


def test_an_anonymous_session_continued_with_a_user_says_so(place: Path) -> None:
    code, out = _invoke(place, "-a", "echo", "-s", "s-anon", "--new")
    assert code == 0, out
    code, out = _invoke(place, "-a", "echo", "-u", "ada", "-s", "s-anon")
    assert code == 1
    assert "another owner (it is an anonymous session: continue it without --user)" in out


def test_a_refused_turn_shows_what_the_server_said(place: Path) -> None:
    code, out = _invoke(place, "-a", "echo", "-u", "ada", input="refused\n")
    assert code == 1, out  # a turn failed
    text = " ".join(out.split())
    assert (
        "AgentDecisionProviderUnavailable: the server at http://127.0.0.1:8080/v1 answered "
        "HTTP 500 (the server said: \"body.response_format.type: Input should be 'text'\")"
    ) in text
    assert "retry it?" not in text  # not retryable: no retry offered

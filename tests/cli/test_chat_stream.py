"""`touba chat` prints replies as they stream; Ctrl-C during a streamed reply cancels that turn.

The program's model is the official OpenAI SDK on a fake Responses server started
by the program itself (in the chat's process), whose second answer streams slowly:
the test sees its first words on the screen before the last are sent, presses
Ctrl-C, and the session goes on without the cancelled turn.
"""

from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path

from tests.cli.test_chat_session import Screen, _stored, chat, place, screens

__all__ = ["place", "screens"]  # the fixtures, shared with the Ctrl-C tests

PROGRAM = textwrap.dedent(
    '''
    """A program for the test: a model that streams, slowly for its second answer."""
    import openai

    from touba.providers.openai import create_openai_decision_provider
    from touba.runtime import Program
    from touba.testing.fakes import FakeOpenAIServer, StreamKnobs, openai_text

    SLOW = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike"


    def program():
        server = FakeOpenAIServer().start()
        server.script_response(openai_text("Hello there, friend."))
        server.script_response(openai_text(SLOW), stream=StreamKnobs(event_delay=0.4))
        server.script_response(openai_text("Back again."))
        client = openai.AsyncOpenAI(
            base_url=server.base_url + "/v1", api_key="sk-test", max_retries=0
        )
        program = Program()
        program.agent(
            "talker", provider=create_openai_decision_provider(model="gpt-test", client=client)
        )
        return program
    '''
)


def test_a_reply_streams_and_ctrl_c_cancels_it_keeping_the_session(
    place: Path, screens: list[Screen]
) -> None:
    (place / "slowprog.py").write_text(PROGRAM)
    screen = Screen([sys.executable, *chat(place, "-a", "talker", "-u", "ada")], place)
    screens.append(screen)
    (session_id,) = re.findall(r"session (\S+) \(live\)", screen.wait_for("you> "))
    screen.type(b"hello\n")
    screen.wait_for("agent> Hello there, friend.\n")
    screen.wait_for("you> ")
    screen.type(b"tell me slowly\n")
    screen.wait_for("agent> alpha bravo")  # the first words are on the screen ...
    assert "mike" not in screen.seen  # ... while the last are not written yet
    screen.type(b"\x03")
    shown = screen.wait_for("reply cancelled; this turn was not stored (the session goes on)")
    assert "mike" not in shown
    screen.wait_for("you> ")
    screen.type(b"again\n")
    screen.wait_for("agent> Back again.\n")
    screen.wait_for("you> ")
    screen.type(b"\x04")
    screen.wait_for(f"left; continue with --session {session_id}")
    assert screen.process.wait(timeout=10) == 0
    assert "Traceback" not in screen.seen
    assert _stored(place / "state" / "memory.db", session_id) == ["hello", "again"]

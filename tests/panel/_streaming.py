"""A program whose model streams slowly, for the panel's streamed preview under a real server.

``talkprog.py`` (written into the panel's working directory, importable as
``--program talkprog:program``) starts a fake OpenAI Responses server in the
panel's own process and scripts its answers: the first streams one event every
``TALK_DELAY`` seconds (environment, default ``DELAY``), the others at once.
When that first stream ends, ``stream-end.json`` (in the same directory) says
how (``outcome``) and when the fake saw the client close it (``closed_at``, a
``time.monotonic()`` reading: the same clock in every process of the machine).
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from touba.memory import SqliteMemoryStore

SLOW = "The first words come now, and the very last words arrive much later on."
DELAY = 0.25
PROGRAM = textwrap.dedent(
    f'''
    """A program for the panel's streaming tests (see tests/panel/_streaming.py)."""
    import json
    import os
    import pathlib
    import threading

    import openai

    from touba.providers.openai import create_openai_decision_provider
    from touba.runtime import Program
    from touba.testing.fakes import FakeOpenAIServer, StreamKnobs, openai_text


    def program():
        server = FakeOpenAIServer().start()
        delay = float(os.environ.get("TALK_DELAY", "{DELAY}"))
        server.script_response(openai_text({SLOW!r}), stream=StreamKnobs(event_delay=delay))

        def report():
            record = server.wait_stream_end(0, timeout=120)
            ended = {{"outcome": record.outcome, "closed_at": record.closed_at}}
            pathlib.Path(__file__).with_name("stream-end.json").write_text(json.dumps(ended))

        threading.Thread(target=report, daemon=True).start()
        for _ in range(5):
            server.script_response(openai_text("A quick answer."))
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
ARGS = ["--db", "memory.sqlite", "--program", "talkprog:program"]


async def prepare(directory: Path) -> None:
    """Put ``talkprog.py`` and an empty memory store in ``directory`` (the panel's
    working directory)."""
    (directory / "talkprog.py").write_text(PROGRAM)
    async with SqliteMemoryStore(directory / "memory.sqlite"):
        pass

"""A worker adding to one session and reading it whole, until it is SIGKILLed.

``work(backend, directory, name, session_id)`` opens the same store as the test
(``conftest.make_factory``), then forever: reads the whole session
(``get_items()``, no limit: the wide read), checking that it holds pairs 0 .. n-1,
whole, and adds the pair ``pair(n)`` (one ``add_items``, optimistic: the read left
the store object holding the session's tail). Run in a process forked by
:class:`tests._zygote.Zygote`; ``warm`` does a few rounds and returns (in the
zygote itself, before it forks).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from tests._zygote import ready
from tests.integrations.conftest import make_factory
from touba.integrations.openai_agents import ToubaSession

NAMESPACE = "ns"


def pair(n: int) -> list[Any]:
    return [
        {"role": "user", "content": f"question {n:06d}"},
        {"role": "assistant", "content": f"answer {n:06d}"},
    ]


def numbers(items: list[Any]) -> list[int]:
    """The pairs ``items`` holds, in order; AssertionError for a pair cut in two."""
    assert len(items) % 2 == 0, f"{len(items)} items: a pair was cut"
    found = []
    for question, answer in zip(items[::2], items[1::2], strict=True):
        n = int(question["content"].split()[1])
        assert answer["content"] == f"answer {n:06d}", (question, answer)
        found.append(n)
    return found


async def _rounds(
    backend: str, directory: str, name: str, session_id: str, rounds: int | None
) -> None:
    factory, _ = make_factory(backend, Path(directory), name, create=False)
    async with factory() as store:
        session = ToubaSession(session_id, store=store, namespace=NAMESPACE)
        ready()
        done = 0
        while rounds is None or done < rounds:
            found = numbers(await session.get_items())
            assert found == list(range(len(found))), found[-3:]
            await session.add_items(pair(len(found)))
            done += 1


def work(backend: str, directory: str, name: str, session_id: str) -> None:
    asyncio.run(_rounds(backend, directory, name, session_id, None))


def warm(backend: str, directory: str, name: str, session_id: str) -> None:
    asyncio.run(_rounds(backend, directory, name, session_id, 3))

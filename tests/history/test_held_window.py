"""The window a store builds from what it holds equals the one a fresh read gives.

Every built-in store keeps the messages it built for the window between
decisions and adds to them what each save appends (results answering the
calls of an exchange join it, one at a time). Whatever it holds, the window
handed to the model must be exactly the one built from the stored record.
"""

from __future__ import annotations

from typing import Any

from tests.history._stores import WHO, Stores
from touba.history import (
    CapabilityCall,
    DecisionHistory,
    DecisionMessage,
    HistoryConfig,
    HistoryWindow,
    Observation,
    ResultMessage,
)
from touba.history._model import message_from_dict


def calls(n: int) -> tuple[CapabilityCall, ...]:
    """Decision ``n`` makes 1 to 3 calls."""
    return tuple(CapabilityCall(f"c{n}-{k}", "f", {"n": n, "k": k}) for k in range(1 + n % 3))


async def test_the_held_window_is_the_stored_one_at_every_decision(stores: Stores) -> None:
    store = stores()
    history = DecisionHistory(HistoryConfig(store=store, namespace="n", max_messages=9))
    observations: list[Observation] = []
    for n in range(24):
        sent: list[HistoryWindow] = []

        async def generate(
            window: HistoryWindow, n: int = n, sent: list[HistoryWindow] = sent
        ) -> DecisionMessage:
            sent.append(window)
            return DecisionMessage(text=f"d{n}", calls=calls(n))

        record: Any = await store.read(WHO.key) if n else None
        await history.step(WHO, observations, generate)
        (window,) = sent
        if record is not None:  # the stored exchanges the window shows, plus the results
            stored = [[message_from_dict(m) for m in ex] for ex in record["exchanges"]]
            stored[-1] += [ResultMessage.from_observation(o) for o in observations]
            assert [list(ex) for ex in window.exchanges] == stored[window.start :]
            assert len(window.exchanges[-1]) == 1 + len(calls(n - 1))
            assert window.start > 0 or n < 4  # the window is trimmed: old exchanges left
        observations = [
            Observation(c.call_id, c.name, c.arguments, "ok", {"r": n}) for c in calls(n)
        ]

"""The per-decision figures of the record head: bounded, O(1) per decision, never content."""

from __future__ import annotations

import json
from typing import Any

from touba.history import (
    CapabilityCall,
    ConversationIdentity,
    DecisionHistory,
    DecisionMessage,
    HistoryConfig,
    HistoryEvent,
    HistoryWindow,
    MemoryHistoryStore,
    Observation,
    SummaryRequest,
)
from touba.history._plot import PLOT_FIELDS, PLOT_POINTS, DecisionPoint, add_point, read_points

SECRET = "s3cr3t-content"


def identity() -> ConversationIdentity:
    return ConversationIdentity(
        "ns", "p", "m", "native", run_id="r", invocation_id="i", agent_ref="a"
    )


async def run(history: DecisionHistory, decisions: int, fit: Any = None) -> None:
    observations: list[Observation] = []
    for step in range(decisions):

        async def model(window: HistoryWindow, step: int = step) -> DecisionMessage:
            call = CapabilityCall(f"c{step}", "lookup", {"q": SECRET})
            return DecisionMessage(text=SECRET, calls=(call,))

        decision = await history.step(identity(), observations, model, fit=fit)
        observations = [
            Observation(c.call_id, c.name, c.arguments, "ok", {"r": SECRET}) for c in decision.calls
        ]


async def test_each_decision_adds_its_sizes_and_the_ring_stays_bounded() -> None:
    store = MemoryHistoryStore()
    history = DecisionHistory(HistoryConfig(store=store, namespace="ns", max_messages=4))
    await run(history, PLOT_POINTS + 6)
    record = await store.read(identity().key)
    assert record is not None
    plot = record["plot"]
    assert plot["decisions"] == PLOT_POINTS + 6
    assert len(plot["points"]) == PLOT_POINTS
    assert SECRET not in json.dumps(plot)  # figures only
    points = read_points(record)
    assert [p.decision for p in points] == list(range(7, PLOT_POINTS + 7))
    last = points[-1]
    assert (last.retained_messages, last.retained_bytes) == (
        record["stats"]["messages"],
        record["stats"]["bytes"],
    )
    assert last.sent_messages <= 4
    assert last.trimmed_exchanges > 0
    assert (last.guard_counts, last.guard_count, last.guard_fits) == (0, None, None)


async def test_summaries_and_the_guards_verdict_are_kept() -> None:
    async def summarize(request: SummaryRequest) -> str:
        return "earlier lookups"

    store = MemoryHistoryStore()
    history = DecisionHistory(
        HistoryConfig(
            store=store,
            namespace="ns",
            max_messages=4,
            summarize=summarize,
            max_summary_bytes=64,
        )
    )

    async def fit(window: HistoryWindow) -> HistoryWindow:  # a guard counting twice
        for count in (900, 400):
            await history.emit(
                HistoryEvent(
                    kind="provider_context_count",
                    session_key=window.session_key,
                    message_count=0,
                    bytes=0,
                    provider="p",
                    count=count,
                    reserve=count + 100,
                    window=1000,
                    fits=count + 100 <= 1000,
                )
            )
        return window

    await run(history, 5, fit)
    record = await store.read(identity().key)
    assert record is not None
    points = read_points(record)
    assert any(p.new_summary for p in points)
    assert points[-1].summary_exchanges > 0
    assert (points[-1].guard_counts, points[-1].guard_count) == (2, 400)
    assert (points[-1].guard_reserve, points[-1].guard_window, points[-1].guard_fits) == (
        500,
        1000,
        True,
    )


def test_a_head_without_or_with_a_damaged_plot_has_no_points() -> None:
    assert read_points({}) == []
    assert read_points({"plot": "x"}) == []
    good = DecisionPoint(1, 2, 3, 4, 5, 6, 0, 0, False, 0)
    head: dict[str, Any] = {"plot": {"decisions": 1, "points": [["x"] * len(PLOT_FIELDS)]}}
    add_point(head, good)
    assert read_points(head) == [good]
    assert head["plot"]["decisions"] == 1

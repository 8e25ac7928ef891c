"""Server time of the memory panel's pages on a large SQLite memory store.

The memory store holds 10,000 chat sessions (2,000 users of 5 sessions, 3
turns each, one with a tool trace) and 100,000 key events (50 per user, a
tenth closed, each with one update), plus 2,000 extraction jobs; the history
store holds 100 conversations of 20 decisions. The rows are bulk-inserted
into the store's own tables (going through the API would only make the
setup slow; what is measured is reading). Then each page is requested
through the whole ASGI stack (auth, middleware, template), interleaved, and
its server time is read from the ``Server-Timing`` header the panel sets.

Printed: median and 95th percentile milliseconds per page, and the slowest
page's median against the target (50 ms). A ratio, not a timed assertion.

    .venv/bin/python bench/panel_pages.py [--rounds 30]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sqlite3
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient

from touba.cli._demo_program import build_program
from touba.history import (
    CapabilityCall,
    ConversationIdentity,
    DecisionHistory,
    DecisionMessage,
    HistoryConfig,
    HistoryWindow,
    Observation,
)
from touba.history.sqlite import SqliteHistoryStore
from touba.memory import SqliteMemoryStore
from touba.panel import create_app

USERS = 2_000
SESSIONS_PER_USER = 5
TURNS_PER_SESSION = 3
EVENTS_PER_USER = 50
JOBS = 2_000
CONVERSATIONS = 100
DECISIONS = 20
TARGET_MS = 50.0
TOKEN = "bench-token-0123456789abcdef"  # noqa: S105 - a bench-only token
BASE = "http://127.0.0.1:8765"


def _us(moment: float) -> int:
    return int(moment * 1_000_000)


def fill_memory(path: Path) -> None:
    """Bulk-insert sessions, turns, key events with history, and jobs."""
    conn = sqlite3.connect(path)
    now = time.time()
    trace = json.dumps(
        [
            [
                {
                    "call_id": "c1",
                    "name": "lookup_order",
                    "arguments": {"order_id": "A1"},
                    "status": "ok",
                    "result": {"status": "shipped"},
                    "error": None,
                }
            ]
        ]
    )
    with conn:
        sessions: list[tuple[Any, ...]] = []
        turns: list[tuple[Any, ...]] = []
        events: list[tuple[Any, ...]] = []
        history: list[tuple[Any, ...]] = []
        for u in range(USERS):
            owner = f"user:u-{u:05d}"
            for s in range(SESSIONS_PER_USER):
                sid = f"s-{u:05d}-{s}"
                created = _us(now - (u * SESSIONS_PER_USER + s))
                sessions.append((sid, owner, "support", "live", created, None, TURNS_PER_SESSION))
                turns.extend(
                    (
                        sid,
                        t,
                        json.dumps(f"question {t} about order A{t}"),
                        json.dumps([f"answer {t}"]),
                        trace if t == 1 else "[]",
                        None,
                        created,
                    )
                    for t in range(TURNS_PER_SESSION)
                )
            for e in range(EVENTS_PER_USER):
                eid = f"ke_{u:05d}{e:03d}"
                status = "closed" if e % 10 == 0 else "open"
                at = _us(now - e)
                events.append(
                    (
                        eid,
                        owner,
                        "refund" if e % 2 else "account issue",
                        f"Case {e} of {owner}",
                        status,
                        f"details of case {e}",
                        at,
                        at,
                        f"s-{u:05d}-0",
                        e + 1,
                    )
                )
                history.append((eid, at, f"s-{u:05d}-0", '[["details","","d"]]', "model"))
        conn.executemany(
            "INSERT INTO touba_memory_sessions (session_id, owner, agent_ref, mode, created_at,"
            " ended_at, turns) VALUES (?, ?, ?, ?, ?, ?, ?)",
            sessions,
        )
        conn.executemany(
            "INSERT INTO touba_memory_turns (session_id, idx, user_text, replies, trace,"
            " invocation_id, created_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
            turns,
        )
        conn.executemany(
            "INSERT INTO touba_memory_events (id, owner, type, title, status, details,"
            " created_at, updated_at, session_id, touched) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            events,
        )
        conn.executemany(
            "INSERT INTO touba_memory_history (event_id, at, session_id, changes, actor)"
            " VALUES (?, ?, ?, ?, ?)",
            history,
        )
        conn.executemany(
            "INSERT INTO touba_memory_jobs (id, session_id, owner, agent_ref, transcript_ref,"
            " status, attempts, max_attempts, next_attempt_at, created_at, updated_at,"
            " last_error) VALUES (?, ?, ?, 'assistant', ?, ?, 1, 5, ?, ?, ?, ?)",
            [
                (
                    f"xj_{j:06d}",
                    f"s-{j:05d}-0",
                    f"user:u-{j:05d}",
                    f"s-{j:05d}-0@3",
                    "failed" if j % 4 == 0 else "done",
                    _us(now),
                    _us(now),
                    _us(now - j),
                    "model unavailable" if j % 4 == 0 else None,
                )
                for j in range(JOBS)
            ],
        )
    conn.close()


async def fill_history(path: Path) -> str:
    """Conversations of DECISIONS decisions each; the key of the first."""
    keys = []
    async with SqliteHistoryStore(path, max_sessions=CONVERSATIONS + 28) as store:
        history = DecisionHistory(HistoryConfig(store=store, namespace="bench", max_messages=8))
        for c in range(CONVERSATIONS):
            identity = ConversationIdentity(
                "bench",
                "bench",
                "m",
                "native",
                run_id=f"run-{c}",
                invocation_id=f"inv-{c}",
                agent_ref="support",
            )
            observations: list[Observation] = []
            for d in range(DECISIONS):

                async def model(window: HistoryWindow, d: int = d) -> DecisionMessage:
                    call = CapabilityCall(f"c{d}", "lookup_order", {"order_id": f"A{d}"})
                    return DecisionMessage(text="checking", calls=(call,))

                decision = await history.step(identity, observations, model)
                observations = [
                    Observation(x.call_id, x.name, x.arguments, "ok", {"status": "shipped"})
                    for x in decision.calls
                ]
            keys.append(identity.key)
    return keys[0]


def pages(key: str) -> dict[str, str]:
    owner = "user:u-01000"
    return {
        "overview": "/",
        "agent settings": "/agents/support",
        "users, page 1": "/users",
        "users, page 40 (last)": "/users?page=40",
        "one user's sessions": f"/user?owner={owner}",
        "a session's turns": "/session?id=s-01000-2",
        "key events of a user": f"/events?owner={owner}",
        "key events, filtered": f"/events?owner={owner}&type=refund&text=case 1&closed=1",
        "one key event": f"/event?owner={owner}&id=ke_01000007",
        "key events of every user": "/events",
        "every user's, by text": "/events?text=case 17 of user:u-01",
        "every user's, page 100": "/events?type=refund&page=100",
        "jobs": "/jobs",
        "one job": "/job?id=xj_000004",
        "failed jobs, page 5": "/jobs?status=failed&page=5",
        "conversations": "/conversations",
        "one conversation (plot)": f"/conversation?key={key}",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    options = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "private"
        root.mkdir(mode=0o700)
        os.chmod(tmp, 0o700)
        memory_path, history_path = root / "memory.sqlite", root / "history.sqlite"
        started = time.perf_counter()
        asyncio.run(SqliteMemoryStore(memory_path).close())  # the schema
        fill_memory(memory_path)
        key = asyncio.run(fill_history(history_path))
        print(
            f"filled {USERS * SESSIONS_PER_USER:,} sessions, {USERS * EVENTS_PER_USER:,} key "
            f"events, {JOBS:,} jobs, {CONVERSATIONS} conversations in "
            f"{time.perf_counter() - started:.1f} s"
        )
        asyncio.run(measure(memory_path, history_path, key, options.rounds))


async def measure(memory_path: Path, history_path: Path, key: str, rounds: int) -> None:
    async with (
        SqliteMemoryStore(memory_path) as memory,
        SqliteHistoryStore(history_path, max_sessions=CONVERSATIONS + 28) as history,
    ):
        app = create_app(build_program(), memory, history, token=TOKEN)
        await asyncio.to_thread(_run, app, key, rounds)


def _run(app: Any, key: str, rounds: int) -> None:
    targets = pages(key)
    times: dict[str, list[float]] = {name: [] for name in targets}
    with TestClient(app, base_url=BASE) as client:
        client.get(f"/?token={TOKEN}")
        for name, path in targets.items():  # warm up (templates compiled, caches)
            response = client.get(path)
            assert response.status_code == 200, (name, response.status_code)
        for _ in range(rounds):
            for name, path in targets.items():
                response = client.get(path)
                timing = response.headers["server-timing"]
                times[name].append(float(timing.split("dur=")[1]))
    print(f"\n{'page':<28} {'median ms':>10} {'p95 ms':>8}")
    medians = {}
    for name, values in times.items():
        values.sort()
        medians[name] = statistics.median(values)
        p95 = values[min(len(values) - 1, int(len(values) * 0.95))]
        print(f"{name:<28} {medians[name]:>10.2f} {p95:>8.2f}")
    slowest = max(medians, key=medians.__getitem__)
    print(
        f"\nslowest page: {slowest}, {medians[slowest]:.2f} ms median "
        f"({medians[slowest] / TARGET_MS:.2f} of the {TARGET_MS:.0f} ms target)"
    )


if __name__ == "__main__":
    main()

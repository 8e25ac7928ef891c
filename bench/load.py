"""Load: chat workers on PostgreSQL while panel clients browse and an operator edits.

Everything lives in PostgreSQL (tables under a random prefix, dropped at the
end): the chat memory, the decision history and the checkpoints. ``--workers``
chat workers (bench/_chat.py: ``ChatSession`` turns of two decisions of the
offline scripted model) run in this process the whole time. The panel is
``touba panel`` itself, in a process of its own (uvicorn, as an operator
starts it), with ``--program bench.load:panel_runtime`` (the same agents, and
the checkpoint store whose approvals it lists). A third process runs the
panel's clients (httpx, each logged in with the token, as a browser is):

- ``--clients`` browsers, each fetching every page of the panel in a shuffled
  order, then again, ``--think`` seconds between pages on average (0: none), the
  first page too (browsers arrive on their own: 20 first requests in the same
  millisecond, while the panel's pools grow from 1 connection to 4, made the slowest
  1 % of a run, 300 to 450 ms, whatever the page).
  The pages are found from the app's GET routes (each must have a URL here,
  or the run stops), with real ids: a user, a session, key events, extraction
  jobs (one failed), a conversation, an approval waiting;
- one operator who, through the panel's forms (the session's CSRF token, the
  panel's Origin), saves the agent's memory settings (alternating two), resets
  them every fifth round, and edits a key event (status and details).

Any answer that is not 2xx/3xx is a failed request (no page is meant to answer
otherwise here: every URL names something that exists), and so is a transport
error. The chat runs alone for ``--seconds / 2``, then with the panel traffic
for ``--seconds``, then alone for ``--seconds / 2`` again: the ratio compares
the loaded phase with the two quiet ones around it (which brackets any drift
of the machine or of the growing tables).

A short run goes on past ``--seconds`` (60 s at most) until every page kind
was fetched once.

Printed: failed requests (by page kind and status), each page kind's client
time p50/p95/p99 (request sent to answer read, through the network stack) and
the server's own p99 (its ``Server-Timing``), and the chat's decisions/s quiet
and loaded, with their ratio (targets: panel p99 <= 100 ms, ratio >= 0.8).
Then the CPU each side used (the chat's process per decision, alone and
loaded; the panel's process per request), and the machine's load average at
each phase's end: on a shared machine the times say more about the machine
than about touba, and the CPU per decision and per request is what projects.

    .venv/bin/python bench/load.py [--seconds 120] [--workers 8] [--clients 20]
        [--think 1.0]

``run_load`` is also what ``tests/panel/test_load.py`` runs, shorter.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._chat import (  # noqa: E402
    AGENT,
    ChatModel,
    build_program,
    chat_runtime,
    chat_worker,
    drop_tables,
)
from bench._panel_clients import OWNER, TOKEN, ClientsReport  # noqa: E402
from touba import ChatSession  # noqa: E402
from touba.history import (  # noqa: E402
    CapabilityCall,
    ConversationIdentity,
    DecisionHistory,
    DecisionMessage,
    HistoryConfig,
    HistoryWindow,
    Observation,
)
from touba.memory import KeyEventsConfig, KeyEventService  # noqa: E402
from touba.runtime import Runtime  # noqa: E402
from touba.testing import ScriptedProvider  # noqa: E402

DSN_ENV = "TOUBA_LOAD_DSN"
CHECKPOINTS_ENV = "TOUBA_LOAD_CHECKPOINTS"
TARGET_P99_MS = 100.0
TARGET_RATIO = 0.8


def panel_runtime() -> Runtime:
    """``touba panel --program bench.load:panel_runtime``: the agents, over the run's
    PostgreSQL checkpoint store (``$TOUBA_LOAD_DSN``, table ``$TOUBA_LOAD_CHECKPOINTS``),
    whose waiting approvals the panel lists. Its model is never asked (nobody approves)."""
    from touba.runtime import PostgresCheckpointStore

    store = PostgresCheckpointStore(os.environ[DSN_ENV], table=os.environ[CHECKPOINTS_ENV])
    return Runtime(build_program(ScriptedProvider()), checkpoints=store)


# -- the stores and what the pages show ------------------------------------------------------


@dataclass
class Seeded:
    """The ids the pages name: a session, key events, jobs, a conversation, an approval."""

    session_id: str
    events: list[str]
    jobs: list[str]
    conversation: str
    checkpoint: str


@dataclass
class Stores:
    """The run's PostgreSQL stores and their names."""

    dsn: str
    prefix: str
    memory: Any
    history: Any
    checkpoints: Any

    @property
    def memory_prefix(self) -> str:
        return f"{self.prefix}_m"

    @property
    def history_table(self) -> str:
        return f"{self.prefix}_h"

    @property
    def checkpoints_table(self) -> str:
        return f"{self.prefix}_c"


@contextlib.asynccontextmanager
async def open_stores(dsn: str) -> AsyncIterator[Stores]:
    """Memory, history and checkpoint stores under a random prefix; dropped at the end."""
    from touba.history.postgres import PostgresHistoryStore
    from touba.memory import PostgresMemoryStore
    from touba.runtime import PostgresCheckpointStore

    prefix = f"load_{uuid.uuid4().hex[:8]}"
    try:
        async with (
            PostgresMemoryStore(dsn, prefix=f"{prefix}_m") as memory,
            PostgresHistoryStore(dsn, table=f"{prefix}_h") as history,
            PostgresCheckpointStore(dsn, table=f"{prefix}_c") as checkpoints,
        ):
            yield Stores(dsn, prefix, memory, history, checkpoints)
    finally:
        await drop_tables(dsn, prefix)


async def seed(stores: Stores, runtime: Runtime, model: ChatModel) -> Seeded:
    """What the pages show beyond the chat's own sessions (see :class:`Seeded`)."""
    memory = stores.memory
    model.top_up()
    async with ChatSession(runtime, AGENT, OWNER.removeprefix("user:"), store=memory) as chat:
        for number in range(2):
            await chat.send(f"Where is my order? ({number})")
        waiting = await chat.send("Please refund order A1.")
        session_id = chat.session_id
    model.forget()
    checkpoint = waiting.result.checkpoint_id
    if checkpoint is None or waiting.result.status != "awaiting_approval":
        raise RuntimeError(f"the refund did not wait for approval: {waiting.result.status}")
    service = KeyEventService(memory, KeyEventsConfig(enabled=True, types=("refund", "delivery")))
    events = [
        (await service.create(OWNER, kind, f"Case {n}", f"details of case {n}", session_id)).id
        for n, kind in enumerate(("refund", "delivery", "refund"))
    ]
    jobs = []
    for n in range(3):
        job, _ = await memory.enqueue_job(
            session_id=session_id,
            owner=OWNER,
            agent_ref=AGENT,
            transcript_ref=f"{session_id}@{n}",
            max_attempts=1,
        )
        jobs.append(job.id)
    claimed = await memory.claim_job("load-seed", 60.0, job_id=jobs[0])
    await memory.fail_job(claimed.id, claimed.lease_token, "RuntimeError: seeded", None)
    return Seeded(session_id, events, jobs, await _conversation(stores.history), checkpoint)


async def _conversation(store: Any) -> str:
    """A kept decision history of six decisions; its key."""
    history = DecisionHistory(HistoryConfig(store=store, namespace="load-seed", max_messages=8))
    who = ConversationIdentity(
        "load-seed",
        "scripted",
        "m",
        "native",
        run_id="run-1",
        invocation_id="inv-1",
        agent_ref=AGENT,
    )
    observations: list[Observation] = []
    for step in range(6):

        async def decide(window: HistoryWindow, step: int = step) -> DecisionMessage:
            call = CapabilityCall(f"c{step}", "lookup_order", {"order_id": f"A{step}"})
            return DecisionMessage(text="looking", calls=(call,))

        decision = await history.step(who, observations, decide)
        observations = [
            Observation(c.call_id, c.name, c.arguments, "ok", {"status": "shipped"})
            for c in decision.calls
        ]
    return who.key


def pages(seeded: Seeded) -> dict[str, list[str]]:
    """The URLs of each GET route of the panel (its page kind), with real ids."""
    owner = urlencode({"owner": OWNER})
    key = urlencode({"key": seeded.conversation})
    event = f"{owner}&{urlencode({'id': seeded.events[1]})}"
    return {
        "/login": ["/login"],  # logged in: a 303 to the overview
        "/": ["/"],
        "/agents/{name}": [f"/agents/{AGENT}"],
        "/users": ["/users", "/users?mode=all"],
        "/user": [f"/user?{owner}"],
        "/session": [f"/session?id={seeded.session_id}"],
        "/events": [f"/events?{owner}", "/events", "/events?text=case&closed=1"],
        "/event": [f"/event?{event}"],
        "/jobs": ["/jobs", "/jobs?status=failed"],
        "/job": [f"/job?id={job}" for job in seeded.jobs[:2]],
        "/conversations": ["/conversations"],
        "/conversation": [f"/conversation?{key}"],
        "/conversation/recover": [f"/conversation/recover?{key}"],
        "/conversation/repair": [f"/conversation/repair?{key}"],
        "/conversation/originals": [f"/conversation/originals?{key}"],
        "/approvals": ["/approvals"],
        "/approval": [f"/approval?id={seeded.checkpoint}"],
        "/static": ["/static/panel.css", "/static/panel.js"],
    }


def get_routes(app: Any) -> set[str]:
    """The panel's GET routes (and its static mount): the page kinds a client browses."""
    found: set[str] = set()

    def walk(routes: Any) -> None:
        for route in routes:
            included = getattr(route, "original_router", None)
            if included is not None:  # an included router (FastAPI wraps it)
                walk(included.routes)
            elif getattr(route, "methods", None) is None or "GET" in route.methods:  # a mount
                found.add(route.path)

    walk(app.routes)
    return found


# -- the panel's process ---------------------------------------------------------------------


@contextlib.contextmanager
def served_panel(stores: Stores) -> Iterator[Any]:
    """``touba panel`` over the stores, on a free port, until the block ends."""
    from tests.panel._serve import serve

    args = [
        "--dsn",
        stores.dsn,
        "--prefix",
        stores.memory_prefix,
        "--history-dsn",
        stores.dsn,
        "--history-table",
        stores.history_table,
        "--program",
        "bench.load:panel_runtime",
    ]
    env = {
        "TOUBA_PANEL_TOKEN": TOKEN,
        DSN_ENV: stores.dsn,
        CHECKPOINTS_ENV: stores.checkpoints_table,
    }
    with serve(args, ROOT, **env) as served:
        yield served


# -- the run -----------------------------------------------------------------------------------


@dataclass
class LoadReport:
    """One run: the clients' report, the chat's decisions per phase, the panel's log."""

    clients: ClientsReport
    quiet_decisions: int = 0
    quiet_seconds: float = 0.0
    loaded_decisions: int = 0
    loaded_seconds: float = 0.0
    chat_turns: int = 0
    chat_failures: list[str] = field(default_factory=list)
    kinds: set[str] = field(default_factory=set)
    server_errors: list[str] = field(default_factory=list)
    settings_changes: int = 0  # recorded in the store as made by the operator
    event_edits: int = 0  # the edited key event's updates by the operator
    quiet_cpu: float = 0.0  # CPU seconds of the chat's process, alone
    loaded_cpu: float = 0.0  # and with the panel traffic
    panel_cpu: float = 0.0  # CPU seconds of the panel's process in the loaded phase
    load_average: list[float] = field(default_factory=list)  # the machine's, each phase

    @property
    def quiet_rate(self) -> float:
        return self.quiet_decisions / self.quiet_seconds if self.quiet_seconds else 0.0

    @property
    def loaded_rate(self) -> float:
        return self.loaded_decisions / self.loaded_seconds if self.loaded_seconds else 0.0


async def _start_clients() -> asyncio.subprocess.Process:
    """The clients' process, started early: it imports while the panel starts, then
    waits for its configuration on stdin."""
    return await asyncio.create_subprocess_exec(
        sys.executable,
        str(ROOT / "bench" / "_panel_clients.py"),
        cwd=ROOT,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )


async def _run_clients(
    process: asyncio.subprocess.Process, config: dict[str, Any], on_ready: Any
) -> ClientsReport:
    assert process.stdin is not None
    assert process.stdout is not None
    process.stdin.write(json.dumps(config).encode() + b"\n")
    await process.stdin.drain()
    process.stdin.close()
    line = await process.stdout.readline()
    if line.strip() != b"ready":
        await process.wait()
        raise RuntimeError(f"the panel's clients did not start: {line!r}")
    on_ready()
    out = await process.stdout.read()
    if await process.wait() != 0:
        raise RuntimeError("the panel's clients failed (see stderr)")
    return ClientsReport(**json.loads(out))


async def run_load(
    *,
    dsn: str,
    seconds: float,
    workers: int,
    clients: int,
    think: float,
    quiet: bool = True,
) -> LoadReport:
    """One run (see the module); ``quiet``: the chat alone before and after, for the ratio."""
    clients_process = await _start_clients()
    try:
        return await _run(clients_process, dsn, seconds, workers, clients, think, quiet)
    finally:
        if clients_process.returncode is None:
            clients_process.kill()
            await clients_process.wait()


async def _run(
    clients_process: asyncio.subprocess.Process,
    dsn: str,
    seconds: float,
    workers: int,
    clients: int,
    think: float,
    quiet: bool,
) -> LoadReport:
    async with open_stores(dsn) as stores:
        runtime, model = chat_runtime(stores.history, stores.checkpoints)
        with contextlib.ExitStack() as stack:
            # The panel starts (its own imports and store checks) while the stores fill.
            starting = asyncio.create_task(
                asyncio.to_thread(stack.enter_context, served_panel(stores))
            )
            try:
                seeded = await seed(stores, runtime, model)
            finally:
                served = await starting
            urls = pages(seeded)
            from touba.panel import create_app

            routes = get_routes(create_app(runtime.program, stores.memory, token=TOKEN))
            if routes != set(urls):
                raise RuntimeError(
                    f"page kinds out of date: routes without URLs {sorted(routes - set(urls))}, "
                    f"URLs without routes {sorted(set(urls) - routes)}"
                )
            config = {
                "base": served.base,
                "clients": clients,
                "think": think,
                "seconds": seconds,
                "urls": urls,
                "seeded": {"events": seeded.events},
            }
            report = await _phases(
                runtime,
                model,
                stores,
                workers,
                seconds,
                quiet,
                clients_process,
                config,
                served.process.pid,
            )
        report.kinds = routes
        report.server_errors = [
            line for line in served.errors if " 500 " in line or "Traceback" in line
        ][:20]
        changes = await stores.memory.memory_config_history(AGENT, limit=100_000)
        edited = await stores.memory.get_event(OWNER, seeded.events[0])
        updates = edited.history if edited is not None and edited.history else ()
        report.settings_changes = sum(change.actor == "operator" for change in changes)
        report.event_edits = sum(update.actor == "operator" for update in updates)
        return report


async def _phases(
    runtime: Runtime,
    model: ChatModel,
    stores: Stores,
    workers: int,
    seconds: float,
    quiet: bool,
    clients_process: asyncio.subprocess.Process,
    config: dict[str, Any],
    panel_pid: int,
) -> LoadReport:
    """The chat throughout; alone (``quiet``), with the clients, alone again."""
    counts = model.counts
    stop = asyncio.Event()
    quiet_decisions = 0
    quiet_seconds = quiet_cpu = 0.0
    marks: dict[str, float] = {}
    loads: list[float] = []

    def ready() -> None:
        marks["began"], marks["before"] = time.perf_counter(), counts.decisions
        marks["cpu"], marks["panel"] = time.process_time(), cpu_seconds(panel_pid)
        loads.append(os.getloadavg()[0])

    async def alone() -> None:
        nonlocal quiet_decisions, quiet_seconds, quiet_cpu
        began, before, cpu = time.perf_counter(), counts.decisions, time.process_time()
        await asyncio.sleep(seconds / 2)
        quiet_decisions += counts.decisions - before
        quiet_seconds += time.perf_counter() - began
        quiet_cpu += time.process_time() - cpu
        loads.append(os.getloadavg()[0])

    async with asyncio.TaskGroup() as group:
        for number in range(workers):
            group.create_task(chat_worker(runtime, model, stores.memory, f"load-{number}", stop))
        try:
            await asyncio.sleep(0.5)  # sessions opened, pools warm
            if quiet:
                await alone()
            seen = await _run_clients(clients_process, config, ready)
            loaded_seconds = time.perf_counter() - marks["began"]
            loaded_decisions = counts.decisions - marks["before"]
            loaded_cpu = time.process_time() - marks["cpu"]
            panel_cpu = cpu_seconds(panel_pid) - marks["panel"]
            loads.append(os.getloadavg()[0])
            if quiet:
                await alone()
        finally:
            stop.set()
    return LoadReport(
        clients=seen,
        quiet_decisions=quiet_decisions,
        quiet_seconds=quiet_seconds,
        loaded_decisions=int(loaded_decisions),
        loaded_seconds=loaded_seconds,
        chat_turns=counts.turns,
        chat_failures=counts.failures[:20],
        quiet_cpu=quiet_cpu,
        loaded_cpu=loaded_cpu,
        panel_cpu=panel_cpu,
        load_average=loads,
    )


def cpu_seconds(pid: int) -> float:
    """The CPU seconds (user + system) process ``pid`` has used (``/proc/PID/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * fraction))]


def print_report(report: LoadReport) -> None:
    seen = report.clients
    print(
        f"\n{seen.requests():,} panel requests in {seen.seconds:.0f} s "
        f"({seen.requests() / seen.seconds:.0f}/s); failed: {len(seen.failures)}; "
        f"operator: {seen.settings_saved} settings saved, {seen.settings_reset} reset, "
        f"{seen.events_edited} key-event edits"
    )
    print(
        f"recorded in the store as the operator's: {report.settings_changes} settings "
        f"changes, {report.event_edits} key-event updates"
    )
    for line in sorted(set(seen.failures))[:10]:
        print("   failed:", line, f"x{seen.failures.count(line)}")
    for line in report.server_errors[:5]:
        print("   server:", line.strip()[:200])
    print(
        f"\n{'page kind':<26} {'n':>6} {'p50 ms':>7} {'p95 ms':>7} {'p99 ms':>7} {'server p99':>10}"
    )
    worst = 0.0
    for kind in sorted(seen.client_ms):
        values = seen.client_ms[kind]
        p99 = _percentile(values, 0.99)
        worst = max(worst, p99)
        server = seen.server_ms.get(kind) or [0.0]
        print(
            f"{kind:<26} {len(values):>6} {statistics.median(values):>7.1f} "
            f"{_percentile(values, 0.95):>7.1f} {p99:>7.1f} {_percentile(server, 0.99):>10.1f}"
        )
    every = [v for values in seen.client_ms.values() for v in values]
    print(
        f"{'every request':<26} {len(every):>6} {statistics.median(every):>7.1f} "
        f"{_percentile(every, 0.95):>7.1f} {_percentile(every, 0.99):>7.1f}"
    )
    print(f"\nslowest page kind's p99: {worst:.1f} ms (target <= {TARGET_P99_MS:.0f} ms)")
    ratio = report.loaded_rate / report.quiet_rate if report.quiet_rate else 0.0
    print(
        f"chat: {report.quiet_rate:.0f} decisions/s alone, {report.loaded_rate:.0f} with the "
        f"panel traffic: {ratio:.2f}x (target >= {TARGET_RATIO}x); {report.chat_turns:,} turns, "
        f"{len(report.chat_failures)} failed"
    )
    for line in report.chat_failures[:5]:
        print("   chat failed:", line[:200])
    quiet_ms = 1000 * report.quiet_cpu / report.quiet_decisions if report.quiet_decisions else 0
    loaded_ms = 1000 * report.loaded_cpu / report.loaded_decisions if report.loaded_decisions else 0
    print(
        f"CPU: the chat's process {quiet_ms:.1f} ms a decision alone, {loaded_ms:.1f} with the "
        f"panel traffic; the panel's process {1000 * report.panel_cpu / seen.requests():.1f} ms "
        f"a request ({report.panel_cpu / seen.seconds:.0%} of a core); the machine's load "
        f"average {', '.join(f'{v:.1f}' for v in report.load_average)} "
        f"({os.cpu_count()} cores)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--think", type=float, default=1.0, help="mean seconds between pages")
    options = parser.parse_args()
    dsn = os.environ.get("TOUBA_POSTGRES_DSN", "postgresql://postgres@127.0.0.1:5432/test")
    print(
        f"load: {options.workers} chat workers on PostgreSQL; {options.clients} panel clients "
        f"({options.think:g} s between pages on average) and an operator for "
        f"{options.seconds:g} s, the chat alone {options.seconds / 2:g} s before and after"
    )
    report = asyncio.run(
        run_load(
            dsn=dsn,
            seconds=options.seconds,
            workers=options.workers,
            clients=options.clients,
            think=options.think,
        )
    )
    print_report(report)


if __name__ == "__main__":
    main()

"""The database server killed (SIGKILL) while workers write: nothing acknowledged is lost.

Issue 29, item 3. A private server (``tests/_private_servers.py``: a PostgreSQL cluster
with ``fsync`` on, a ``redis-server`` with ``appendonly yes`` and ``appendfsync
always``) is killed at random moments (seeded) and restarted, while worker processes
(``bench/_server_crash_worker.py``) write to it:

- PostgreSQL: decisions (``PostgresHistoryStore`` through ``DecisionHistory.step``),
  chat turns (``ChatSession.send`` over ``PostgresMemoryStore`` and
  ``PostgresHistoryStore``) and key-event updates (``update_event``);
- Redis: decisions (``RedisHistoryStore``) and ``store.transact`` on plain records.

Each worker logs every write it saw acknowledged, fsynced, before the next. After the
last restart the workers must each be acknowledged again (they carried on), then stop;
then every acknowledged write must be in the store (``lost``), every record must pass
the store's own read and integrity check (``half_written``: ``check_record`` on the raw
conversation, a chat session's turns numbered without a gap and as many as its count, a
key event whose fields are its last update's), every reservation left must be
recoverable, and the workers must have seen only typed, retryable errors
(``DecisionHistoryStoreUnavailable``, ``DecisionHistoryBusy``,
``MemoryStoreUnavailable``), no other exception and no op running longer than its bound.

    .venv/bin/python bench/server_crashes.py [--kills 200] [--servers postgres,redis]
        [--seed N] [--workers decide,chat,events,transact]

``run_crashes`` is what ``tests/history/test_server_crashes.py`` runs, with fewer kills.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests._private_servers import (
    PrivatePostgres,
    PrivateRedis,
    ServerUnavailable,
    running_postgres,
    running_redis,
)

from bench._server_crash_worker import identity

ROOT = Path(__file__).resolve().parent.parent
OP_SECONDS = 45.0  # a worker's bound on one op (the stores' deadlines are item 2's)
CARRY_ON_SECONDS = 90.0  # after the last restart, each worker must be acknowledged again
WORKERS: dict[str, tuple[str, ...]] = {
    "postgres": ("decide", "decide", "chat", "events"),
    "redis": ("decide", "decide", "transact"),
}


@dataclass
class CrashReport:
    """What one run saw: kills, writes acknowledged, and what the checks found."""

    server: str
    seed: int
    kills: int = 0
    aof_fixes: int = 0  # Redis: restarts that needed redis-check-aof --fix (a cut file)
    acked: int = 0
    lost: list[str] = field(default_factory=list)
    half_written: list[str] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)
    untyped: list[str] = field(default_factory=list)
    timeouts: int = 0
    stalled: list[str] = field(default_factory=list)  # workers not acknowledged after the end
    recovered_by_workers: int = 0
    reserved_after: int = 0
    recovered_after: int = 0
    unrecoverable: list[str] = field(default_factory=list)
    left: Counter[str] = field(default_factory=Counter)  # reservations left, by namespace
    slowest_failure: float = 0.0  # seconds: the longest op that failed, in any worker
    seconds: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)  # seconds of each phase
    workers: list[dict[str, Any]] = field(default_factory=list)

    def row(self) -> str:
        typed = ", ".join(f"{k} {v}" for k, v in sorted(self.errors.items())) or "none"
        return (
            f"{self.server:9} seed {self.seed}: {self.kills} kills"
            f"{f' ({self.aof_fixes} append-only files repaired)' if self.aof_fixes else ''}, "
            f"{self.acked} acknowledged "
            f"writes, lost {len(self.lost)}, half-written {len(self.half_written)}, "
            f"untyped {len(self.untyped)}, timeouts {self.timeouts}, stalled "
            f"{len(self.stalled)}; typed errors: {typed} (the slowest failed op took "
            f"{self.slowest_failure:.1f} s); recovered by workers "
            f"{self.recovered_by_workers}, reservations left {self.reserved_after} "
            f"(recovered {self.recovered_after}) {dict(self.left)}; {self.seconds:.0f} s "
            f"{self.phases}"
        )


class _Run:
    def __init__(self, kind: str, server: PrivatePostgres | PrivateRedis, directory: Path) -> None:
        self.kind = kind
        self.server = server
        self.directory = directory
        tag = uuid.uuid4().hex[:8]
        self.base: dict[str, Any] = {
            "server": kind,
            "address": server.dsn if isinstance(server, PrivatePostgres) else server.url,
            "table": f"crash_{tag}",
            "memory_prefix": f"crashmem_{tag}",
            "prefix": f"crash-{tag}:",
            "stop": str(directory / "stop"),
            "op_seconds": OP_SECONDS,
        }
        self.configs: list[dict[str, Any]] = []
        self.processes: list[subprocess.Popen[str]] = []

    def start_workers(self, kinds: tuple[str, ...], pause: float) -> None:
        for index, kind in enumerate(kinds):
            name = f"w{index}{kind}"
            config = {
                **self.base,
                "kind": kind,
                "name": name,
                "acks": str(self.directory / f"{name}.acks"),
                "pause": pause,
            }
            self.configs.append(config)
            with open(self.directory / f"{name}.log", "wb") as log:  # the driver's warnings
                self.processes.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "bench._server_crash_worker", json.dumps(config)],
                        cwd=ROOT,
                        stdout=subprocess.PIPE,
                        stderr=log,
                        text=True,
                    )
                )

    def acks(self, config: dict[str, Any]) -> list[dict[str, Any]]:
        path = Path(config["acks"])
        if not path.exists():
            return []
        lines = path.read_text(encoding="utf-8").splitlines()
        return [json.loads(line) for line in lines if line.endswith("}")]

    def wait_acked(self, above: list[int], seconds: float) -> list[str]:
        """Wait until each worker has more acknowledgements than ``above``; the names of
        those that have not after ``seconds``."""
        deadline = time.monotonic() + seconds
        while True:
            late = [
                c["name"]
                for c, before in zip(self.configs, above, strict=True)
                if len(self.acks(c)) <= before
            ]
            if not late or time.monotonic() > deadline:
                return late
            time.sleep(0.1)

    def stop_workers(self, report: CrashReport) -> None:
        Path(self.base["stop"]).touch()
        for process, config in zip(self.processes, self.configs, strict=True):
            try:
                out, _ = process.communicate(timeout=OP_SECONDS + 30)
            except subprocess.TimeoutExpired:
                process.kill()
                out, _ = process.communicate()
                report.stalled.append(f"{config['name']} did not stop")
            lines = [line for line in out.splitlines() if line.startswith("{")]
            if process.returncode != 0 or not lines:
                report.untyped.append(f"{config['name']} exited {process.returncode}")
                continue
            seen = json.loads(lines[-1])
            report.workers.append(seen)
            report.errors.update(seen["errors"])
            report.untyped.extend(f"{config['name']}: {u}" for u in seen["untyped"])
            report.timeouts += seen["timeouts"]
            report.recovered_by_workers += seen["recovered"]
            report.slowest_failure = max(report.slowest_failure, seen["slowest_failure"])


async def _prepare(run: _Run) -> None:
    """Create the tables once, before the workers (who would race to create them)."""
    if run.kind != "postgres":
        return
    from touba.history.postgres import PostgresHistoryStore
    from touba.memory import PostgresMemoryStore

    async with PostgresHistoryStore(run.base["address"], table=run.base["table"]):
        pass
    async with PostgresMemoryStore(dsn=run.base["address"], prefix=run.base["memory_prefix"]):
        pass


def _rows_around(raw: Any, problem: Any) -> str:
    """The stored totals and, for the rows near ``problem`` (a row or exchange number in
    its ``where``), each row's exchange, role and call ids: the test's own data, no user's."""
    numbers = [int(n) for n in re.findall(r"\d+", problem.where)]
    if problem.where.startswith("row") and numbers:
        centre = numbers[0]
    else:
        exchange = numbers[0] if numbers else len(raw.rows)
        centre = next((i for i, r in enumerate(raw.rows) if r.exchange == exchange), 0)
    shown = []
    for i in range(max(0, centre - 6), min(len(raw.rows), centre + 6)):
        row = raw.rows[i]
        try:
            body = json.loads(row.body)
        except ValueError:
            body = {}
        ids = re.findall(r'"(?:call_id|id)": ?"([^"]+)"', json.dumps(body))
        role = body.get("kind") or body.get("role") or body.get("type")
        shown.append(f"{i}:x{row.exchange}:{role}:{','.join(ids)}")
    try:
        head = json.loads(raw.head)
    except ValueError:
        head = {}
    pending = [p.get("call_id") for p in head.get("pending") or []]
    totals = (
        f"{raw.exchanges} exchanges, {raw.messages} messages, {len(raw.rows)} rows; head "
        f"stats {head.get('stats')}, pending {pending}"
    )
    return f"{totals}; rows {' '.join(shown)}"


async def _check(run: _Run, report: CrashReport) -> None:
    """After the workers stopped: acknowledged writes present, records whole,
    reservations recoverable."""
    from bench._server_crash_worker import history_store
    from touba.history import check_record

    store = history_store(run.base)
    try:
        for row in await store.list(None, purge=False):
            if row.reservation is not None:
                report.reserved_after += 1
                report.left[_namespace_of(row.key)] += 1
                if await store.recover(row.key, worker_stopped=True):
                    report.recovered_after += 1
                else:
                    report.unrecoverable.append(row.key)
        for config in run.configs:
            acks = run.acks(config)
            report.acked += len(acks)
            name = config["name"]
            if config["kind"] == "decide":
                key = identity(name).key
                raw = await store.read_raw(key)
                if raw is not None:
                    problems = check_record(raw)
                    report.half_written += [f"{name}: {p.kind} at {p.where}" for p in problems]
                    if problems:  # what the rows around the first problem hold, to explain it
                        report.half_written.append(f"{name}: {_rows_around(raw, problems[0])}")
                record = await store.read(key)
                text = json.dumps(record)
                report.lost += [
                    f"{name}: {a['call_id']}" for a in acks if f'"{a["call_id"]}"' not in text
                ]
            elif config["kind"] == "transact":
                record = await store.read(f"transact:{name}")
                values = [] if record is None else record["values"]
                if values != sorted(set(values)):
                    report.half_written.append(f"{name}: values out of order or repeated")
                report.lost += [f"{name}: {a['n']}" for a in acks if a["n"] not in values]
            elif config["kind"] == "chat":
                await _check_chat(run, config, acks, report)
            elif config["kind"] == "events":
                await _check_events(run, config, acks, report)
    finally:
        await store.close()


def _namespace_of(key: str) -> str:
    """The workers' namespace a conversation key (``th1:<ns hash>:...``) belongs to."""
    import hashlib

    for name in ("crashes", "chat"):
        if key.startswith(f"th1:{hashlib.sha256(name.encode()).hexdigest()[:12]}:"):
            return name
    return "other"


async def _check_chat(
    run: _Run, config: dict[str, Any], acks: list[dict[str, Any]], report: CrashReport
) -> None:
    from touba.memory import PostgresMemoryStore

    name = config["name"]
    async with PostgresMemoryStore(dsn=run.base["address"], prefix=run.base["memory_prefix"]) as m:
        meta = await m.get_session(name)
        turns = await m.list_turns(name, limit=1_000_000)
    stored = {turn.index: turn.user for turn in turns}
    if sorted(stored) != list(range(len(stored))):
        report.half_written.append(f"{name}: turn numbers with a gap")
    if meta is not None and meta.turns != len(stored):
        report.half_written.append(f"{name}: {meta.turns} turns counted, {len(stored)} stored")
    report.lost += [
        f"{name}: turn {a['index']}" for a in acks if stored.get(a["index"]) != a["user"]
    ]


async def _check_events(
    run: _Run, config: dict[str, Any], acks: list[dict[str, Any]], report: CrashReport
) -> None:
    from touba.memory import PostgresMemoryStore

    name = config["name"]
    created = [a["event_id"] for a in acks if "event_id" in a]
    if not created:
        return
    async with PostgresMemoryStore(dsn=run.base["address"], prefix=run.base["memory_prefix"]) as m:
        event = await m.get_event(f"user:{name}", created[0])
    if event is None:
        report.lost.append(f"{name}: the event")
        return
    history = event.history or ()
    applied = {update.op_id for update in history}
    report.lost += [
        f"{name}: {a['op_id']}" for a in acks if "op_id" in a and a["op_id"] not in applied
    ]
    if history and event.details != history[-1].changes[-1].new:
        report.half_written.append(f"{name}: the event's details are not its last update's")


def run_crashes(
    kind: str,
    server: PrivatePostgres | PrivateRedis,
    *,
    kills: int,
    seed: int,
    up: tuple[float, float] = (0.2, 1.2),
    down: tuple[float, float] = (0.0, 0.4),
    pause: float = 0.0,
    workers: tuple[str, ...] | None = None,
) -> CrashReport:
    """Kill ``server`` ``kills`` times (each after ``up`` seconds of traffic, restarted
    after ``down``), with ``workers`` (``WORKERS[kind]`` by default) writing; then check."""
    rng = random.Random(seed)
    report = CrashReport(kind, seed)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="touba-crashes-") as directory:
        run = _Run(kind, server, Path(directory))
        asyncio.run(_prepare(run))
        run.start_workers(workers or WORKERS[kind], pause)
        phase = time.monotonic()

        def lap(name: str) -> None:
            nonlocal phase
            report.phases[name] = round(time.monotonic() - phase, 1)
            phase = time.monotonic()

        try:
            report.stalled += [
                f"{n}: no write acknowledged before the first kill"
                for n in run.wait_acked([0] * len(run.configs), CARRY_ON_SECONDS)
            ]
            lap("start")
            for _ in range(kills):
                time.sleep(rng.uniform(*up))
                server.kill9()
                report.kills += 1
                time.sleep(rng.uniform(*down))
                server.restart()
            report.aof_fixes = getattr(server, "aof_fixes", 0)
            lap("kills")
            before = [len(run.acks(c)) for c in run.configs]
            report.stalled += [
                f"{n}: no write acknowledged after the last restart"
                for n in run.wait_acked(before, CARRY_ON_SECONDS)
            ]
            lap("carry on")
        finally:
            if not server.running:
                server.restart()
            run.stop_workers(report)
            lap("stop")
        asyncio.run(_check(run, report))
        lap("check")
    report.seconds = time.monotonic() - started
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--kills", type=int, default=200)
    parser.add_argument("--servers", default="postgres,redis")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument(
        "--workers", default=None, help="kinds of worker, comma-separated (default: WORKERS)"
    )
    args = parser.parse_args()
    kinds = None if args.workers is None else tuple(args.workers.split(","))
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    print(f"seed {seed} (rerun with --seed {seed}); {args.kills} kills per server")
    failed = False
    for kind in args.servers.split(","):
        starting = running_postgres if kind == "postgres" else running_redis
        try:
            with starting() as server:
                report = run_crashes(kind, server, kills=args.kills, seed=seed, workers=kinds)
        except ServerUnavailable as e:
            print(f"{kind:9} skipped: {e}")
            continue
        print(report.row())
        for problem in [*report.lost, *report.half_written, *report.untyped, *report.stalled]:
            print(f"  {problem}")
        failed = failed or bool(report.lost or report.half_written or report.untyped)
    if os.environ.get("CI") and failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()

"""``touba worker``: run the key-event extraction jobs of a memory store.

Sessions of ``kind="agent"``/``"flow"`` agents queue a durable job when they
end. The worker claims due jobs (with a lease: several workers may share the
file; a job whose worker died is claimed again once its lease expires), asks
the job's agent's model for the ops (the agent comes from ``--program``) and
applies them idempotently. A failed attempt is retried with backoff; a job
out of attempts stays ``failed`` (``touba events jobs --status failed``).
The store is a SQLite file (``--db``) or PostgreSQL (``--dsn`` or
``TOUBA_DSN``), where workers on many hosts share one queue. With ``--once``
on a terminal, a progress bar counts the jobs due when it started.

With retention bounds (``--turns-days``, ``--events-closed-days``, ``--traces-days``;
``--checkpoints-days`` with ``--checkpoints-db`` or ``--checkpoints-dsn``) the worker
also applies that :class:`touba.data.Retention` every ``--retention-every`` seconds
(first at start), as ``touba purge`` would, and prints its counts (never content).
"""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack
from typing import Annotated, Any

import typer
from rich.markup import escape

from touba.cli._common import console, progress
from touba.cli._deployment import (
    CheckpointsDbOption,
    CheckpointsDsnOption,
    Deployment,
    deployment,
    open_stores,
)
from touba.cli._events import Db, PrefixOption, memory_target, open_store
from touba.cli._programs import ProgramOption, load_program
from touba.cli._purge import (
    CheckpointsDaysOption,
    DaysOption,
    EventsDaysOption,
    TracesDaysOption,
    retention_of,
)
from touba.cli._stores import DsnOption
from touba.data import RetentionReport
from touba.memory import ExtractionJob, ExtractionWorker, MemoryStore

_DUE_SCAN = 10_000


def report_job(job: ExtractionJob) -> None:
    line = f"job {job.id} (session {escape(job.session_id)}, agent {escape(job.agent_ref)}): "
    if job.status == "done":
        result = job.result if isinstance(job.result, dict) else {}
        created, updated = result.get("created") or [], result.get("updated") or []
        rejected = result.get("rejected") or []
        console.print(
            line + f"[green]done[/]: {len(created)} created, {len(updated)} updated, "
            f"{len(rejected)} rejected"
        )
    elif job.status == "failed":
        console.print(line + f"[red]failed[/] after {job.attempts} attempt(s): ", end="")
        console.print(job.last_error or "", markup=False)
    else:
        console.print(
            line + f"[yellow]{job.status}[/] (attempt {job.attempts}/{job.max_attempts}; next "
            f"at {job.next_attempt_at.isoformat(timespec='seconds')}): ",
            end="",
        )
        console.print(job.last_error or "", markup=False)


async def _due(store: MemoryStore) -> int:
    """How many pending jobs are due now (the progress bar's total; an estimate,
    since other workers may claim some, and leases may expire meanwhile)."""
    now = store.now()
    pending = await store.list_jobs(status="pending", limit=_DUE_SCAN)
    return sum(job.next_attempt_at <= now for job in pending)


def report_retention(report: RetentionReport) -> None:
    """One line of a retention the worker applied: counts per store and kind."""
    parts = [
        f"{store} {kind} {count}"
        for store, kinds in report.counts.items()
        for kind, count in kinds.items()
    ]
    console.print(f"retention: {report.total} removed ({', '.join(parts) or 'nothing set'})")


def worker(
    db: Db = None,
    dsn: DsnOption = None,
    prefix: PrefixOption = None,
    program: ProgramOption = None,
    once: Annotated[bool, typer.Option("--once", help="Run the jobs due now, then exit.")] = False,
    poll_seconds: Annotated[
        float, typer.Option("--poll-seconds", min=0.05, help="Pause when no job is due.")
    ] = 2.0,
    turns_days: DaysOption = None,
    events_closed_days: EventsDaysOption = None,
    traces_days: TracesDaysOption = None,
    checkpoints_days: CheckpointsDaysOption = None,
    checkpoints_db: CheckpointsDbOption = None,
    checkpoints_dsn: CheckpointsDsnOption = None,
    retention_every: Annotated[
        float,
        typer.Option(
            "--retention-every", min=1, help="Seconds between two applications of the retention."
        ),
    ] = 3600.0,
) -> None:
    """Claim and run key-event extraction jobs (kind agent/flow) with your agents' models."""
    retention = retention_of(turns_days, events_closed_days, checkpoints_days, traces_days)
    checkpoint_target: Deployment | None = None
    if checkpoints_db is not None or checkpoints_dsn is not None:
        checkpoint_target = deployment(
            checkpoints_db=checkpoints_db, checkpoints_dsn=checkpoints_dsn
        )
    if checkpoints_days is not None and checkpoint_target is None:
        raise typer.BadParameter(
            "--checkpoints-days needs the checkpoint store: --checkpoints-db or --checkpoints-dsn"
        )
    loaded = load_program(program)
    target = memory_target(db, dsn, prefix)

    async def go() -> None:
        async with AsyncExitStack() as stack:
            store = await stack.enter_async_context(open_store(target))
            checkpoints: Any = None
            if checkpoint_target is not None:
                stores = await stack.enter_async_context(open_stores(checkpoint_target))
                checkpoints = stores.checkpoints
            runner = ExtractionWorker(
                loaded,
                store,
                retention=retention if retention.configured else None,
                retention_every=retention_every,
                checkpoints=checkpoints,
                on_retention=report_retention,
            )
            console.print(f"worker {escape(runner.worker_id)} on {escape(target.backend.shown)}")
            if once:
                count = 0
                with progress(total=True) as shown:
                    task = shown.add_task("extraction jobs", total=await _due(store) or None)
                    while (job := await runner.run_job()) is not None:
                        report_job(job)
                        count += 1
                        shown.advance(task)
                console.print(f"{count} job attempt(s) run")
                return
            while True:
                jobs = await runner.run_due()
                for job in jobs:
                    report_job(job)
                if not jobs:
                    await asyncio.sleep(poll_seconds)

    try:
        target.backend.run(go())
    except KeyboardInterrupt:
        console.print("stopped")

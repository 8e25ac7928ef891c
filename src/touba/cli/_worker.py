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
"""

from __future__ import annotations

import asyncio
from typing import Annotated

import typer
from rich.markup import escape

from touba.cli._common import console, progress
from touba.cli._events import Db, PrefixOption, memory_target, open_store
from touba.cli._programs import ProgramOption, load_program
from touba.cli._stores import DsnOption
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


def worker(
    db: Db = None,
    dsn: DsnOption = None,
    prefix: PrefixOption = None,
    program: ProgramOption = None,
    once: Annotated[bool, typer.Option("--once", help="Run the jobs due now, then exit.")] = False,
    poll_seconds: Annotated[
        float, typer.Option("--poll-seconds", min=0.05, help="Pause when no job is due.")
    ] = 2.0,
) -> None:
    """Claim and run key-event extraction jobs (kind agent/flow) with your agents' models."""
    loaded = load_program(program)
    target = memory_target(db, dsn, prefix)

    async def go() -> None:
        async with open_store(target) as store:
            runner = ExtractionWorker(loaded, store)
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

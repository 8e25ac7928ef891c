"""``touba purge``: apply a retention to a deployment's stores now.

The stores are those of :mod:`touba.cli._deployment` (``--db``/``--dsn`` memory,
``--history-db``/``--history-dsn``/``--redis-url``, ``--checkpoints-db``/
``--checkpoints-dsn``; ``--resources-*`` are accepted and left alone: resource values
have no age). The bounds, in days, are :class:`touba.data.Retention`'s; a bound not
given keeps its kind, so a ``touba purge`` with none deletes only the decision
histories already expired, as ``touba history purge`` does on one history store.
``--dry-run`` counts what would go and deletes nothing. The table (or ``--json``)
gives counts per store and kind, never content.
"""

from __future__ import annotations

from typing import Annotated

import typer

from touba.cli._common import JsonOption, console, print_json, print_table, progress, table
from touba.cli._deployment import (
    CheckpointsDbOption,
    CheckpointsDsnOption,
    MemoryDbOption,
    MemoryPrefixOption,
    ResourcesDbOption,
    ResourcesDsnOption,
    deployment,
    open_stores,
)
from touba.cli._keys import CurrentOption, KeysFileOption
from touba.cli._stores import (
    DsnOption,
    HistoryDbOption,
    HistoryDsnOption,
    HistoryPrefixOption,
    HistoryTableOption,
    RedisUrlOption,
)
from touba.data import Retention, RetentionReport, apply_retention
from touba.errors import ConfigurationError

__all__ = ["DaysOption", "purge", "report_table", "retention_of"]


def _days(flag: str, what: str) -> object:
    return typer.Option(
        flag, help=f"Keep {what} this many days (a positive number; default: kept)."
    )


DaysOption = Annotated[float | None, _days("--turns-days", "chat turns")]
EventsDaysOption = Annotated[
    float | None, _days("--events-closed-days", "closed key events (from their last change)")
]
CheckpointsDaysOption = Annotated[
    float | None, _days("--checkpoints-days", "checkpoints awaiting approval or failed")
]
TracesDaysOption = Annotated[
    float | None, _days("--traces-days", "turns' tool traces and context records")
]

_KIND_NAMES = {
    "turns": "chat turns",
    "sessions": "ended sessions left empty",
    "extraction_jobs": "finished extraction jobs",
    "key_events": "closed key events",
    "key_event_updates": "their update history rows",
    "traces": "turns' traces and contexts dropped",
    "checkpoints": "checkpoints",
    "conversations": "expired decision histories",
}


def retention_of(
    turns_days: float | None,
    events_closed_days: float | None,
    checkpoints_days: float | None,
    traces_days: float | None,
) -> Retention:
    """The :class:`Retention` of these options; a bad one is a usage error (exit 2)."""
    try:
        return Retention(
            turns_days=turns_days,
            events_closed_days=events_closed_days,
            checkpoints_days=checkpoints_days,
            traces_days=traces_days,
        )
    except ConfigurationError as e:
        message = str(e)
        for name in ("turns_days", "events_closed_days", "checkpoints_days", "traces_days"):
            message = message.replace(name, "--" + name.replace("_", "-"))
        raise typer.BadParameter(message) from e


def report_table(report: RetentionReport) -> None:
    """The counts of ``report`` as a table (``store``, ``what``, ``count``)."""
    heading = "would remove" if report.dry_run else "removed"
    shown = table("store", "what", heading)
    for store, kinds in report.counts.items():
        for kind, count in kinds.items():
            shown.add_row(store, _KIND_NAMES.get(kind, kind), str(count))
    print_table(shown)


def purge(
    db: MemoryDbOption = None,
    dsn: DsnOption = None,
    prefix: MemoryPrefixOption = None,
    history_db: HistoryDbOption = None,
    history_dsn: HistoryDsnOption = None,
    history_table: HistoryTableOption = None,
    redis_url: RedisUrlOption = None,
    history_prefix: HistoryPrefixOption = None,
    checkpoints_db: CheckpointsDbOption = None,
    checkpoints_dsn: CheckpointsDsnOption = None,
    resources_db: ResourcesDbOption = None,
    resources_dsn: ResourcesDsnOption = None,
    keys_file: KeysFileOption = None,
    current: CurrentOption = None,
    turns_days: DaysOption = None,
    events_closed_days: EventsDaysOption = None,
    checkpoints_days: CheckpointsDaysOption = None,
    traces_days: TracesDaysOption = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Count what would go; delete nothing.")
    ] = False,
    as_json: JsonOption = False,
) -> None:
    """Delete what the retention no longer keeps (old turns, closed key events,
    abandoned checkpoints, old traces) and the expired decision histories, in batches."""
    retention = retention_of(turns_days, events_closed_days, checkpoints_days, traces_days)
    target = deployment(
        db,
        dsn,
        prefix,
        history_db,
        history_dsn,
        history_table,
        redis_url,
        history_prefix,
        checkpoints_db,
        checkpoints_dsn,
        resources_db,
        resources_dsn,
        keys_file,
        current,
    )

    async def go() -> RetentionReport:
        async with open_stores(target) as stores:
            with progress(total=False) as shown:
                shown.add_task("counting" if dry_run else "purging", total=None)
                return await apply_retention(stores, retention, dry_run=dry_run)

    report = target.run(go())
    if as_json:
        print_json(report.as_json())
        return
    report_table(report)
    if dry_run:
        console.print(f"dry run: {report.total} would be removed; nothing was deleted")
    else:
        console.print(f"removed {report.total} in all")

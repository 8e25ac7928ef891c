"""``touba export`` and ``touba import``: one user's (or one session's, conversation's,
namespace's) records in the export format (docs/data/export.md), and back.

- The stores are a deployment's (:mod:`touba.cli._deployment`: ``--db``/``--dsn`` memory,
  ``--history-db``/``--history-dsn``/``--redis-url``, ``--checkpoints-*``,
  ``--resources-*``); none is created: import into stores that exist.
- ``touba export``: exactly one of ``--user``, ``--session``, ``--conversation``,
  ``--namespace`` (exit 2 otherwise). The file goes to stdout, or to ``-o FILE``
  (created or truncated, mode 0600; the count is printed on stderr). Nothing is written
  to the stores.
- ``touba import FILE``: the whole file is checked, and every record looked up, before
  anything is written; a refusal (damaged line, newer version, conflict, a bound) is one
  line with its line number, exit 1, the stores untouched. Then a table of the records
  added and already present, per kind.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, BinaryIO, cast

import typer
from rich.markup import escape

from touba.cli._common import console, errors, print_table, store_command, table
from touba.cli._deployment import DEPLOYMENT_OPTIONS, Deployment, deployment, open_stores
from touba.data import import_records, write_export
from touba.history import HistoryConfig

__all__ = ["register"]

_SELECTIONS = ("user", "session", "conversation", "namespace")


def register(app: typer.Typer) -> None:
    """Add ``touba export`` and ``touba import`` to ``app``."""
    store_command(app, "export", options=DEPLOYMENT_OPTIONS, target=deployment)(export)
    store_command(app, "import", options=DEPLOYMENT_OPTIONS, target=deployment)(import_file)


def export(
    target: Deployment,
    user: Annotated[
        str | None, typer.Option("--user", help="Every record of this user id.")
    ] = None,
    session: Annotated[
        str | None, typer.Option("--session", help="One chat session and what it made.")
    ] = None,
    conversation: Annotated[
        str | None, typer.Option("--conversation", help="One decision history, by its key.")
    ] = None,
    namespace: Annotated[
        str | None, typer.Option("--namespace", help="Every decision history of a namespace.")
    ] = None,
    output: Annotated[
        Path | None,
        typer.Option("-o", "--output", help="Write to this file (mode 0600), not to stdout."),
    ] = None,
) -> None:
    """Export records in touba's JSON Lines format (docs/data/export.md)."""
    given = {
        name: value
        for name, value in zip(_SELECTIONS, (user, session, conversation, namespace), strict=True)
        if value is not None
    }
    if len(given) != 1:
        errors.print(
            "[bold red]usage[/]: give exactly one of --user, --session, --conversation, --namespace"
        )
        raise typer.Exit(2)

    async def main() -> int:
        async with open_stores(target) as stores:
            out: BinaryIO | Path = output if output is not None else sys.stdout.buffer
            return await write_export(stores, out, **given)

    count = target.run(main())
    if output is not None:
        errors.print(f"exported {count} records to {escape(str(output))}")


def import_file(
    target: Deployment,
    file: Annotated[
        Path,
        typer.Argument(
            help="An export file (touba export).", exists=True, dir_okay=False, readable=True
        ),
    ],
    max_retained_bytes: Annotated[
        int | None,
        typer.Option(
            "--max-retained-bytes",
            min=1,
            help="The bound conversations must keep (the application's HistoryConfig; "
            "default 8 MiB).",
        ),
    ] = None,
    max_messages: Annotated[
        int | None,
        typer.Option(
            "--max-messages",
            min=1,
            help="The most messages one exchange may hold (HistoryConfig; default 128).",
        ),
    ] = None,
) -> None:
    """Import an export file: checked whole first, idempotent, nothing cut."""
    defaults = HistoryConfig()
    bounds = HistoryConfig(
        max_retained_bytes=max_retained_bytes or defaults.max_retained_bytes,
        max_messages=max_messages or defaults.max_messages,
    )

    async def main() -> tuple[dict[str, int], dict[str, int]]:
        async with open_stores(target) as stores:
            with file.open("rb") as lines:
                report = await import_records(stores, cast(BinaryIO, lines), history_config=bounds)
        return dict(report.added), dict(report.present)

    added, present = target.run(main())
    shown = table("kind", "added", "already present")
    for kind in sorted(set(added) | set(present)):
        shown.add_row(kind, str(added.get(kind, 0)), str(present.get(kind, 0)))
    print_table(shown)
    console.print(
        f"imported {sum(added.values())} records; {sum(present.values())} were already there"
    )

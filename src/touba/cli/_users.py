"""``touba users``: erase one user from every store of a deployment, and check it.

The stores are given as in :mod:`touba.cli._deployment` (``--db``/``--dsn`` memory,
``--history-db``/``--history-dsn``/``--redis-url``, ``--checkpoints-db``/
``--checkpoints-dsn``, ``--resources-db``/``--resources-dsn``); nothing is created.

- ``touba users erase USER`` shows what belongs to the user (counts only), asks for
  confirmation unless ``--yes``, erases (:func:`touba.erase_user`) and prints the
  receipt (counts per store and kind, the time, the user id hashed) as a table, or as
  JSON with ``--json``. ``--run-id`` (repeatable) adds runs of the user's invoked outside
  a chat session; ``--force`` frees the user's conversations a stopped worker still
  holds and erases its running checkpoints (without it, they refuse the erase: exit 1).
- ``touba users verify USER`` prints what is left (:func:`touba.verify_erased`) and
  exits 1 when something is.

No command prints the user's content, and the receipt never names the user.
"""

from __future__ import annotations

import functools
from typing import Annotated

import typer
from rich.markup import escape

from touba.cli._common import JsonOption, console, errors, print_json, print_table, store_command
from touba.cli._common import table as make_table
from touba.cli._deployment import DEPLOYMENT_OPTIONS, Deployment, deployment, open_stores
from touba.data import ErasureReceipt, erase_user, verify_erased

app = typer.Typer(
    help="Erase one user's data from every store of a deployment, and verify it.",
    no_args_is_help=True,
)

User = Annotated[str, typer.Argument(help="The user id (as the host passes it as user_id).")]
RunIds = Annotated[
    list[str] | None,
    typer.Option(
        "--run-id", help="A run of the user's outside a chat session (repeat the option)."
    ),
]

_command = functools.partial(store_command, app, options=DEPLOYMENT_OPTIONS, target=deployment)


def _counts_table(counts: dict[str, dict[str, int]], title: str) -> None:
    shown = make_table("store", "kind", "rows", title=title)
    for store, kinds in sorted(counts.items()):
        for kind, n in sorted(kinds.items()):
            shown.add_row(escape(store), escape(kind), str(n))
    print_table(shown)


def _print_receipt(receipt: ErasureReceipt, raw: bool) -> None:
    if raw:
        print_json(receipt.as_json())
        return
    if receipt.counts:
        _counts_table({k: dict(v) for k, v in receipt.counts.items()}, "erased")
    console.print(f"user sha256 {receipt.user_hash}")
    console.print(f"erased at {receipt.erased_at.isoformat(timespec='seconds')}")
    console.print(f"{receipt.total} row(s) erased")


@_command("erase")
def erase(
    target: Deployment,
    user: User,
    run_id: RunIds = None,
    force: Annotated[
        bool,
        typer.Option(
            "--force",
            help="Free the user's conversations a stopped worker holds, erase its running "
            "checkpoints.",
        ),
    ] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
    raw: JsonOption = False,
) -> None:
    """Erase every row of USER in the given stores, then print the receipt."""
    run_ids = tuple(run_id or ())

    async def found() -> dict[str, dict[str, int]]:
        async with open_stores(target) as stores:
            return await verify_erased(user, stores, run_ids=run_ids)

    if not yes:
        existing = target.run(found())
        if not existing:
            errors.print("nothing of this user in these stores; nothing to erase")
            raise typer.Exit(0)
        _counts_table(existing, "to erase")
        if not typer.confirm(
            "Erase these rows for good? Backups and copies of the stores are not touched",
            default=False,
        ):
            errors.print("nothing erased")
            raise typer.Exit(1)

    async def go() -> ErasureReceipt:
        async with open_stores(target) as stores:
            return await erase_user(user, stores, run_ids=run_ids, force=force)

    _print_receipt(target.run(go()), raw)


@_command("verify")
def verify(target: Deployment, user: User, run_id: RunIds = None, raw: JsonOption = False) -> None:
    """Print what is left of USER in the given stores; exit 1 when something is."""

    async def go() -> dict[str, dict[str, int]]:
        async with open_stores(target) as stores:
            return await verify_erased(user, stores, run_ids=tuple(run_id or ()))

    left = target.run(go())
    if raw:
        print_json(left)
    elif left:
        _counts_table(left, "left")
    else:
        console.print("nothing left of this user")
    if left:
        raise typer.Exit(1)

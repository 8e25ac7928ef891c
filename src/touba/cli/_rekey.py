"""``touba rekey``: re-seal an encrypted store with its current key (key rotation).

Decisions:

- **Keys.** ``--keys-file PATH`` holds a JSON object ``{"key_id": "<base64 key>"}``
  (every key still in use, the new one included) and ``--current KEY_ID`` names
  the key new seals use (the only key by default); loaded by :mod:`touba.cli._keys`,
  which refuses a file that is not a regular 0600 file and never prints a key.
- **Stores.** Every store of the deployment options (:mod:`touba.cli._deployment`):
  the decision-history store (``--history-db`` / ``--history-dsn`` / ``--redis-url``),
  the memory store (``--db`` / ``--dsn``), the checkpoint store and the resource
  binding; the command calls ``rekey()`` on each one it opened, until it returns 0.
- **Progress.** ``rekey(batch=...)`` is called until it returns 0; for a history
  store a bar counts the stored values (heads and messages) still sealed with another
  key, recounted
  after each batch (``key_ids()``, which reads every row: a larger ``--batch``
  reads less often). Each conversation is re-sealed atomically under the store's
  reservation, so the command may be stopped at any time and run again: it finds
  only what is left. Old keys stay in the file until it reports nothing left.
- **Outcome.** A table of values per key id. Exit 1 when values remain under
  another key (conversations in use, or that do not open: both named in the log
  by their key, without content), so a script knows to run it again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from touba.cli._common import JsonOption, console, errors, print_json, print_table, progress
from touba.cli._common import table as make_table
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
from touba.cli._keys import CurrentOption, load_keys
from touba.cli._stores import (
    DsnOption,
    HistoryDbOption,
    HistoryDsnOption,
    HistoryPrefixOption,
    HistoryTableOption,
    RedisUrlOption,
)

__all__ = ["load_keys", "rekey"]

KeysFile = Annotated[
    Path,
    typer.Option(
        "--keys-file",
        help='JSON {"key_id": "<base64 key>"} of every key in use (mode 0600, not a symlink).',
    ),
]
Batch = Annotated[
    int, typer.Option("--batch", min=1, help="Conversations or rows re-sealed per call (100).")
]


def _stale(counts: dict[str | None, int], current: str) -> int:
    return sum(n for key_id, n in counts.items() if key_id != current)


async def _rekey_history(store: Any, current: str, batch: int) -> tuple[int, dict[str | None, int]]:
    """Re-seal one history store, its bar counting the values left; (conversations
    re-sealed, values per key id afterwards)."""
    resealed = 0
    before = await store.key_ids()
    with progress(total=True) as shown:
        task = shown.add_task(f"re-sealing with {current}", total=_stale(before, current))
        while done := await store.rekey(batch=batch):
            resealed += done
            left = _stale(await store.key_ids(), current)
            shown.update(task, completed=_stale(before, current) - left)
    return resealed, dict(await store.key_ids())


async def _rekey_rows(store: Any, what: str, current: str, batch: int) -> int:
    """Re-seal one memory, checkpoint or resource store; the rows re-sealed."""
    resealed = 0
    with progress(total=False) as shown:
        shown.add_task(f"re-sealing the {what} with {current}", total=None)
        while done := await store.rekey(batch=batch):
            resealed += done
    return resealed


def rekey(
    keys_file: KeysFile,
    current: CurrentOption = None,
    history_db: HistoryDbOption = None,
    history_dsn: HistoryDsnOption = None,
    history_table: HistoryTableOption = None,
    redis_url: RedisUrlOption = None,
    history_prefix: HistoryPrefixOption = None,
    db: MemoryDbOption = None,
    dsn: DsnOption = None,
    prefix: MemoryPrefixOption = None,
    checkpoints_db: CheckpointsDbOption = None,
    checkpoints_dsn: CheckpointsDsnOption = None,
    resources_db: ResourcesDbOption = None,
    resources_dsn: ResourcesDsnOption = None,
    batch: Batch = 100,
    as_json: JsonOption = False,
) -> None:
    """Re-seal encrypted stores with the --current key, resumably (key rotation)."""
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
    if target.encryption is None:  # never: --keys-file is required
        raise typer.Exit(2)
    new = target.encryption.current

    async def go() -> dict[str, Any]:
        resealed = 0
        counts: dict[str | None, int] = {}
        rows: dict[str, int] = {}
        async with open_stores(target) as stores:
            for store in stores.histories:
                done, found = await _rekey_history(store, new, batch)
                resealed += done
                for key_id, n in found.items():
                    counts[key_id] = counts.get(key_id, 0) + n
            others = (
                ("memory", stores.memory),
                ("checkpoints", stores.checkpoints),
                ("resources", stores.resources),
            )
            for what, one in others:
                if one is not None:
                    rows[what] = await _rekey_rows(one, what, new, batch)
        return {"resealed": resealed, "values": counts, "rows": rows}

    outcome = target.run(go())
    values: dict[str | None, int] = outcome["values"]
    rows: dict[str, int] = outcome["rows"]
    left = _stale(values, new)
    if as_json:
        print_json(
            {
                "resealed_conversations": outcome["resealed"],
                "resealed_rows": rows,
                "current": new,
                "values_by_key_id": {str(k) if k else "(not sealed)": n for k, n in values.items()},
                "left": left,
            }
        )
    else:
        if target.history is not None:
            shown = make_table("key id", "values (heads and messages)")
            for key_id, n in sorted(values.items(), key=lambda item: str(item[0])):
                shown.add_row(key_id or "(not sealed)", str(n))
            print_table(shown)
            console.print(f"re-sealed {outcome['resealed']} conversation(s) with {new}")
        for what, n in rows.items():
            console.print(f"re-sealed {n} {what} row(s) with {new}")
    if left:
        errors.print(
            f"[bold yellow]{left} value(s) are still sealed with another key (or not "
            "sealed): conversations in use, or that do not open (see the log). Run "
            "`touba rekey` again; keep the old keys until nothing is left."
        )
        raise typer.Exit(1)

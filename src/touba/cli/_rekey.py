"""``touba rekey``: re-seal an encrypted store with its current key (key rotation).

Decisions:

- **Keys.** ``--keys-file PATH`` holds a JSON object ``{"key_id": "<base64 key>"}``
  (every key still in use, the new one included) and ``--current KEY_ID`` names
  the key new seals use. The file is refused unless it is a regular file, not a
  symbolic link, readable by its owner only (mode 0600 or 0400); nothing of its
  content is ever printed, a bad entry is named by its key id at most.
- **Stores.** The decision-history store of ``--history-db`` / ``--history-dsn``
  (``--history-table``) / ``--redis-url`` (``--history-prefix``), as the panel and
  ``touba check`` name it; the command calls ``rekey()`` on every store it opened
  that has the method. (Memory, checkpoint and resource stores gain the method on
  their own; the command names them once they take ``encryption=``.)
- **Progress.** ``rekey(batch=...)`` is called until it returns 0; a bar counts
  the stored values (heads and messages) still sealed with another key, recounted
  after each batch (``key_ids()``, which reads every row: a larger ``--batch``
  reads less often). Each conversation is re-sealed atomically under the store's
  reservation, so the command may be stopped at any time and run again: it finds
  only what is left. Old keys stay in the file until it reports nothing left.
- **Outcome.** A table of values per key id. Exit 1 when values remain under
  another key (conversations in use, or that do not open: both named in the log
  by their key, without content), so a script knows to run it again.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import stat
from pathlib import Path
from typing import Annotated, Any

import typer

from touba._encryption import Encryption
from touba.cli._common import JsonOption, console, errors, print_json, print_table, progress
from touba.cli._common import table as make_table
from touba.cli._stores import (
    Backend,
    HistoryDbOption,
    HistoryDsnOption,
    HistoryPrefixOption,
    HistoryTableOption,
    Kind,
    RedisUrlOption,
    open_history,
)
from touba.errors import ConfigurationError

__all__ = ["load_keys", "rekey"]

KeysFile = Annotated[
    Path,
    typer.Option(
        "--keys-file",
        help='JSON {"key_id": "<base64 key>"} of every key in use (mode 0600, not a symlink).',
    ),
]
Current = Annotated[str, typer.Option("--current", help="The key id new seals use.")]
Batch = Annotated[
    int, typer.Option("--batch", min=1, help="Conversations re-sealed per call (default 100).")
]


def load_keys(path: Path, current: str) -> Encryption:
    """The :class:`~touba.Encryption` of a keys file, or ConfigurationError (see the
    module docstring); messages name the file and key ids, never a key."""
    try:
        info = path.lstat()
    except OSError as e:
        raise ConfigurationError(f"cannot read the keys file {path}: {e.strerror}") from None
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISREG(info.st_mode):
        raise ConfigurationError(
            f"the keys file {path} must be a regular file, not a symbolic link or another kind"
        )
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o077:
        raise ConfigurationError(
            f"the keys file {path} is readable by others (mode {mode:o}); run chmod 600 {path}"
        )
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
        with os.fdopen(fd, "rb") as file:
            raw = file.read()
    except OSError as e:
        raise ConfigurationError(f"cannot read the keys file {path}: {e.strerror}") from None
    try:
        given = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise ConfigurationError(
            f'the keys file {path} is not JSON; write {{"key_id": "<base64 key>", ...}}'
        ) from None
    if not isinstance(given, dict) or not given:
        raise ConfigurationError(
            f'the keys file {path} must hold a JSON object {{"key_id": "<base64 key>", ...}}'
        )
    keys: dict[str, bytes] = {}
    for key_id, text in given.items():
        if not isinstance(text, str):
            raise ConfigurationError(f"key {key_id!r} of {path} must be a base64 string")
        try:
            keys[key_id] = base64.b64decode(text.replace("-", "+").replace("_", "/"), validate=True)
        except (binascii.Error, ValueError):
            raise ConfigurationError(f"key {key_id!r} of {path} is not valid base64") from None
    if current not in keys:
        raise ConfigurationError(f"--current {current!r} is not a key id of {path}")
    return Encryption(keys=keys, current=current)


def _history_backend(
    history_db: Path | None, history_dsn: str | None, redis_url: str | None
) -> Backend:
    offered: tuple[tuple[str, Kind, str | None], ...] = (
        ("--history-db", "sqlite", None if history_db is None else str(history_db)),
        ("--history-dsn", "postgresql", history_dsn),
        ("--redis-url", "redis", redis_url),
    )
    given = [(name, Backend(kind, value)) for name, kind, value in offered if value]
    if len(given) != 1:
        names = " and ".join(name for name, _ in given) or "none"
        errors.print(
            "[bold red]usage[/]: give one store: --history-db PATH, --history-dsn DSN or "
            f"--redis-url URL (got {names})"
        )
        raise typer.Exit(2)
    return given[0][1]


def _stale(counts: dict[str | None, int], current: str) -> int:
    return sum(n for key_id, n in counts.items() if key_id != current)


def rekey(
    keys_file: KeysFile,
    current: Current,
    history_db: HistoryDbOption = None,
    history_dsn: HistoryDsnOption = None,
    history_table: HistoryTableOption = None,
    redis_url: RedisUrlOption = None,
    history_prefix: HistoryPrefixOption = None,
    batch: Batch = 100,
    as_json: JsonOption = False,
) -> None:
    """Re-seal an encrypted store with the --current key, resumably (key rotation)."""
    backend = _history_backend(history_db, history_dsn, redis_url)
    try:
        encryption = load_keys(keys_file, current)
    except ConfigurationError as e:
        errors.print(f"[bold red]{e.code}[/]: {e}")
        raise typer.Exit(1) from None

    async def go() -> dict[str, Any]:
        resealed = 0
        async with open_history(
            backend,
            table=history_table,
            prefix=history_prefix,
            encryption=encryption,
        ) as store:
            stores: list[Any] = [s for s in (store,) if hasattr(s, "rekey")]
            counts: dict[str | None, int] = {}
            for one in stores:
                before = await one.key_ids()
                with progress(total=True) as shown:
                    task = shown.add_task(
                        f"re-sealing with {current}", total=_stale(before, current)
                    )
                    while done := await one.rekey(batch=batch):
                        resealed += done
                        left = _stale(await one.key_ids(), current)
                        shown.update(task, completed=_stale(before, current) - left)
                for key_id, n in (await one.key_ids()).items():
                    counts[key_id] = counts.get(key_id, 0) + n
        return {"resealed": resealed, "current": current, "values": counts}

    outcome = backend.run(go())
    values: dict[str | None, int] = outcome["values"]
    left = _stale(values, current)
    if as_json:
        print_json(
            {
                "resealed_conversations": outcome["resealed"],
                "current": current,
                "values_by_key_id": {str(k) if k else "(not sealed)": n for k, n in values.items()},
                "left": left,
            }
        )
    else:
        shown = make_table("key id", "values (heads and messages)")
        for key_id, n in sorted(values.items(), key=lambda item: str(item[0])):
            shown.add_row(key_id or "(not sealed)", str(n))
        print_table(shown)
        console.print(f"re-sealed {outcome['resealed']} conversation(s) with {current}")
    if left:
        errors.print(
            f"[bold yellow]{left} value(s) are still sealed with another key (or not "
            "sealed): conversations in use, or that do not open (see the log). Run "
            "`touba rekey` again; keep the old keys until nothing is left."
        )
        raise typer.Exit(1)

"""The encryption keys of the command line: ``--keys-file PATH`` and ``--current KEY_ID``.

Decisions:

- **One place.** Every command that opens a durable store (``touba users``, ``export``,
  ``import``, ``purge``, ``history``, ``events``, ``copy``, ``rekey``, ``panel``, ...)
  loads its keys here, into one :class:`~touba.Encryption` given as ``encryption=`` to
  every store it opens.
- **The file.** A JSON object ``{"key_id": "<base64 key>"}`` of every key still in use.
  It is refused unless it is a regular file, not a symbolic link, readable by its owner
  only (mode 0600 or 0400). Nothing of its content is ever printed: a bad entry is named
  by its key id at most.
- **The current key** (the one new seals use): ``--current KEY_ID``, or the only key
  when the file holds one; with several keys and no ``--current`` the command is refused
  (exit 1) rather than guessing. ``--current`` without ``--keys-file`` is a usage error
  (exit 2).
- **Without keys** a store is opened without encryption; a sealed row it meets is
  refused (fails closed) and :func:`touba.cli._common.run` says to give ``--keys-file``.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import stat
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from touba._encryption import Encryption
from touba.cli._common import errors
from touba.errors import ConfigurationError

__all__ = ["CurrentOption", "KeysFileOption", "encryption_of", "load_keys"]

KeysFileOption = Annotated[
    Path | None,
    typer.Option(
        "--keys-file",
        help='For encrypted stores: JSON {"key_id": "<base64 key>"} of every key in use '
        "(mode 0600, not a symlink).",
    ),
]
CurrentOption = Annotated[
    str | None,
    typer.Option(
        "--current", help="With --keys-file: the key id new seals use (default: the only key)."
    ),
]


def load_keys(path: Path, current: str | None = None) -> Encryption:
    """The :class:`~touba.Encryption` of a keys file (see the module docstring).

    Raises ConfigurationError for a missing, linked, shared, malformed file, a bad key,
    an unknown ``current`` or none named among several keys; messages name the file
    and key ids, never a key.
    """
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
    if current is None:
        if len(keys) != 1:
            raise ConfigurationError(
                f"the keys file {path} holds {len(keys)} keys: name the one new seals use "
                "with --current KEY_ID"
            )
        current = next(iter(keys))
    if current not in keys:
        raise ConfigurationError(f"--current {current!r} is not a key id of {path}")
    return Encryption(keys=keys, current=current)


def encryption_of(
    keys_file: Path | None,
    current: str | None,
    *,
    keys_option: str = "--keys-file",
    current_option: str = "--current",
) -> Encryption | None:
    """The encryption of these options (None without a keys file); exit 1 with one line
    for a refused file, exit 2 for ``--current`` without a keys file."""
    if keys_file is None:
        if current is not None:
            errors.print(f"[bold red]usage[/]: {current_option} applies with {keys_option} only")
            raise typer.Exit(2)
        return None
    try:
        return load_keys(keys_file, current)
    except ConfigurationError as e:
        message = str(e).replace("--current", current_option)
        errors.print(f"[bold red]{e.code}[/]: {escape(message)}")
        raise typer.Exit(1) from None

"""Helpers shared by the CLI commands: console, tables, JSON, progress, running a
command, secret redaction.

Output rules: a table on a terminal takes the terminal's width and folds a
long cell rather than cutting it; piped, it is printed at its natural width,
one row per line, so keys and ids are never cut (:func:`print_table`).
``--json`` prints plain JSON (:func:`print_json`). Progress bars go to
standard error and only on a terminal (:func:`progress`), so piped output
stays clean.

A connection string is never printed back with its secret. :func:`redact`
masks the password of a DSN in URL form (``postgresql://user:***@host/db``,
``redis://:***@host``, a ``password=`` query parameter) and in libpq
``key=value`` form (``password=***``); ``sslpassword`` is masked too.
:func:`scrub` also takes the secret out of any other text, such as a driver's
error message that quotes part of the DSN, and :func:`run` scrubs every error
it prints.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
import json
import os
import re
import stat
from collections.abc import Callable, Coroutine, Iterable, Mapping
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any, TypeVar
from urllib.parse import unquote

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from touba.errors import DecisionHistoryRecordInvalid, ToubaError

T = TypeVar("T")

# Soft wrap: a long line (a key, a fingerprint) is never broken by touba; a
# terminal wraps it for display, a pipe gets it whole.
console = Console(soft_wrap=True)
errors = Console(stderr=True, soft_wrap=True)

JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]

MASK = "***"
_UNBOUNDED = 1_000_000
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
_QUERY_SECRET = re.compile(r"[?&](?:ssl)?password=([^&#]*)", re.IGNORECASE)
_KEYWORD_SECRET = re.compile(
    r"(?:^|\s)(?:ssl)?password\s*=\s*('(?:[^'\\]|\\.)*'?|[^\s']\S*)", re.IGNORECASE
)


def _secret_spans(address: str) -> list[tuple[int, int]]:
    """Where the secrets of ``address`` are: the URL password, password parameters."""
    spans: list[tuple[int, int]] = []
    scheme = _SCHEME.match(address)
    if scheme is None:
        spans.extend(m.span(1) for m in _KEYWORD_SECRET.finditer(address))
        return spans
    # The user information ends at the last "@" before the path; a password holding
    # raw "?", "#" or "@" is masked whole rather than parsed as a URL would.
    start = scheme.end()
    slash = address.find("/", start)
    at = address.rfind("@", start, len(address) if slash == -1 else slash)
    colon = address.find(":", start, at) if at != -1 else -1
    if colon != -1 and colon + 1 < at:
        spans.append((colon + 1, at))
    spans.extend(m.span(1) for m in _QUERY_SECRET.finditer(address, start) if m.group(1))
    return spans


def redact(address: str) -> str:
    """``address`` (a PostgreSQL DSN or a Redis URL) with every password shown as ``***``."""
    shown: list[str] = []
    end = 0
    for start, stop in sorted(_secret_spans(address)):
        if start < end:  # overlapping spans mask once
            if stop > end:
                end = stop
            continue
        shown += [address[end:start], MASK]
        end = stop
    return "".join([*shown, address[end:]])


def _secrets(address: str) -> set[str]:
    """Each secret of ``address`` as written and as a driver would decode it."""
    found: set[str] = set()
    for start, stop in _secret_spans(address):
        raw = address[start:stop]
        found |= {raw, unquote(raw)}
        if raw.startswith("'"):  # libpq quoting: 'it\'s'
            found.add(re.sub(r"\\(.)", r"\1", raw.strip("'")))
    return {s for s in found if s}


def scrub(text: str, addresses: Iterable[str]) -> str:
    """``text`` with each of ``addresses`` redacted and their secrets masked anywhere."""
    for address in addresses:
        secrets = sorted(_secrets(address), key=len, reverse=True)
        parts = text.split(address) if address else [text]
        for secret in secrets:
            parts = [part.replace(secret, MASK) for part in parts]
        text = redact(address).join(parts)
    return text


def run(
    coroutine: Coroutine[Any, Any, T],
    *,
    secret: Iterable[str] = (),
    driver_errors: tuple[type[BaseException], ...] = (),
) -> T:
    """Run a coroutine; a touba error (or one of ``driver_errors``) becomes a short
    message, with the secrets of the addresses in ``secret`` masked, and exit code 1."""
    addresses = tuple(secret)
    try:
        return asyncio.run(coroutine)
    except ToubaError as e:
        errors.print(f"[bold red]{e.code}[/]: {escape(scrub(str(e), addresses))}{_keys_hint(e)}")
        raise typer.Exit(1) from e
    except driver_errors as e:
        errors.print(f"[bold red]{type(e).__name__}[/]: {escape(scrub(str(e), addresses))}")
        raise typer.Exit(1) from e


KEYS_HINT = (
    " (an encrypted store: give --keys-file PATH with every key it was sealed with, "
    "and --current KEY_ID when the file holds several)"
)


def _keys_hint(error: ToubaError) -> str:
    """What to do when a store's row is sealed and the keys are missing or wrong."""
    text = str(error)
    if isinstance(error, DecisionHistoryRecordInvalid) and ("encrypt" in text or "sealed" in text):
        return KEYS_HINT
    return ""


def private_directory(path: Path) -> Path:
    """Create ``path`` with mode 0700 if missing; refuse one others can write to."""
    path.mkdir(mode=0o700, parents=False, exist_ok=True)
    mode = stat.S_IMODE(os.stat(path).st_mode)
    if mode & 0o022:
        errors.print(
            f"[bold red]refusing[/] {path}: it is writable by group or others "
            f"(mode {mode:o}); run chmod 700 {path}"
        )
        raise typer.Exit(1)
    return path


def table(*columns: str, title: str | None = None) -> Table:
    """A table whose cells fold instead of being cut with an ellipsis."""
    out = Table(title=title)
    for column in columns:
        out.add_column(column, overflow="fold")
    return out


def print_table(shown: Table, *, whole: bool = False) -> None:
    """Print ``shown`` at the terminal's width, or (piped, or ``whole``) at its natural
    width, one row per line."""
    if console.is_terminal and not whole:
        console.print(shown)
        return
    width = console.measure(shown, options=console.options.update_width(_UNBOUNDED)).maximum
    Console(width=max(width, 1), highlight=False).print(shown)


def _jsonable(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    raise TypeError(f"{type(value).__name__} is not JSON data")


def print_json(value: Any) -> None:
    """``value`` (JSON data, dataclasses, datetimes) as indented JSON on standard output."""
    typer.echo(json.dumps(value, ensure_ascii=False, indent=2, default=_jsonable))


def progress(*, total: bool) -> Progress:
    """A progress display on standard error (a bar when ``total`` is known, else a
    spinner), shown only on a terminal and cleared when done."""
    columns = (
        [SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn()]
        if total
        else [SpinnerColumn(), TextColumn("{task.description}")]
    )
    return Progress(
        *columns,
        TimeElapsedColumn(),
        console=errors,
        transient=True,
        disable=not errors.is_terminal,
    )


def store_command(
    app: typer.Typer, name: str, *, options: Mapping[str, Any], target: Callable[..., Any]
) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Register the command ``NAME`` of ``app``, written ``fn(target, *its own)``.

    The commands of a group open one store chosen by the same options (``options``:
    parameter name to its typer annotation, each defaulting to None). The command line
    gets them after the command's arguments and before its own options, so ``--help``
    lists them in that order, and ``fn`` gets ``target(**those options)`` in their place:
    what ``target`` raises for a missing store or a wrong combination (``typer.Exit``)
    ends the command before ``fn`` runs.
    """
    store = [
        inspect.Parameter(
            option, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None, annotation=hint
        )
        for option, hint in options.items()
    ]

    def register(fn: Callable[..., None]) -> Callable[..., None]:
        own = list(inspect.signature(fn, eval_str=True).parameters.values())[1:]
        arguments = [p for p in own if p.default is inspect.Parameter.empty]
        rest = [p for p in own if p.default is not inspect.Parameter.empty]
        parameters = [*arguments, *store, *rest]

        @functools.wraps(fn)
        def command(**given: Any) -> None:
            fn(target(**{option: given.pop(option) for option in options}), **given)

        command.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in parameters}
        app.command(name)(command)
        return fn

    return register

"""Helpers shared by the CLI commands."""

from __future__ import annotations

import asyncio
import os
import stat
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import typer
from rich.console import Console

from touba.errors import ToubaError

T = TypeVar("T")

console = Console()
errors = Console(stderr=True)


def run(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine; a touba error becomes a short message and exit code 1."""
    try:
        return asyncio.run(coroutine)
    except ToubaError as e:
        errors.print(f"[bold red]{e.code}[/]: {e}")
        raise typer.Exit(1) from e


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

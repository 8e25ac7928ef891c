"""The ``touba`` command (typer + rich): demo, history administration, and more."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence

__all__ = ["main"]

# The environment variables the commands read as options (``envvar=``).
_ENVIRONMENT = ("TOUBA_DSN", "TOUBA_PROGRAM")


def _not_utf8(text: str) -> bool:
    """True when ``text`` came from bytes that are not UTF-8: Python decodes the
    command line and the environment with ``surrogateescape``, which leaves lone
    surrogates where such bytes were."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _shown(text: str) -> str:
    """``text`` as the bytes it was typed as, printable (b'u\\xff')."""
    return repr(os.fsencode(text))


def _undecodable(arguments: Sequence[str], environment: Mapping[str, str]) -> str | None:
    """Why the command line or the environment cannot be taken (None: it can).

    Every argument and every option read from the environment must be UTF-8
    text: user ids, session ids, keys and paths are stored and compared as text,
    and a lone surrogate would fail deep inside a store with a traceback.
    """
    for position, argument in enumerate(arguments, start=1):
        if _not_utf8(argument):
            return (
                f"argument {position} ({_shown(argument)}) is not UTF-8 text; touba takes "
                "UTF-8 ids, keys and paths only. Nothing was done"
            )
    for name in _ENVIRONMENT:
        value = environment.get(name)
        if value is not None and _not_utf8(value):
            return f"{name} is not UTF-8 text; touba takes UTF-8 only. Nothing was done"
    return None


def main() -> None:
    """Entry point of the ``touba`` console script."""
    try:
        from touba.cli._app import app
        from touba.cli._common import errors
    except ImportError as e:  # pragma: no cover - depends on the installed extras
        missing = getattr(e, "name", None) or str(e)
        sys.stderr.write(f'touba: the command line needs {missing}: pip install "touba[cli]"\n')
        raise SystemExit(2) from e
    from rich.markup import escape

    from touba.errors import ConfigurationError

    problem = _undecodable(sys.argv[1:], os.environ)
    if problem is not None:
        errors.print(f"[bold red]{ConfigurationError.code}[/]: {escape(problem)}")
        raise SystemExit(1)
    app()

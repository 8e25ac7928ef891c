"""The ``touba`` command (typer + rich): demo, history administration, and more."""

from __future__ import annotations

import sys

__all__ = ["main"]


def main() -> None:
    """Entry point of the ``touba`` console script."""
    try:
        from touba.cli._app import app
    except ImportError as e:  # pragma: no cover - depends on the installed extras
        missing = getattr(e, "name", None) or str(e)
        sys.stderr.write(f'touba: the command line needs {missing}: pip install "touba[cli]"\n')
        raise SystemExit(2) from e
    app()

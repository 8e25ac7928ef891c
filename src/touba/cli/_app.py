"""The typer application: one sub-command group per concept."""

from __future__ import annotations

import typer

from touba.cli import (
    _agents,
    _chat,
    _check,
    _copy,
    _demo,
    _events,
    _export,
    _history,
    _panel,
    _purge,
    _rekey,
    _users,
    _worker,
)

app = typer.Typer(
    name="touba",
    help="Bounded, persistent and safe memory for LLM agents.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.command("demo")(_demo.demo)
app.add_typer(_history.app, name="history")
app.add_typer(_events.app, name="events")
app.add_typer(_agents.app, name="agents")
app.command("worker")(_worker.worker)
app.command("chat")(_chat.chat)
app.command("panel")(_panel.panel)
app.command("check")(_check.check)
app.add_typer(_users.app, name="users")
_export.register(app)
app.command("purge")(_purge.purge)
app.command("rekey")(_rekey.rekey)
app.command("copy")(_copy.copy)

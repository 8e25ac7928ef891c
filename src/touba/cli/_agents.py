"""``touba agents settings show|history|reset AGENT``: an agent's memory settings.

The store is the memory store (``--db``, or ``--dsn`` / ``TOUBA_DSN`` and
``--prefix``), as for ``touba events``; see :mod:`touba.cli._stores`.

- ``show`` and ``history`` only read: they create, migrate and chmod nothing
  (a store that opening would change is refused, as by every read command).
- ``show`` prints the settings in effect and where they come from: saved (by
  whom, when; they win over the program's) or, when none are saved, the
  program's. The program is only known with ``--program module:attr``; without
  it and with nothing saved, ``show`` says so rather than guess.
- ``reset`` deletes the saved settings, so that the program's apply again from
  each session's next turn, and the store records the change with ``--actor``
  (``cli`` by default). It asks first unless ``--yes``. Nothing saved is not an
  error: it says so, records nothing and exits 0.
"""

from __future__ import annotations

import functools
from typing import Annotated, Any

import typer
from rich.markup import escape

from touba.cli._common import JsonOption, console, errors, print_json, print_table, store_command
from touba.cli._common import table as new_table
from touba.cli._events import Db, MemoryTarget, PrefixOption, memory_target, open_store
from touba.cli._programs import ProgramOption, load_program
from touba.cli._stores import DsnOption
from touba.errors import ConfigurationError
from touba.memory import (
    EffectiveMemoryConfig,
    MemoryConfig,
    MemoryConfigChange,
    SavedMemoryConfig,
    resolve_memory_settings,
)
from touba.memory._config import config_to_data
from touba.memory._store import MemoryConfigStore, check_actor

__all__ = ["app", "describe"]

app = typer.Typer(
    help="Your agents' memory settings, as saved in a memory store.", no_args_is_help=True
)
settings_app = typer.Typer(
    help="Show, list the changes of, or reset an agent's saved memory settings.",
    no_args_is_help=True,
)
app.add_typer(settings_app, name="settings")

Agent = Annotated[str, typer.Argument(help="The agent's name (as in Program.agent).")]

_store_command = functools.partial(
    store_command,
    settings_app,
    options={"db": Db, "dsn": DsnOption, "prefix": PrefixOption},
    target=memory_target,
)
"""``@_store_command(NAME)``: ``touba agents settings NAME``, written ``fn(target, ...)``."""


def describe(config: MemoryConfig) -> str:
    """The settings in one line, as the panel's agent page shows them."""

    def turns(count: int) -> str:
        return f"{count} turn{'s' if count != 1 else ''}" if count else "off"

    events = config.key_events
    if events.active:
        key_events = "on: " + ", ".join(events.types)
    else:
        key_events = "on, no type" if events.enabled else "off"
    return (
        f"short-term {turns(config.short_term_turns)} · "
        f"full context {turns(config.full_context_turns)} · key events {key_events}"
    )


def _config_store(store: object) -> MemoryConfigStore:
    if not isinstance(store, MemoryConfigStore):  # pragma: no cover - built-in stores are
        raise ConfigurationError("this memory store keeps no per-agent settings")
    return store


def _saved_by(actor: str) -> str:
    if actor == "operator":
        return "saved in the panel (operator)"
    if actor == "unknown":
        return "saved (by whom was not recorded)"
    return f"saved by {actor}"


def _when(change: MemoryConfigChange | SavedMemoryConfig) -> str:
    moment = change.at if isinstance(change, MemoryConfigChange) else change.saved_at
    return moment.isoformat(timespec="seconds")


@_store_command("show")
def show(
    target: MemoryTarget,
    agent: Agent,
    program: ProgramOption = None,
    raw: JsonOption = False,
) -> None:
    """Show the settings AGENT runs with and where they come from (reads only)."""
    program_config: MemoryConfig | None = None
    if program:
        definition = load_program(program).agents.get(agent)
        if definition is None:
            errors.print(
                f"[bold red]no agent named {escape(agent)} in --program {escape(program)}[/]"
            )
            raise typer.Exit(1)
        program_config = definition.memory  # None: the program gives none (the defaults)

    async def go() -> None:
        async with open_store(target, read_only=True) as store:
            effective = await resolve_memory_settings(_config_store(store), agent, program_config)
        known = effective.source == "saved" or program is not None
        if raw:
            given = None if program is None else program_config or MemoryConfig()
            print_json(_show_json(agent, effective if known else None, given))
            return
        console.print(f"[bold]agent[/]: {escape(agent)}")
        if not known:
            console.print(
                "[bold]source[/]: nothing saved: its sessions use the program's MemoryConfig "
                "(or the defaults when it gives none). Give --program module:attr to show them"
            )
            return
        _print_effective(effective, None if program is None else program_config or MemoryConfig())

    target.backend.run(go())


def _print_effective(effective: EffectiveMemoryConfig, program: MemoryConfig | None) -> None:
    if effective.source == "saved":
        assert effective.saved_at is not None
        assert effective.saved_by is not None
        when = effective.saved_at.isoformat(timespec="seconds")
        source = f"{_saved_by(effective.saved_by)} at {when}; they win over the program's"
    elif effective.source == "program":
        source = "the program's MemoryConfig (nothing saved)"
    else:
        source = "the defaults (the program gives no MemoryConfig, and nothing is saved)"
    console.print(f"[bold]source[/]: {escape(source)}")
    console.print(f"[bold]settings[/]: {escape(describe(effective.config))}")
    if effective.source == "saved" and program is not None:
        console.print(f"[bold]program's settings[/] (not in effect): {escape(describe(program))}")


def _show_json(
    agent: str, effective: EffectiveMemoryConfig | None, program: MemoryConfig | None
) -> dict[str, Any]:
    """``show --json``: ``source`` and ``config`` are null when they cannot be known
    (nothing saved, no ``--program``); ``program_config`` null without ``--program``."""
    return {
        "agent": agent,
        "source": None if effective is None else effective.source,
        "config": None if effective is None else config_to_data(effective.config),
        "saved_at": None if effective is None else effective.saved_at,
        "saved_by": None if effective is None else effective.saved_by,
        "program_config": None if program is None else config_to_data(program),
    }


@_store_command("history")
def history(
    target: MemoryTarget,
    agent: Agent,
    limit: Annotated[int, typer.Option("--limit", help="At most this many changes.")] = 50,
    raw: JsonOption = False,
) -> None:
    """List the changes of AGENT's saved settings, newest first (reads only)."""

    async def go() -> None:
        async with open_store(target, read_only=True) as store:
            changes = await _config_store(store).memory_config_history(agent, limit=limit)
        if raw:
            print_json({"agent": agent, "changes": [_change_json(c) for c in changes]})
            return
        shown = new_table("at", "by", "before", "after", title=f"settings of {escape(agent)}")
        for change in changes:
            shown.add_row(
                _when(change),
                escape(change.actor),
                "nothing saved (the program's)"
                if change.before is None
                else describe(change.before),
                "reset to the program's" if change.after is None else describe(change.after),
            )
        print_table(shown)
        console.print(f"{len(changes)} change(s), newest first")

    target.backend.run(go())


def _change_json(change: MemoryConfigChange) -> dict[str, Any]:
    return {
        "at": change.at,
        "actor": change.actor,
        "before": None if change.before is None else config_to_data(change.before),
        "after": None if change.after is None else config_to_data(change.after),
    }


@_store_command("reset")
def reset(
    target: MemoryTarget,
    agent: Agent,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
    actor: Annotated[
        str, typer.Option("--actor", help="Who resets, as the settings history records it.")
    ] = "cli",
) -> None:
    """Delete AGENT's saved settings (the program's apply again); the change is recorded.

    Sessions use the program's settings from their next turn. Asks first unless --yes.
    """
    try:
        check_actor(actor)
    except ConfigurationError as e:
        errors.print(f"[bold red]--actor[/]: {escape(str(e))}")
        raise typer.Exit(2) from e
    if not yes:
        confirmed = typer.confirm(
            f"Delete the memory settings saved for {agent}? Its sessions use the program's "
            "settings from their next turn.",
            default=False,
        )
        if not confirmed:
            errors.print("nothing done")
            raise typer.Exit(1)

    async def go() -> None:
        async with open_store(target) as store:
            done = await _config_store(store).reset_memory_config(agent, actor=actor)
        if done:
            console.print(
                f"reset: the settings saved for {escape(agent)} were deleted; its sessions use "
                f"the program's from their next turn (recorded as {escape(actor)})"
            )
        else:
            console.print(f"no settings were saved for {escape(agent)}: nothing to reset")

    target.backend.run(go())

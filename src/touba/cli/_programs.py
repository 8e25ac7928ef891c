"""How ``touba chat`` and ``touba worker`` get the host's agents: ``--program module:attr``.

``module:attr`` names, like uvicorn's ``app`` argument, an object importable
from the current directory or the Python path: a :class:`touba.Program`, a
:class:`touba.Runtime` (its program), or a callable taking no argument that
returns one of them (a factory, e.g. to build providers from the
environment). ``attr`` may be dotted. ``demo`` is the built-in offline demo
program (:mod:`touba.cli._demo_program`). ``TOUBA_PROGRAM`` is the default.

Importing runs the module's code: point ``--program`` only at code you trust.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Annotated

import typer

from touba.cli._common import errors
from touba.runtime import Program, Runtime

__all__ = ["DEMO", "ProgramOption", "load_host", "load_program"]

DEMO = "demo"

ProgramOption = Annotated[
    str | None,
    typer.Option(
        "--program",
        "-p",
        envvar="TOUBA_PROGRAM",
        help="Where your agents are: module:attr naming a touba.Program, a touba.Runtime or "
        "a factory of one; 'demo' for the built-in offline demo.",
    ),
]


def _fail(message: str) -> typer.Exit:
    errors.print(f"[bold red]--program[/]: {message}")
    return typer.Exit(2)


def load_program(spec: str | None) -> Program:
    """The Program named by ``spec`` (see the module documentation)."""
    loaded = load_host(spec)
    return loaded.program if isinstance(loaded, Runtime) else loaded


def load_host(spec: str | None) -> Program | Runtime:
    """What ``spec`` names: a Program, or a Runtime kept whole (its checkpoint store and
    resources binding with it), as ``touba panel`` needs it for approvals."""
    if not spec:
        raise _fail(
            "give --program module:attr (or set TOUBA_PROGRAM) naming your touba.Program; "
            "'--program demo' runs the built-in demo"
        )
    if spec == DEMO:
        from touba.cli._demo_program import build_program

        return build_program()
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise _fail(f"{spec!r} is not of the form module:attr (e.g. mypkg.agents:program)")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        value: object = importlib.import_module(module_name)
    except ImportError as e:
        raise _fail(f"cannot import {module_name!r}: {e}") from e
    for part in attribute.split("."):
        try:
            value = getattr(value, part)
        except AttributeError as e:
            raise _fail(f"{spec!r}: no attribute {part!r}") from e
    if callable(value) and not isinstance(value, Program | Runtime):
        value = value()
    if isinstance(value, Program | Runtime):
        return value
    raise _fail(f"{spec!r} is a {type(value).__name__}, not a touba.Program or touba.Runtime")

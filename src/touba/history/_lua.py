"""The Lua scripts of the Redis store, shipped as package data (``history/lua/*.lua``).

A script is read once per process (the first store that registers it), and named by the
SHA1 of its bytes: the digest EVALSHA sends (redis-py hashes the same bytes, which
the store registers as they are), and a test checks that ``SCRIPT LOAD`` answers it
for every script. Shared pieces (files named ``_*.lua``: the prelude every store
script starts with, the claim's and the peek's reads, the commit's write) are
written once: a script names each on a line of its own, ``--@include _piece.lua``,
replaced by that piece's text. A piece includes nothing, so one level is all there
is to follow.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from importlib.resources import files
from importlib.resources.abc import Traversable

__all__ = ["LuaScript", "load"]

_INCLUDE = "--@include "
_FOLDER = files("touba.history").joinpath("lua")


@dataclass(frozen=True, slots=True)
class LuaScript:
    """One script as Redis runs it: its file's name, its text with the pieces it
    includes in place, and the SHA1 (hex) of that text's UTF-8 bytes."""

    name: str
    text: str
    sha: str

    @property
    def source(self) -> bytes:
        """The bytes Redis loads and hashes (``sha`` is their SHA1)."""
        return self.text.encode("utf-8")


@functools.cache
def load(name: str, package: str | None = None) -> LuaScript:
    """The script ``lua/<name>.lua`` (of ``package``'s folder when given, e.g. an
    integration's own scripts) with its includes expanded, read once per process;
    raises ValueError on an include inside a piece, of a script, or of a piece whose
    last line does not end."""
    folder = None if package is None else files(package).joinpath("lua")
    text = "".join(_lines(f"{name}.lua", piece=False, folder=folder))
    return LuaScript(
        name, text, hashlib.sha1(text.encode("utf-8"), usedforsecurity=False).hexdigest()
    )


def _lines(file: str, *, piece: bool, folder: Traversable | None = None) -> list[str]:
    folder = _FOLDER if folder is None else folder
    out = []
    for line in folder.joinpath(file).read_text("utf-8").splitlines(keepends=True):
        if not line.startswith(_INCLUDE):
            out.append(line)
            continue
        included = line.removeprefix(_INCLUDE).strip()
        if piece or not included.startswith("_"):
            raise ValueError(f"lua/{file}: only a script includes, and only a piece (_*.lua)")
        lines = _lines(included, piece=True, folder=folder)
        if lines and not lines[-1].endswith("\n"):
            raise ValueError(f"lua/{included}: a piece ends with a newline")
        out += lines
    return out

"""Reading the code blocks of a Markdown page, and checking each kind as a reader would.

- ```python runs (``run_python``): in order, one namespace per page, in a temporary
  working directory, as a script would: no top-level ``await`` (a sample that awaits
  runs its coroutine with ``asyncio.run``), so a block pasted into a file runs as is.
- ```output is what the python blocks before it (since the previous output block)
  printed: each of its lines, in order, must be a line they printed (``check_output``).
- ```sh and ```console lines (``check_shell_line``): ``touba ...`` runs through the CLI
  when it needs no external server and no placeholder (``<key>``); otherwise
  ``touba <command> --help`` must succeed and list every option the line uses.
  ``make X`` must be a Makefile target, ``pip install "touba[x]"`` name extras that
  exist, ``.venv/bin/python bench/x.py --opt`` a script that takes those options.
- ```json parses (pages check their documented formats further).
"""

from __future__ import annotations

import functools
import os
import re
import shlex
import subprocess
import sys
import textwrap
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
# A fence at any indentation (a block inside a list item counts too).
FENCE = re.compile(r"^([ \t]*)```([\w-]*)[^\n]*\n(.*?)^\1```[ \t]*$", re.DOTALL | re.MULTILINE)
SERVER_OPTIONS = ("--dsn", "--redis-url", "--history-dsn")
LONG_RUNNING = ("panel", "worker", "chat")  # a server, a job loop, an interactive prompt


@dataclass(frozen=True)
class Block:
    language: str
    code: str
    line: int  # line of the opening fence in the Markdown file, 1-based


def blocks_of(path: Path) -> list[Block]:
    text = path.read_text(encoding="utf-8")
    return [
        Block(m.group(2), textwrap.dedent(m.group(3)), text.count("\n", 0, m.start()) + 1)
        for m in FENCE.finditer(text)
    ]


def run_python(path: Path, block: Block, namespace: dict[str, Any]) -> None:
    """Runs one block as a script would (a top-level ``await`` is a SyntaxError)."""
    # Padding keeps tracebacks on the Markdown file's own line numbers.
    source = "\n" * block.line + block.code
    exec(compile(source, str(path), "exec"), namespace)  # noqa: S102 - our own docs


def check_output(path: Path, block: Block, printed: str) -> None:
    """Each line of ``block`` (``...`` skips) is a line of ``printed``, in order."""
    lines = [line.rstrip() for line in printed.splitlines()]
    at = 0
    for offset, raw in enumerate(block.code.splitlines(), start=1):
        want = raw.rstrip()
        if not want or want == "...":
            continue
        try:
            at = lines.index(want, at) + 1
        except ValueError:
            raise AssertionError(
                f"{path.name}:{block.line + offset}: {want!r} was not printed (in this order)"
                f" by the samples before it; they printed:\n{printed}"
            ) from None


def touba(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, **(env or {}), "COLUMNS": "250", "NO_COLOR": "1"}
    return subprocess.run(
        [sys.executable, "-m", "touba.cli", *args], capture_output=True, text=True, env=full
    )


def shell_lines(block: Block) -> list[tuple[int, str]]:
    """The commands of a sh block (a console block: its ``$`` lines), continuations joined."""
    out: list[tuple[int, str]] = []
    pending = ""
    for offset, raw in enumerate(block.code.splitlines(), start=1):
        if block.language == "console":
            if not raw.startswith("$ ") and not pending:
                continue  # the command's output
            raw = raw.removeprefix("$ ")
        line = raw.split(" #", 1)[0].strip()
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        if line and not line.startswith("#"):
            out.append((block.line + offset, line))
    return out


def _extras() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return set(project["optional-dependencies"])


def _make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([a-z][\w-]*):", text, re.MULTILINE))


def check_shell_line(where: str, line: str, env: dict[str, str]) -> None:
    """Checks (or runs, in the current directory) one command line of a page."""
    words = shlex.split(line)
    program = words[0].removeprefix(".venv/bin/")
    if program == "export":
        name, _, value = words[1].partition("=")
        env[name] = value
    elif program == "unset":
        env.pop(words[1], None)
    elif program == "make":
        assert set(words[1:]) <= _make_targets(), f"{where}: no such make target"
    elif program == "pip":
        assert words[1] == "install", where
        for spec in words[2:]:
            name, _, extras = spec.partition("[")
            assert name == "touba", f"{where}: {spec}"
            unknown = set(filter(None, extras.rstrip("]").split(","))) - _extras()
            assert not unknown, f"{where}: no such extra {unknown}"
    elif program == "python" and words[1].startswith("bench/"):
        script = ROOT / words[1]
        assert script.is_file(), f"{where}: no {words[1]}"
        source = _bench_source(script)
        for option in re.findall(r"(?<![\w-])--[a-z][\w-]*", line):
            assert f'"{option}"' in source, f"{where}: {words[1]} takes no {option}"
    elif program == "touba":
        _check_touba(where, words[1:], env)
    else:
        raise AssertionError(f"{where}: a command the docs tests do not know how to check")


def _bench_source(script: Path) -> str:
    """A bench script's text and that of the bench modules it imports (``from bench.x
    import ...``), where a shared command line may be defined."""
    source = script.read_text()
    for module in re.findall(r"^from bench\.(\w+) import", source, re.M):
        source += (script.parent / f"{module}.py").read_text()
    return source


@functools.cache
def _help(command: tuple[str, ...]) -> tuple[int, str]:
    result = touba([*command, "--help"])
    return result.returncode, result.stdout


def _check_touba(where: str, args: list[str], env: dict[str, str]) -> None:
    options = [a.split("=", 1)[0] for a in args if a.startswith("--")]
    runnable = not (
        any("<" in a for a in args)
        or any(o in SERVER_OPTIONS for o in options)
        or "TOUBA_DSN" in env
        or (args and args[0] in LONG_RUNNING)
    )
    if runnable:
        result = touba(args, env)
        assert result.returncode == 0, f"{where}\n{result.stdout}\n{result.stderr}"
        return
    command = []
    for arg in args:
        if arg.startswith("-") or not re.fullmatch(r"[a-z]+", arg):
            break
        command.append(arg)
    returncode, shown = _help(tuple(command))
    assert returncode == 0, f"{where}: `touba {' '.join(command)} --help` failed"
    for option in options:
        assert re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", shown), (
            f"{where}: `touba {' '.join(command)}` has no option {option}"
        )

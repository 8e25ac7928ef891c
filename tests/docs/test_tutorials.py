"""The tutorials in docs/ run as written: every sample, in order, like a reader.

Each tutorial's ```python blocks run one after the other in one namespace
(a reader pasting them into one session), in a fresh temporary working
directory; an ```output block is what the samples before it printed (each of its
lines, in order). Each line of a ```sh block runs ``touba ...`` in a separate
process against the files the samples created; ``<key>`` stands for the
conversation key the samples printed (their ``key`` variable), and ``ls``
must list that conversation. Any exception, or a command exiting non-zero,
fails the test with the block's line in the Markdown file.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.docs._blocks import Block, blocks_of, check_output, run_python
from touba.testing.fakes import FakeProviderServer

DOCS = Path(__file__).resolve().parents[2] / "docs"
TUTORIALS = ("context-and-compaction.md", "sqlite-persistence.md")
# One reading of the fences for every docs test (a fence inside a list item counts).
code_blocks = blocks_of


def touba(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "250", "NO_COLOR": "1"}
    return subprocess.run(
        [sys.executable, "-m", "touba.cli", *args], capture_output=True, text=True, env=env
    )


def run_shell(path: Path, block: Block, namespace: dict[str, Any]) -> None:
    for offset, raw in enumerate(block.code.splitlines(), start=1):
        line = raw.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        where = f"{path.name}:{block.line + offset}: {line}"
        words = shlex.split(line)
        assert words[0] == "touba", f"{where}: only `touba ...` commands are run"
        key = namespace.get("key")
        if "<key>" in words:
            assert isinstance(key, str), f"{where}: no `key` was defined by an earlier sample"
            words = [key if w == "<key>" else w for w in words]
        result = touba(*words[1:])
        assert result.returncode == 0, f"{where}\n{result.stdout}\n{result.stderr}"
        if words[1:3] == ["history", "ls"] and isinstance(key, str):
            assert key in result.stdout, f"{where}: the conversation {key} is not listed"


def test_both_tutorials_exist_and_have_samples() -> None:
    for name in TUTORIALS:
        languages = [b.language for b in code_blocks(DOCS / name)]
        assert languages.count("python") >= 5, name
    assert "sh" in [b.language for b in code_blocks(DOCS / "sqlite-persistence.md")]


@pytest.mark.parametrize("name", TUTORIALS)
def test_every_sample_runs_in_order(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    path = DOCS / name
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, Any] = {"__name__": "__tutorial__"}
    ran = 0
    printed = ""
    try:
        for block in code_blocks(path):
            if block.language == "python":
                run_python(path, block, namespace)
                printed += capsys.readouterr().out
            elif block.language == "output":
                check_output(path, block, printed)
                printed = ""
            elif block.language == "sh":
                run_shell(path, block, namespace)
            else:
                continue
            ran += 1
    finally:  # a sample that failed midway must not leave a fake server running
        for value in namespace.values():
            if isinstance(value, FakeProviderServer):
                value.close()
    assert ran == sum(1 for b in code_blocks(path) if b.language in ("python", "sh", "output"))

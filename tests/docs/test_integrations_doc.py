"""docs/integrations.md runs as written: every ```python block, in order, in one namespace."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from tests.docs._blocks import run_python
from tests.docs.test_tutorials import DOCS, code_blocks


def test_every_sample_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    monkeypatch.chdir(tmp_path)
    path = DOCS / "integrations.md"
    blocks = [b for b in code_blocks(path) if b.language == "python"]
    assert len(blocks) == 7
    namespace: dict[str, Any] = {"__name__": "__docs__"}
    for block in blocks:  # under the suite's -W error: no deprecated API in the samples
        run_python(path, block, namespace)
    out = capsys.readouterr().out
    assert "All six orders have shipped." in out
    assert "8 items sent; 6 in the window" in out  # after the second turn
    assert "the model saw at most 7 messages" in out
    assert "52 messages stored" in out
    assert "['SystemMessage', 'HumanMessage', 'AIMessage', 'ToolMessage', 'AIMessage'" in out
    assert "All shipped." in out
    assert "You |rolled |a |4.| 4 messages stored" in out  # run_stream, deltas as they come
    assert "Checking| A0.|Checking| A1.|Checking| A2.|All| three| shipped.| 8 messages" in out
    for name in os.listdir(tmp_path / ".touba"):
        assert (tmp_path / ".touba" / name).stat().st_mode & 0o077 == 0, name

"""The README's runnable sample (decision history in five minutes) really runs."""

import os
import re
import runpy
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


def test_history_sample_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    section = README.read_text().split("## Decision history in five minutes", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert code is not None
    sample = tmp_path / "sample.py"
    sample.write_text(code.group(1))
    monkeypatch.chdir(tmp_path)
    runpy.run_path(str(sample), run_name="__main__")
    printed = capsys.readouterr().out.splitlines()
    assert "history_trimmed 8 900" in printed  # the window stays at max_messages=8
    assert os.stat(tmp_path / ".touba" / "history.sqlite").st_mode & 0o077 == 0


def test_openai_agents_sample_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """The README's ToubaSession sample: Runner.run against the fake OpenAI server."""
    section = README.read_text().split("## Integrations:", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert code is not None
    sample = tmp_path / "sample.py"
    sample.write_text(code.group(1))
    monkeypatch.chdir(tmp_path)
    runpy.run_path(str(sample), run_name="__main__")
    printed = capsys.readouterr().out.splitlines()
    assert printed == ["All shipped.", "You're welcome!", "6 items sent"]
    assert os.stat(tmp_path / ".touba" / "sessions.sqlite").st_mode & 0o077 == 0

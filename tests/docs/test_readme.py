"""The README's runnable samples really run, and its formats are the real ones."""

import json
import os
import re
import runpy
from pathlib import Path

import jsonschema
import pytest

from touba.memory import parse_ops
from touba.memory._extraction import extraction_schema

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


def test_scripting_a_fake_sample_runs(tmp_path: Path, capsys) -> None:
    section = README.read_text().split("### Scripting a fake provider", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert code is not None
    assert 'srv.base_url + "/v1"' in code.group(1)
    sample = tmp_path / "fake_sample.py"
    sample.write_text(code.group(1))
    runpy.run_path(str(sample), run_name="__main__")
    printed = capsys.readouterr().out.splitlines()
    assert printed == [
        "Order A1 has shipped.",
        "['lookup_order']",
        "['function_call', 'function_call_output']",
    ]


def test_the_extraction_job_format_is_the_one_parse_ops_reads() -> None:
    section = README.read_text().split("### The key-event extraction job", 1)[1]
    answer = re.search(r"```json\n(.*?)```", section, re.DOTALL)
    assert answer is not None
    ops = parse_ops(json.loads(answer.group(1).replace("...", "")))
    assert [op.kind for op in ops] == ["create", "update"]
    jsonschema.validate(
        json.loads(answer.group(1).replace("...", "")), extraction_schema(["refund"])
    )

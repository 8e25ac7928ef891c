"""Every page of the docs site, and the README, runs or is checked as written.

``PAGES`` lists each page with the languages of its code blocks, in order: a page that
gains, loses or reorders a block fails ``test_every_block_is_checked`` until the
block is listed here, and a block of a language with no check fails it too. What each
language's check is: ``tests/docs/_blocks.py``. The tutorials' and the integrations
page's python (and the tutorials' sh) blocks run in ``test_tutorials.py`` and
``test_integrations_doc.py``, the observability page's in ``test_observability_doc.py``;
this file checks their other blocks, and runs every block of every other page, in
order, in one namespace, in a temporary directory.
Pages whose samples need PostgreSQL or Redis get the server of ``TOUBA_POSTGRES_DSN``
/ ``TOUBA_REDIS_URL`` (skipped when unreachable, except under ``CI=true``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from tests._services import postgres_dsn, redis_url
from tests.docs._blocks import (
    DOCS,
    ROOT,
    Block,
    blocks_of,
    check_output,
    check_shell_line,
    run_python,
    shell_lines,
)
from touba.memory import parse_ops
from touba.memory._extraction import extraction_schema
from touba.providers import ContextConfig
from touba.testing.fakes import FakeProviderServer

PAGES: dict[str, str] = {
    "README.md": "sh python output python output sh",
    "docs/index.md": "",
    "docs/getting-started.md": "sh sh sh",
    "docs/concepts/decision-history.md": "python output",
    "docs/concepts/exchanges-and-windows.md": "",
    "docs/concepts/reservations.md": "",
    "docs/concepts/chat-memory.md": "python python output python output python output",
    "docs/concepts/key-events.md": "json json",
    "docs/stores/index.md": "python output",
    "docs/stores/ram.md": "python output",
    "docs/stores/sqlite.md": "python output",
    "docs/stores/postgres.md": "python output",
    "docs/stores/redis.md": "python output",
    "docs/runtime.md": "python python output python output python python output python output",
    "docs/providers.md": "python output python output python output",
    "docs/panel.md": "sh sh",
    "docs/integrations.md": "sh python python python python python python python",
    "docs/openai-agents-sessions.md": "python output python output",
    "docs/adk.md": "python output python output python output python output python",
    "docs/langgraph-checkpointer.md": "sh python output python output",
    "docs/context-and-compaction.md": (
        "python python python python text text python python python output python python "
        "python python python console python python python"
    ),
    "docs/sqlite-persistence.md": (
        "python python python python python sh python python python python python python sh "
        "python python sh python python"
    ),
    "docs/operations/cli.md": "sh sh sh sh",
    "docs/operations/recovery.md": "sh",
    "docs/operations/failures.md": "sh sh",
    "docs/operations/capacity.md": "",
    "docs/operations/observability.md": "python output",
    "docs/operations/errors.md": "",
    "docs/data/index.md": "",
    "docs/data/erase.md": "python output sh",
    "docs/data/export.md": "python output sh python output python output sh",
    "docs/data/copy.md": "python python output sh sh sh",
    "docs/data/fork-and-rewind.md": "python output python output",
    "docs/data/repair.md": "python output sh json",
    "docs/data/encryption.md": "sh python output sh python output sh sh sh python output",
    "docs/data/retention.md": "python output sh python output",
    "docs/testing.md": "python output",
    "docs/benchmarks.md": "sh sh sh sh sh sh sh sh sh sh sh",
    "docs/reference/index.md": "",
    **{
        f"docs/reference/{name}.md": ""
        for name in (
            "history",
            "providers",
            "runtime",
            "memory",
            "data",
            "integrations",
            "testing",
            "errors",
            "panel",
        )
    },
}
# Their python (and, for the tutorials, sh) blocks run in their own test files.
RUN_ELSEWHERE: dict[str, tuple[str, ...]] = {
    "docs/context-and-compaction.md": ("python", "sh", "output"),
    "docs/sqlite-persistence.md": ("python", "sh", "output"),
    "docs/integrations.md": ("python", "output"),
    # Sets OpenTelemetry's global tracer provider: runs in a process of its own.
    "docs/operations/observability.md": ("python", "output"),
}
SERVICES: dict[str, Callable[[], str]] = {
    "docs/stores/postgres.md": postgres_dsn,
    "docs/stores/redis.md": redis_url,
}


@dataclass
class PageRun:
    path: Path
    tmp_path: Path
    outputs: list[str] = dataclasses.field(default_factory=list)  # each python block's stdout


def run_page(path: Path, tmp_path: Path, capsys: Any, skip: tuple[str, ...] = ()) -> PageRun:
    """Every block of ``path`` in order (those of a ``skip`` language are left out)."""
    run = PageRun(path, tmp_path)
    namespace: dict[str, Any] = {"__name__": "__docs__"}
    env: dict[str, str] = {}
    printed = ""
    try:
        for block in blocks_of(path):
            if block.language in skip:
                continue
            if block.language == "python":
                run_python(path, block, namespace)
                out = capsys.readouterr().out
                run.outputs.append(out)
                printed += out
            elif block.language == "output":
                check_output(path, block, printed)
                printed = ""
            elif block.language in ("sh", "console"):
                for line_number, line in shell_lines(block):
                    check_shell_line(f"{path.name}:{line_number}: {line}", line, env)
            elif block.language == "json":
                json.loads(block.code)
            elif block.language == "text":
                check_text(path, block)
            else:
                raise AssertionError(f"{path.name}:{block.line}: no check for {block.language!r}")
    finally:  # a sample that failed midway must not leave a fake server running
        for value in namespace.values():
            if isinstance(value, FakeProviderServer):
                value.close()
    return run


def check_text(path: Path, block: Block) -> None:
    """The plain-text blocks: each states a formula or a signature of the code."""
    text = block.code.strip()
    defaults = ContextConfig(context_window_tokens=1000)
    if text.startswith("ContextConfig("):
        for name, value in re.findall(r"(\w+)=([\d.]+)", text):
            assert getattr(defaults, name) == float(value), f"{path.name}:{block.line}: {name}"
        assert "context_window_tokens" in text
    elif text.startswith("reserve = "):
        for name in ("input_token_multiplier", "safety_margin_tokens"):
            assert name in text, f"{path.name}:{block.line}: {name}"
            assert hasattr(defaults, name), f"{path.name}:{block.line}: {name}"
    else:
        raise AssertionError(f"{path.name}:{block.line}: a text block with no check")


def test_every_page_is_listed() -> None:
    """A new page fails here until it is listed in PAGES (and so checked)."""
    found = {str(p.relative_to(ROOT)) for p in DOCS.rglob("*.md")} | {"README.md"}
    assert found == set(PAGES)
    nav = (ROOT / "mkdocs.yml").read_text()
    for name in PAGES:
        if name.startswith("docs/"):
            assert f": {name.removeprefix('docs/')}\n" in nav, f"{name} is not in mkdocs.yml's nav"


@pytest.mark.parametrize("name", sorted(PAGES))
def test_every_block_is_checked(name: str) -> None:
    languages = " ".join(b.language or "(none)" for b in blocks_of(ROOT / name))
    assert languages == PAGES[name], f"{name}: its blocks changed: list and check them here"


@pytest.mark.parametrize("name", sorted(PAGES))
def test_every_block_runs(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    if name in SERVICES:
        SERVICES[name]()  # skips (or fails under CI=true) when the server is unreachable
    monkeypatch.chdir(tmp_path)
    run = run_page(ROOT / name, tmp_path, capsys, skip=RUN_ELSEWHERE.get(name, ()))
    if name in CHECKS:
        CHECKS[name](run)


# ------------------------------------------------ what particular pages must show


def _decision_history(run: PageRun) -> None:
    printed = run.outputs[0].splitlines()
    assert "history_trimmed 8 900" in printed  # the window stays at max_messages=8
    assert os.stat(run.tmp_path / ".touba" / "history.sqlite").st_mode & 0o077 == 0


def _openai_agents_sessions(run: PageRun) -> None:
    """The ToubaSession sample: Runner.run against the fake OpenAI server."""
    assert run.outputs[0].splitlines() == ["All shipped.", "You're welcome!", "6 items sent"]
    assert os.stat(run.tmp_path / ".touba" / "sessions.sqlite").st_mode & 0o077 == 0


def _testing(run: PageRun) -> None:
    (code,) = (b.code for b in blocks_of(run.path) if b.language == "python")
    assert 'srv.base_url + "/v1"' in code
    assert run.outputs[0].splitlines() == [
        "Order A1 has shipped.",
        "['lookup_order']",
        "['function_call', 'function_call_output']",
    ]


def _key_events(run: PageRun) -> None:
    """The extraction job's format is the one parse_ops reads, and its result's."""
    answer, result = (json.loads(b.code) for b in blocks_of(run.path) if b.language == "json")
    ops = parse_ops(answer)
    assert [op.kind for op in ops] == ["create", "update"]
    jsonschema.validate(answer, extraction_schema(["refund"]))
    assert set(result) == {"created", "updated", "rejected"}
    assert {"op", "error"} == set(result["rejected"][0])


def _chat_memory(run: PageRun) -> None:
    assert os.stat(run.tmp_path / ".touba" / "memory.sqlite").st_mode & 0o077 == 0


def _runtime(run: PageRun) -> None:
    assert run.outputs[1].split() == ["completed", "D4", "is", "refunded."]
    assert os.stat(run.tmp_path / ".touba" / "checkpoints.sqlite").st_mode & 0o077 == 0
    assert os.stat(run.tmp_path / ".touba" / "resources.sqlite").st_mode & 0o077 == 0


CHECKS: dict[str, Callable[[PageRun], None]] = {
    "docs/concepts/decision-history.md": _decision_history,
    "docs/openai-agents-sessions.md": _openai_agents_sessions,
    "docs/testing.md": _testing,
    "docs/concepts/key-events.md": _key_events,
    "docs/concepts/chat-memory.md": _chat_memory,
    "docs/runtime.md": _runtime,
}

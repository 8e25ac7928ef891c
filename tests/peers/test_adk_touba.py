"""The ADK contract suite's factory for touba (``make peers``) is wired as run_adk.py runs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.peers import adk_touba
from tests.peers._suites import suite

ROOT = Path(__file__).resolve().parents[2]


def test_touba_declares_no_divergence_from_adks_contract() -> None:
    assert adk_touba.DIVERGENCES == {}


@pytest.mark.parametrize("store", ["memory", "sqlite"])
def test_the_factory_runs_contract_tests_on_a_local_store(store: str) -> None:
    env = adk_touba.suite_env(store, ROOT)
    command = [
        "bash",
        str(suite("adk") / "run.sh"),
        sys.executable,
        "-q",
        "-k",
        "round_trips or stale_session_copy or reopened_store",
    ]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    expected = "1 passed, 2 skipped" if store == "memory" else "3 passed"
    assert expected in done.stdout, done.stdout
    assert "xfail" not in done.stdout

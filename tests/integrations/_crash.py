"""Kill a worker inside a reservation, from a test."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def die_holding(backend: str, directory: Path, name: str, key: str) -> None:
    """Run ``_holder`` and wait until it has died holding ``key``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    with subprocess.Popen(
        [sys.executable, "-m", "tests.integrations._holder", backend, str(directory), name, key],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=env,
    ) as process:
        assert process.stdout is not None
        assert process.stdout.readline().strip() == "held"
        assert process.wait(timeout=30) == -9

"""Running ``tests/_fault_worker.py`` scenarios under libfiu's ``fiu-run``.

``run_faulted(scenario, directory)`` runs one scenario in a child process
whose system calls libfiu can make fail, and returns what it saw. Without
``fiu-run`` (Debian's ``fiu-utils``; ``.ci/run`` installs it) the test is
skipped with the reason, except under ``CI=true``, where that is a failure,
as for the PostgreSQL and Redis servers (:mod:`tests._services`).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests._services import unavailable

__all__ = ["run_faulted"]

ROOT = Path(__file__).resolve().parents[1]


def _fiu_run() -> str:
    path = shutil.which("fiu-run")
    if path is None:
        unavailable(
            "fiu-run is not installed (disk-fault tests inject real syscall failures with "
            "libfiu): apt-get install fiu-utils"
        )
    return path


def run_faulted(scenario: str, directory: Path, *, timeout: float = 120) -> dict[str, Any]:
    """Run ``scenario`` under ``fiu-run -x`` over files in ``directory`` (0700)."""
    command = [_fiu_run(), "-x", "-f", "", sys.executable, "-m", "tests._fault_worker"]
    done = subprocess.run(
        [*command, scenario, str(directory)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if done.returncode != 0:
        raise AssertionError(f"scenario {scenario} failed ({done.returncode}):\n{done.stderr}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result

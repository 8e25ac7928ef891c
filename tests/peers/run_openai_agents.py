"""Run openai-agents' own session tests against ToubaSession (``make peers``).

The suite is fetched at run time, never copied into this repository: the
source distribution of the pinned version is downloaded with ``pip download``
into ``.peers/`` (gitignored, reused while the version stays the same), and
its session test modules run with ``openai_agents_plugin`` swapping
``SQLiteSession`` for ``ToubaSession``. The installed SDK must be the pinned
version, so that the tests match the code they exercise.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import tarfile
from pathlib import Path

VERSION = "0.24.0"  # keep equal to the dev extra's openai-agents pin in pyproject.toml
# The session modules, then every runner module that runs with a SQLiteSession (the
# compaction modules are left out: they drive SQLiteSession's private compaction snapshot),
# then the modules running sessions under Runner.run_streamed with the suite's
# SimpleListSession, swapped for a ToubaSession too (openai_agents_plugin.STREAMED).
MODULES = (
    "tests/memory/test_session.py",
    "tests/memory/test_session_limit.py",
    "tests/test_agent_runner.py",
    "tests/test_agent_runner_streamed.py",
    "tests/test_max_turns.py",
    "tests/test_soft_cancel.py",
    "tests/test_tool_batch_failure_history.py",
    "tests/test_native_tool_failure_history.py",
    "tests/test_tool_failure_boundaries.py",
    "tests/test_programmatic_tool_calling.py",
    "tests/test_cancel_streaming.py",
    "tests/deferred_session_writes/test_filters.py",
    "tests/deferred_session_writes/test_max_turns.py",
    "tests/deferred_session_writes/test_resume.py",
    "tests/test_runtime_symmetry_contract.py",
)
ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".peers"


def fetch() -> Path:
    """The unpacked sdist of the pinned version, downloaded once."""
    source = CACHE / f"openai_agents-{VERSION}"
    if (source / "tests").is_dir():
        return source
    CACHE.mkdir(mode=0o700, exist_ok=True)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--no-deps",
            "--no-binary",
            ":all:",
            f"openai-agents=={VERSION}",
            "--dest",
            str(CACHE),
        ],
        check=True,
    )
    archive = CACHE / f"openai_agents-{VERSION}.tar.gz"
    with tarfile.open(archive) as tar:
        tar.extractall(CACHE, filter="data")
    return source


def main() -> int:
    installed = importlib.metadata.version("openai-agents")
    if installed != VERSION:
        print(
            f"openai-agents {installed} is installed, the peer suite is pinned to {VERSION}: "
            f'install it (pip install "openai-agents=={VERSION}") or update VERSION',
            file=sys.stderr,
        )
        return 2
    source = fetch()
    env = dict(os.environ)
    # The sdist's tests import helpers from its own ``tests`` package; the plugin lives here.
    env["PYTHONPATH"] = os.pathsep.join(
        [str(source), str(ROOT / "tests" / "peers"), env.get("PYTHONPATH", "")]
    ).rstrip(os.pathsep)
    command = [
        sys.executable,
        "-m",
        "pytest",
        *MODULES,
        "-p",
        "openai_agents_plugin",
        "-p",
        "no:cacheprovider",
        "-q",
        "-o",
        "addopts=",
        "--rootdir",
        str(source),
    ]
    return subprocess.run(command, cwd=source, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())

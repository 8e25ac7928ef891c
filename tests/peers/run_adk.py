"""Run the ADK session-service contract suite (peers/adk) on ADK's services and on touba's.

``make peers`` runs it: once for ADK's own services (the suite's default
backends), then once per touba store with ``tests/peers/adk_touba.py`` as the
factory (PostgreSQL and Redis isolated by a schema / key prefix per run,
removed at the end). ToubaSessionService declares no divergence: any failing
contract test fails the run. ``python tests/peers/run_adk.py sqlite redis``
runs only the stores named (``default`` names ADK's own run).
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Final

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.peers import adk_touba  # noqa: E402
from tests.peers._suites import suite  # noqa: E402

RUNS = ("default", *adk_touba.STORES)
# ADK's own SqliteSessionService loses the suite's race of two writers from one
# snapshot only when their appends interleave (the suite declares that divergence as a
# strict xfail): on a busy machine it sometimes does not, the xfail passes and the
# strict marker fails the run (CI, 2026-12-07). That outcome is ADK's timing, not
# touba's; the baseline run leaves that one case out. Every touba run keeps it.
BASELINE_RACE: Final = "not (test_concurrent_writers_from_one_snapshot_exactly_one_wins and sqlite)"


def run(store: str) -> int:
    """One run of the suite; its exit status."""
    if store == "default":
        env = {k: v for k, v in os.environ.items() if not k.startswith("ADK_SESSION_SERVICE_")}
    else:
        env = adk_touba.suite_env(store, ROOT, ADK_TOUBA_RUN=secrets.token_hex(4))
    print(f"== ADK session contract: {store}", flush=True)
    command = ["bash", str(suite("adk") / "run.sh"), sys.executable, "-q"]
    if store == "default":
        command += ["-k", BASELINE_RACE]
    try:
        return subprocess.run(command, cwd=ROOT, env=env).returncode
    finally:
        if store != "default":
            os.environ["ADK_TOUBA_RUN"] = env["ADK_TOUBA_RUN"]
            try:
                adk_touba.cleanup(store)
            except Exception as e:  # a server that is down: the run failed already
                print(f"cleanup of {store} failed: {e}", file=sys.stderr)


def main(argv: list[str]) -> int:
    stores = argv or list(RUNS)
    unknown = [s for s in stores if s not in RUNS]
    if unknown:
        print(f"unknown store(s) {unknown}; choose from {RUNS}", file=sys.stderr)
        return 2
    failed = [s for s in stores if run(s) != 0]
    if failed:
        print(f"ADK contract suite failed on: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Run langgraph-checkpoint-conformance against ToubaSaver on every store (``make peers``).

For each store (``memory``, ``sqlite``, ``postgres``, ``redis``) this runs
``peers/langgraph/run_conformance.py tests.peers.langgraph_savers:STORE`` with this
interpreter, and requires the level FULL with every capability detected, the extended ones
included (``adelete_for_runs``, ``acopy_thread``, ``aprune``): a run that skips one fails
here. ``--stores memory,sqlite`` runs a subset. Exits 1 when any store falls short.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.peers._suites import suite  # noqa: E402

RUNNER = suite("langgraph") / "run_conformance.py"
STORES = ("memory", "sqlite", "postgres", "redis")


def run(store: str) -> bool:
    """Run the suite on one store; True when it reached FULL with nothing skipped."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)]),
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    target = f"tests.peers.langgraph_savers:{store}"
    print(f"== langgraph-checkpoint-conformance: ToubaSaver on {store}", flush=True)
    done = subprocess.run(
        [sys.executable, str(RUNNER), target],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    sys.stdout.write(done.stdout)
    sys.stderr.write(done.stderr)
    level = re.search(r"^level=(\S+) skipped_capabilities=(\d+)$", done.stdout, re.M)
    ok = done.returncode == 0 and level is not None and level.groups() == ("FULL", "0")
    print(f"== {store}: {'FULL' if ok else 'FAILED'}", flush=True)
    return ok


def main(argv: list[str] | None = None) -> int:
    """Run the chosen stores; 0 when every one reached FULL."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stores", default=",".join(STORES))
    args = parser.parse_args(argv)
    results = {store: run(store) for store in args.stores.split(",") if store}
    failed = [store for store, ok in results.items() if not ok]
    print(f"langgraph conformance: {len(results) - len(failed)} stores FULL, failed: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

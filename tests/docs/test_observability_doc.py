"""docs/operations/observability.md runs as written, in a fresh interpreter.

Its sample sets OpenTelemetry's global tracer provider, which a process may set once:
run in the test process, it would take the place of the provider the telemetry tests
set (or find theirs). So the page's python blocks run, in order, in a script of their
own, and each ```output block is checked against what that script printed.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.docs._blocks import DOCS, ROOT, blocks_of, check_output

PAGE = DOCS / "operations" / "observability.md"


def test_the_console_exporter_sample_prints_the_spans(tmp_path: Path) -> None:
    blocks = blocks_of(PAGE)
    assert [b.language for b in blocks] == ["python", "output"]
    script = tmp_path / "sample.py"
    script.write_text(blocks[0].code, encoding="utf-8")
    done = subprocess.run(
        [sys.executable, "-W", "error", str(script)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"},
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    check_output(PAGE, blocks[1], done.stdout)
    # Every span the page's table names for an invocation with one call was printed.
    names = [line.split(" {")[0] for line in done.stdout.splitlines()]
    assert names.count("chat scripted") == 2
    assert names[-1] == "invoke_agent support"

"""``touba panel`` as a real process on a free port: start, find its URL, stop it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_URL = re.compile(r"open (http://\S+)")


@dataclass
class Served:
    """A running panel: its base URL, its login URL, and what it wrote to stderr."""

    base: str
    login: str
    process: subprocess.Popen[str]
    errors: list[str] = field(default_factory=list)


def panel_env(**extra: str) -> dict[str, str]:
    env = {**os.environ, **extra}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT)])
    return env


@contextmanager
def serve(args: Sequence[str], cwd: Path, **env: str) -> Iterator[Served]:
    """Run ``touba panel ARGS --port 0`` in ``cwd`` until the block ends (SIGINT, then kill)."""
    process = subprocess.Popen(
        [sys.executable, "-m", "touba.cli", "panel", *args, "--port", "0"],
        cwd=cwd,
        env=panel_env(**env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    assert process.stderr is not None
    errors: list[str] = []
    reader = threading.Thread(target=lambda: errors.extend(process.stderr), daemon=True)  # type: ignore[arg-type]
    reader.start()
    try:
        line = process.stdout.readline()
        found = _URL.search(line)
        if found is None:
            process.wait(timeout=10)
            reader.join(timeout=5)
            raise AssertionError(f"the panel did not start: {line!r} {''.join(errors)}")
        url = found.group(1)
        base = url.split("/?")[0].rstrip("/")
        yield Served(base, url, process, errors)
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        reader.join(timeout=5)
        process.stdout.close()
        process.stderr.close()

"""Arguments that are not UTF-8: every command refuses them with ConfigurationError, exit 1.

The bytes reach the real command line (a subprocess), as a shell passes
``$'u\\xff'``; Python decodes them with ``surrogateescape``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

BAD = os.fsdecode(b"u\xff")  # what Python makes of the bytes b"u\xff" on a command line


def _touba(*args: str, cwd: Path, **environment: str) -> subprocess.CompletedProcess[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOUBA_")}
    env.update(COLUMNS="200", **environment)
    argv = [os.fsencode(a) for a in (sys.executable, "-m", "touba.cli", *args)]
    return subprocess.run(argv, capture_output=True, cwd=cwd, env=env, timeout=60)


@pytest.mark.parametrize(
    ("args", "environment"),
    [
        (("events", "ls", "--db", "memory.sqlite", "--user", BAD), {}),
        (("events", "show", BAD, "--db", "memory.sqlite"), {}),
        (("history", "show", BAD, "--db", "history.sqlite"), {}),
        (("history", "ls", "--db", BAD + ".sqlite"), {}),
        (("history", "ls", "--redis-url", "redis://127.0.0.1:6379/0", "--prefix", BAD), {}),
        (("chat", "--db", "memory.sqlite", "-p", "demo", "-a", "support", "-u", BAD), {}),
        (("chat", "--db", "memory.sqlite", "-p", "demo", "-a", "support", "-s", BAD, "--new"), {}),
        (("worker", "--db", "memory.sqlite", "--once"), {"TOUBA_PROGRAM": BAD}),
    ],
)
def test_an_argument_that_is_not_utf8_is_a_configuration_error(
    tmp_path: Path, args: tuple[str, ...], environment: dict[str, str]
) -> None:
    result = _touba(*args, cwd=tmp_path, **environment)
    err = result.stderr.decode(errors="replace")
    assert result.returncode == 1, err
    assert err.startswith("ConfigurationError: ")
    assert "is not UTF-8 text" in err
    assert "Traceback" not in err
    assert list(tmp_path.iterdir()) == []  # nothing was created


def test_a_dsn_in_the_environment_that_is_not_utf8_is_refused(tmp_path: Path) -> None:
    result = _touba("history", "ls", cwd=tmp_path, TOUBA_DSN="postgresql://" + BAD)
    err = result.stderr.decode(errors="replace")
    assert result.returncode == 1, err
    assert "ConfigurationError: TOUBA_DSN is not UTF-8 text" in err


def test_the_argument_is_named_as_the_bytes_typed(tmp_path: Path) -> None:
    result = _touba("events", "ls", "--db", "m.sqlite", "--user", BAD, cwd=tmp_path)
    assert b"argument 6 (b'u\\xff') is not UTF-8 text" in result.stderr

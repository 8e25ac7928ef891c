"""Many SIGKILLed workers, fast: a process that forks one worker per kill.

Starting a Python process and importing touba costs most of a second, too much for
a test that kills a worker a few dozen times. A :class:`Zygote` is one such process,
started once and single-threaded: it imports the worker's module, then for each
:meth:`Zygote.run` forks a child that calls ``function(*args)`` (a plain function,
which runs its own event loop), sleeps ``kill_after`` seconds, SIGKILLs the child if
it still runs, and reports how the child ended. The kill timer (and the time
reported) starts when the child calls :func:`ready` (its setup done); a child that
never calls it is timed from its end. The child starts from the imports
alone: no connection, thread or event loop is shared with it.

``python -m tests._zygote MODULE`` speaks JSON lines on stdin/stdout.
"""

from __future__ import annotations

import importlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Ended:
    """How one forked worker ended: ``killed`` by the zygote, or its exit ``code``."""

    killed: bool
    code: int | None
    seconds: float


class Zygote:
    """A forking process for ``module``'s worker functions (see the module docstring)."""

    def __init__(self, module: str) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
        self._process = subprocess.Popen(
            [sys.executable, "-m", "tests._zygote", module],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def run(self, function: str, *args: Any, kill_after: float | None, fork: bool = True) -> Ended:
        """Fork a child running ``function(*args)``; SIGKILL it after ``kill_after``
        seconds (None: let it end). ``fork=False`` runs it in the zygote itself, to
        warm it up (first-time costs paid once, before the children fork); it must
        leave no thread behind."""
        assert self._process.stdin is not None
        assert self._process.stdout is not None
        request = {"function": function, "args": list(args), "kill_after": kill_after}
        request["fork"] = fork
        self._process.stdin.write(json.dumps(request) + "\n")
        self._process.stdin.flush()
        line = self._process.stdout.readline()
        if not line:
            raise AssertionError("the zygote process died")
        answer = json.loads(line)
        return Ended(answer["killed"], answer["code"], answer["seconds"])

    def close(self) -> None:
        if self._process.stdin is not None:
            self._process.stdin.close()
        self._process.wait(timeout=30)
        if self._process.stdout is not None:
            self._process.stdout.close()

    def __enter__(self) -> Zygote:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_ready_fd: int | None = None


def ready() -> None:
    """In a forked worker: start the zygote's kill timer now (its setup is done).
    Elsewhere (a warm-up in the zygote, another process): nothing."""
    global _ready_fd
    if _ready_fd is not None:
        os.write(_ready_fd, b"r")
        os.close(_ready_fd)
        _ready_fd = None


def _serve(module_name: str) -> None:
    module = importlib.import_module(module_name)
    for line in sys.stdin:
        request = json.loads(line)
        function = getattr(module, request["function"])
        started = time.monotonic()
        if not request["fork"]:
            function(*request["args"])
            if threading.active_count() != 1:
                raise AssertionError("a warm-up left a thread behind: the zygote cannot fork")
            answer = {"killed": False, "code": 0, "seconds": time.monotonic() - started}
            sys.stdout.write(json.dumps(answer) + "\n")
            sys.stdout.flush()
            continue
        readable, writable = os.pipe()
        pid = os.fork()
        if pid == 0:  # the worker
            global _ready_fd
            os.close(readable)
            _ready_fd = writable
            code = 0
            try:
                function(*request["args"])
            except BaseException:
                traceback.print_exc()
                code = 1
            finally:
                sys.stderr.flush()
                os._exit(code)
        os.close(writable)
        kill_after = request["kill_after"]
        killed = False
        status: int | None = None
        # The worker's time (and the kill timer) starts when it says it is ready
        # (``ready()``), or ends (its end closes the pipe).
        if select.select([readable], [], [], 60)[0]:
            os.read(readable, 1)
        started = time.monotonic()
        if kill_after is not None:
            deadline = started + kill_after
            while status is None and time.monotonic() < deadline:
                done, found = os.waitpid(pid, os.WNOHANG)
                if done:
                    status = found
                else:
                    time.sleep(min(0.0005, max(deadline - time.monotonic(), 0)))
            if status is None:
                os.kill(pid, signal.SIGKILL)
                killed = True
        if status is None:
            _, status = os.waitpid(pid, 0)
        os.close(readable)
        seconds = time.monotonic() - started
        if os.WIFSIGNALED(status):
            answer = {"killed": killed, "code": -os.WTERMSIG(status), "seconds": seconds}
        else:
            answer = {"killed": False, "code": os.WEXITSTATUS(status), "seconds": seconds}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":  # (through the module, so that ``ready`` sees its pipe)
    importlib.import_module("tests._zygote")._serve(sys.argv[1])

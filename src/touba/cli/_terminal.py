"""The keyboard of ``touba chat``: lines typed at a prompt, and Ctrl-C.

Decisions (behaviour a person at the terminal relies on):

- **Ctrl-C during a reply** (a step run by :meth:`Terminal.reply`) cancels that
  step only: :meth:`Terminal.reply` raises :class:`Interrupted` and the chat goes
  on at its prompt. A second Ctrl-C while the cancelled step winds down (it
  releases what it holds) is ignored rather than leaving a store half-written.
- **Ctrl-C at a prompt** (or between steps) ends the wait for a line at once:
  :meth:`Terminal.line` raises :class:`Interrupted`, and the chat leaves as end
  of input (Ctrl-D) does.
- **Reading.** Standard input that the event loop can watch (a terminal, a pipe,
  a socket) is read from its file descriptor when it is readable, never by a
  blocked thread: such a thread would hold the interpreter's exit until Enter is
  pressed (``asyncio.run`` waits for its executor) or crash it (a daemon thread
  holding ``sys.stdin``'s lock). Other input (a regular file, a test runner's
  in-memory stream) never blocks and is read by a thread. Bytes that are not
  UTF-8 are replaced, never fatal.
- The Ctrl-C handler exists only while :class:`Terminal` is active (``with``), in
  the main thread of a loop that supports signal handlers (Unix); elsewhere
  Ctrl-C raises ``KeyboardInterrupt`` as usual.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import stat
import sys
from collections.abc import Awaitable, Iterator
from typing import Any, TypeVar

__all__ = ["Interrupted", "Terminal"]

T = TypeVar("T")
_CHUNK = 65536


class Interrupted(Exception):
    """Ctrl-C stopped the step (a reply, or the wait for a line)."""


def _watchable_fd() -> int | None:
    """Standard input's descriptor when a selector can watch it (tty, pipe, socket)."""
    try:
        fd = sys.stdin.fileno()
        mode = os.fstat(fd).st_mode
    except (AttributeError, OSError, ValueError):  # an in-memory stream, a closed one
        return None
    return fd if stat.S_ISCHR(mode) or stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode) else None


class Terminal:
    """Prompts and interruptible steps over one event loop (see the module docstring)."""

    def __init__(self) -> None:
        self._fd = _watchable_fd()
        self._buffer = b""
        self._eof = False
        self._step: asyncio.Future[Any] | None = None
        self._interrupted = False
        self._handled = False

    @contextlib.contextmanager
    def handling_ctrl_c(self) -> Iterator[None]:
        """Handle Ctrl-C (SIGINT) as the module docstring says, within this block."""
        loop = asyncio.get_running_loop()
        try:
            loop.add_signal_handler(signal.SIGINT, self._on_ctrl_c)
            self._handled = True
        except (NotImplementedError, RuntimeError, ValueError):  # Windows, another thread
            self._handled = False
        try:
            yield
        finally:
            if self._handled:
                loop.remove_signal_handler(signal.SIGINT)
                self._handled = False

    def _on_ctrl_c(self) -> None:
        step = self._step
        if step is None or step.done():  # between steps: leave at the next prompt
            self._interrupted = True
        elif not self._interrupted:
            self._interrupted = True
            step.cancel()

    async def _run(self, step: Awaitable[T]) -> T:
        task: asyncio.Future[T] = asyncio.ensure_future(step)
        self._step = task
        try:
            return await task
        except asyncio.CancelledError:
            if not self._interrupted or not task.cancelled():
                raise  # this coroutine itself was cancelled: not ours to swallow
            raise Interrupted from None
        finally:
            self._step = None
            self._interrupted = False

    async def reply(self, step: Awaitable[T]) -> T:
        """Run ``step``; :class:`Interrupted` once Ctrl-C has cancelled it."""
        self._interrupted = False
        return await self._run(step)

    async def line(self) -> str | None:
        """The next line (without its end), None at end of input; :class:`Interrupted`
        on Ctrl-C, or when Ctrl-C was pressed since the last step."""
        if self._interrupted:
            self._interrupted = False
            raise Interrupted
        return await self._run(self._read_line())

    async def _read_line(self) -> str | None:
        if self._fd is None:
            text = await asyncio.to_thread(sys.stdin.readline)
            return text.rstrip("\r\n") if text else None
        while b"\n" not in self._buffer and not self._eof:
            await self._readable(self._fd)
            chunk = os.read(self._fd, _CHUNK)
            self._eof = not chunk
            self._buffer += chunk
        if not self._buffer:
            return None
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line.decode("utf-8", errors="replace").rstrip("\r")

    async def _readable(self, fd: int) -> None:
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[None] = loop.create_future()

        def wake() -> None:
            if not ready.done():
                ready.set_result(None)

        try:
            loop.add_reader(fd, wake)
        except (OSError, ValueError, NotImplementedError):  # not watchable after all
            return
        try:
            await ready
        finally:
            loop.remove_reader(fd)

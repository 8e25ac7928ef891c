"""A loopback TCP relay that cuts a connection on demand, for clients that heal idle cuts.

Killing an idle client connection from the server (``CLIENT KILL``) no longer fails the
next command of a current redis-py: the pool sees the dead socket and connects again
before sending. To fail a command for real, a test puts this relay between the client
and the server and arms it: the next chunk a client sends is dropped and both sides of
that connection are closed, so the command is lost in flight and its reply never comes.
Armed with ``"reply"``, the command reaches the server and its reply is lost instead (the
server ran it, the client never hears so); with ``"swallow"``, every chunk sent is dropped
and nothing is closed (a server that never answers). Other connections, and those opened
after the cut, are relayed untouched.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class TcpCut:
    """Relays 127.0.0.1:``port`` to ``target``; :meth:`arm` cuts the next command sent."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.port = 0
        self.cuts = 0
        self.mode = ""
        self.times = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def arm(self, mode: str = "command", times: int = 1) -> None:
        """Lose the next ``times`` chunks sent: ``"command"`` drops each and cuts its
        connection, ``"reply"`` passes each on and cuts its connection before the reply
        comes back, ``"swallow"`` drops them while armed (``arm("", 0)`` disarms)."""
        self.mode, self.times = mode, times

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
        await asyncio.sleep(0)  # the closed transports' last callbacks run before the loop ends

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        writers = [writer]
        lose_reply = asyncio.Event()
        back: asyncio.Task[None] | None = None
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
            writers.append(up_writer)
            back = asyncio.create_task(self._back(up_reader, writer, lose_reply))
            while chunk := await reader.read(65536):
                if self.times and self.mode == "swallow":
                    continue
                if self.times:
                    self.times -= 1
                    self.cuts += 1
                    if self.mode == "command":
                        break  # dropped: the command never reaches the server
                    lose_reply.set()  # "reply": the server runs it, the answer is lost
                up_writer.write(chunk)
                await up_writer.drain()
                if lose_reply.is_set():
                    await back
                    break
        except (ConnectionError, asyncio.CancelledError):
            pass  # a relay ends quietly: the client sees its connection closed
        finally:
            for open_writer in writers:  # synchronous, so a cancellation leaves none open
                open_writer.close()
            if back is not None:
                back.cancel()
                await asyncio.gather(back, return_exceptions=True)
            self._tasks.discard(task)

    @staticmethod
    async def _back(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, lose: asyncio.Event
    ) -> None:
        with contextlib.suppress(ConnectionError):
            while chunk := await reader.read(65536):
                if lose.is_set():
                    return  # the reply is dropped and the connection closed
                writer.write(chunk)
                await writer.drain()


@contextlib.asynccontextmanager
async def tcp_cut(host: str, port: int) -> AsyncIterator[TcpCut]:
    """A started :class:`TcpCut` in front of ``host:port``, closed on exit."""
    relay = TcpCut(host, port)
    await relay.start()
    try:
        yield relay
    finally:
        await relay.close()

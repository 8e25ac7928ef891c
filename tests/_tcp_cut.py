"""A loopback TCP relay that cuts a connection on demand, for clients that heal idle cuts.

Killing an idle client connection from the server (``CLIENT KILL``) no longer fails the
next command of a current redis-py: the pool sees the dead socket and connects again
before sending. To fail a command for real, a test puts this relay between the client
and the server and arms it: the next chunk a client sends is dropped and both sides of
that connection are closed, so the command is lost in flight and its reply never comes.
Other connections, and those opened after the cut, are relayed untouched.
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
        self._armed = False
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def arm(self) -> None:
        """Cut the connection that sends the next chunk, dropping that chunk."""
        self._armed = True

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
        back: asyncio.Task[None] | None = None
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
            writers.append(up_writer)
            back = asyncio.create_task(self._copy(up_reader, writer))
            while chunk := await reader.read(65536):
                if self._armed:
                    self._armed = False
                    self.cuts += 1
                    break  # dropped: the command never reaches the server
                up_writer.write(chunk)
                await up_writer.drain()
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
    async def _copy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while chunk := await reader.read(65536):
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

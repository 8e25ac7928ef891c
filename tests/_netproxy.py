"""A loopback TCP proxy that makes a network slow, cut or silent, for tests and benches.

:class:`NetProxy` listens on 127.0.0.1 (a free port) and relays every connection to a
target server from a thread of its own, so it serves synchronous and asynchronous
clients, in this process or another, alike. While it runs, a test can:

- :meth:`NetProxy.delay` add round-trip time: each chunk waits half of it on its way
  up and half on its way back, in order;
- :meth:`NetProxy.cut` reset every open connection at once (an RST, as a crashed
  peer or a firewall that forgets the flow), or :meth:`NetProxy.cut_on` reset the
  connection that sends the n-th chunk from now, before that chunk reaches the server
  (a cut in the middle of a transaction);
- :meth:`NetProxy.refuse` reset every open connection and each new one at once (a
  server that is down: its clients fail fast, as on a refused connection), until
  :meth:`NetProxy.restore`;
- :meth:`NetProxy.black_hole` drop every byte both ways and close nothing, new
  connections included (packets dropped, no RST: a client waits until its own
  deadline), and :meth:`NetProxy.restore` end it; connections opened during the
  outage stay dead, as they would after a real one.

It also counts round trips (:attr:`NetProxy.round_trips`): a chunk a client sends
after it has heard from the server (or as the first of its connection) starts one. A
request split over several chunks before any reply counts once; pipelined requests
count once, which is what a round trip costs. ``reset_counts()`` starts a count.

Loopback only: the target must be a loopback address, so no test can reach further.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
import struct
import threading
import time
from collections.abc import Iterator
from urllib.parse import urlsplit, urlunsplit

__all__ = ["NetProxy", "net_proxy"]

CHUNK = 65536


class NetProxy:
    """Relays 127.0.0.1:``port`` to ``host:target_port``; see the module docstring."""

    def __init__(self, host: str, target_port: int) -> None:
        if not ipaddress.ip_address(socket.gethostbyname(host)).is_loopback:
            raise ValueError(f"NetProxy relays to loopback only, not {host!r}")
        self.target = (host, target_port)
        self.port = 0
        self.round_trips = 0
        self.connections = 0
        self._one_way = 0.0
        self._silent = False
        self._refusing = False
        self._cut_countdown = 0
        self._lock = threading.Lock()
        self._links: set[_Link] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.Server | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()

    # --- controls (any thread) -------------------------------------------------------

    def delay(self, rtt_ms: float) -> None:
        """Add ``rtt_ms`` milliseconds to every round trip from now on (0 removes it)."""
        self._one_way = max(0.0, rtt_ms) / 2000.0

    def black_hole(self) -> None:
        """Drop every byte both ways, closing nothing, until :meth:`restore`."""
        self._silent = True

    def refuse(self) -> None:
        """Reset every open connection, and each new one as it comes, until
        :meth:`restore`: the server is down."""
        self._refusing = True
        self.cut()

    def restore(self) -> None:
        """End a black hole or a refusal; connections that lived through a black hole
        stay silent (reset them with :meth:`cut` if the test wants the client to see
        them fail at once)."""
        with self._lock:
            for link in self._links:
                link.dead = True
        self._silent = self._refusing = False

    def cut(self) -> int:
        """Reset every open connection now; returns how many were cut."""
        with self._lock:
            links = list(self._links)
        loop = self._loop
        if loop is not None:
            for link in links:
                loop.call_soon_threadsafe(link.reset)
        return len(links)

    def cut_on(self, nth: int = 1) -> None:
        """Reset the connection that sends the ``nth`` client chunk from now, dropping it."""
        with self._lock:
            self._cut_countdown = nth

    def reset_counts(self) -> None:
        self.round_trips = 0
        self.connections = 0

    def dsn(self, dsn: str) -> str:
        """``dsn`` (a PostgreSQL URL or a ``key=value`` string) pointed at this proxy."""
        if "://" in dsn:
            return self.url(dsn)
        fields = dict(item.split("=", 1) for item in dsn.split() if "=" in item)
        fields["host"], fields["port"] = "127.0.0.1", str(self.port)
        return " ".join(f"{k}={v}" for k, v in fields.items())

    def url(self, url: str) -> str:
        """``url`` (``redis://``, ``postgresql://``, ``http://``) pointed at this proxy."""
        parts = urlsplit(url)
        userinfo = parts.netloc.rpartition("@")[0]
        netloc = f"{userinfo}@" if userinfo else ""
        return urlunsplit(parts._replace(netloc=f"{netloc}127.0.0.1:{self.port}"))

    # --- lifecycle ---------------------------------------------------------------------

    def start(self) -> NetProxy:
        self._thread = threading.Thread(target=self._run, name="netproxy", daemon=True)
        self._thread.start()
        if not self._started.wait(10):
            raise RuntimeError("the proxy did not start")
        return self

    def close(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        self._loop = self._thread = None

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        self._loop = loop
        self._server = loop.run_until_complete(
            asyncio.start_server(self._accept, "127.0.0.1", 0, limit=CHUNK)
        )
        self.port = self._server.sockets[0].getsockname()[1]
        self._started.set()
        try:
            loop.run_forever()
        finally:
            self._server.close()
            for link in list(self._links):
                link.reset()
            tasks = asyncio.all_tasks(loop)
            if tasks:  # reset links end their relays: let them, rather than cancel them
                # (a cancelled connection task makes Python 3.11's asyncio.streams log a
                # CancelledError traceback from its done callback)
                loop.run_until_complete(asyncio.wait(tasks, timeout=1.0))
            tasks = {task for task in tasks if not task.done()}
            for task in tasks:
                task.cancel()
            if tasks:
                loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            loop.close()

    # --- relaying ------------------------------------------------------------------------

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        link = _Link(writer)
        with self._lock:
            self._links.add(link)
        try:
            if self._refusing:  # the server is down
                return  # (finally: reset)
            if self._silent:  # accepted by the kernel, never answered
                link.dead = True
                while await reader.read(CHUNK):
                    pass
                return
            up_reader, up_writer = await asyncio.open_connection(*self.target)
            link.upstream = up_writer
            await asyncio.gather(
                self._pipe(link, reader, up_writer, up=True),
                self._pipe(link, up_reader, writer, up=False),
            )
        except (ConnectionError, OSError, asyncio.IncompleteReadError):
            pass
        finally:
            link.reset()
            with self._lock:
                self._links.discard(link)

    async def _pipe(
        self, link: _Link, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, up: bool
    ) -> None:
        queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()
        sender = asyncio.create_task(self._send(link, queue, writer))
        try:
            while chunk := await reader.read(CHUNK):
                if up and self._take_cut():
                    link.reset()
                    return
                if self._silent or link.dead:
                    continue
                if up:
                    if link.answered:
                        self.round_trips += 1
                        link.answered = False
                else:
                    link.answered = True
                queue.put_nowait((time.monotonic() + self._one_way, chunk))
        finally:
            queue.put_nowait(None)
            with contextlib.suppress(ConnectionError, OSError):
                await sender
            link.reset()

    async def _send(
        self,
        link: _Link,
        queue: asyncio.Queue[tuple[float, bytes] | None],
        writer: asyncio.StreamWriter,
    ) -> None:
        while (item := await queue.get()) is not None:
            due, chunk = item
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            if self._silent or link.dead:
                continue
            writer.write(chunk)
            await writer.drain()

    def _take_cut(self) -> bool:
        with self._lock:
            if not self._cut_countdown:
                return False
            self._cut_countdown -= 1
            return self._cut_countdown == 0


class _Link:
    """One relayed connection: its two sockets and its state."""

    def __init__(self, client: asyncio.StreamWriter) -> None:
        self.client = client
        self.upstream: asyncio.StreamWriter | None = None
        self.answered = True  # the first chunk a client sends starts a round trip
        self.dead = False

    def reset(self) -> None:
        """Close both sides with an RST (SO_LINGER 0), not a polite FIN."""
        for writer in (self.client, self.upstream):
            if writer is None or writer.is_closing():
                continue
            sock = writer.get_extra_info("socket")
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()


@contextlib.contextmanager
def net_proxy(host: str, port: int) -> Iterator[NetProxy]:
    """A started :class:`NetProxy` in front of ``host:port``, closed on exit."""
    proxy = NetProxy(host, port).start()
    try:
        yield proxy
    finally:
        proxy.close()

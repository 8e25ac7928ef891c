"""A Redis Cluster of this machine's ``redis-server``, for tests and benches.

:func:`redis_cluster` starts ``nodes`` masters on free loopback ports (no replicas,
nothing kept on disk but their cluster files, in ``root``), joins them with
``redis-cli --cluster create``, waits until every node sees the cluster ok, and
stops them on exit. :func:`missing` says why it cannot run here (None when it can).
"""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = ["cli", "free_ports", "missing", "redis_cluster"]


def missing() -> str | None:
    """Why no cluster can start on this machine, or None."""
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        return "redis-server and redis-cli are not installed (Debian's redis package)"
    return None


def cli(*args: str) -> str:
    """``redis-cli`` with ``args``: its output and errors."""
    done = subprocess.run(
        ["redis-cli", *args], capture_output=True, text=True, timeout=30, check=False
    )
    return done.stdout + done.stderr


@contextmanager
def redis_cluster(root: Path, nodes: int = 3) -> Iterator[list[int]]:
    """A cluster of ``nodes`` masters on loopback; yields their ports."""
    ports = free_ports(nodes)
    started = []
    try:
        for port in ports:
            directory = root / str(port)
            directory.mkdir()
            started.append(
                subprocess.Popen(
                    [
                        "redis-server",
                        "--port", str(port),
                        "--bind", "127.0.0.1",
                        "--cluster-enabled", "yes",
                        "--cluster-config-file", "nodes.conf",
                        "--cluster-node-timeout", "5000",
                        "--save", "",
                        "--appendonly", "no",
                        "--dir", str(directory),
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )  # fmt: skip
        for port in ports:
            _wait(lambda p=port: "PONG" in cli("-p", str(p), "ping"), f"node {port} to start")
        addresses = [f"127.0.0.1:{p}" for p in ports]
        cli("--cluster", "create", *addresses, "--cluster-replicas", "0", "--cluster-yes")
        for port in ports:
            _wait(
                lambda p=port: "cluster_state:ok" in cli("-p", str(p), "cluster", "info"),
                f"node {port} to see the cluster ok",
            )
        yield ports
    finally:
        for node in started:
            node.terminate()
        for node in started:
            node.wait(timeout=10)


def free_ports(count: int) -> list[int]:
    """Ports free for a node and for its cluster bus (the port + 10000)."""
    ports: list[int] = []
    candidate = random.randrange(20000, 40000)  # two clusters at once rarely meet
    while len(ports) < count and candidate < 55000:
        candidate += 7
        if all(_free(p) for p in (candidate, candidate + 10000)):
            ports.append(candidate)
    return ports


def _free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _wait(ready: Any, what: str, seconds: float = 20) -> None:
    deadline = time.monotonic() + seconds
    while not ready():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.05)

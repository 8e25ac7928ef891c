"""Private PostgreSQL and Redis servers that a test may kill -9 and restart.

The shared servers of the tests (``tests/_services.py``) must never be killed; these
run on a free loopback port, in a temporary directory of their own, and belong to the
test that started them:

- ``running_postgres()``: a fresh cluster from the machine's ``initdb`` (found with
  ``pg_config --bindir``, then ``/usr/lib/postgresql/<n>/bin``, then ``PATH``), trust
  authentication for ``postgres``, TCP on 127.0.0.1 only, ``fsync`` and
  ``synchronous_commit`` on (an acknowledged commit is on disk, as in production).
  PostgreSQL refuses to run as root: under root, ``initdb`` and ``postgres`` run as the
  ``postgres`` user (or ``nobody``), in a directory that user owns.
- ``running_redis()``: ``redis-server`` with ``appendonly yes``, ``appendfsync always``,
  ``aof-load-truncated no`` and no RDB snapshots unless told otherwise (``settings=``).
  A crash can cut the append-only file's last write short; the server then refuses to
  start, and ``start()`` repairs the file with ``redis-check-aof --fix`` (which cuts it
  before the unfinished MULTI block) and starts it again, as an operator would
  (``aof_fixes`` counts the repairs). Redis's default, ``aof-load-truncated yes``,
  truncates such a file after the block's complete commands, and the next restart
  applies them (``test_private_servers.py`` shows it).

Both yield a server object with ``kill9()`` (SIGKILL to the whole server: the
postmaster and every backend, as a machine crash would), ``restart()`` (start again on
the same port and directory, return once it accepts connections: PostgreSQL after its
crash recovery, Redis after loading its append-only file), ``stop()`` (a clean
shutdown), ``start()``, ``running`` and its address (``dsn`` / ``url``, ``port``).

A missing binary raises ``ServerUnavailable`` (a bench script prints it); under pytest,
``require(...)`` / the ``*_or_skip`` context managers turn it into
``tests._services.unavailable`` (a skip, a failure under ``CI=true``).
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import TypeVar

__all__ = [
    "PrivatePostgres",
    "PrivateRedis",
    "ServerUnavailable",
    "free_port",
    "postgres_bindir",
    "private_postgres_or_skip",
    "private_redis_or_skip",
    "require",
    "running_postgres",
    "running_redis",
]

READY_SECONDS = 60.0
STOP_SECONDS = 30.0
REDIS_DURABLE: Mapping[str, str] = {
    "appendonly": "yes",
    "appendfsync": "always",
    "aof-load-truncated": "no",
    "save": "",
}
# What redis-server logs when it refuses an append-only file a crash cut short.
AOF_CUT = "Unexpected end of file reading the append only file"

T = TypeVar("T")


class ServerUnavailable(RuntimeError):
    """The machine cannot run this private server (a binary is missing); the text says why."""


def free_port() -> int:
    """A loopback TCP port nobody listens on now (the kernel's choice)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def postgres_bindir() -> Path:
    """The directory holding ``initdb`` and ``postgres``, or ``ServerUnavailable``."""
    candidates: list[Path] = []
    pg_config = shutil.which("pg_config")
    if pg_config is not None:
        done = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True, check=False)
        if done.returncode == 0 and done.stdout.strip():
            candidates.append(Path(done.stdout.strip()))
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=_version, reverse=True)
    candidates.extend(Path(path) for path in versions)
    initdb = shutil.which("initdb")
    if initdb is not None:
        candidates.append(Path(os.path.realpath(initdb)).parent)
    for directory in candidates:
        if (directory / "initdb").is_file() and (directory / "postgres").is_file():
            return directory
    raise ServerUnavailable(
        "PostgreSQL's initdb and postgres are not installed (pg_config --bindir, "
        "/usr/lib/postgresql/<n>/bin, PATH): install the server package (Debian's postgresql)"
    )


def _version(path: str) -> int:
    name = Path(path).parent.name
    return int(name) if name.isdigit() else 0


class _Server:
    """A server process of our own: started in a new session, so one signal reaches all."""

    name = "server"

    def __init__(self, directory: Path, port: int) -> None:
        self.directory = directory
        self.port = port
        self.process: subprocess.Popen[bytes] | None = None
        self.kills = 0
        self.log_path = directory / f"{self.name}.log"

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def _command(self) -> list[str]:
        raise NotImplementedError

    def _user(self) -> int | None:
        return None

    def _accepts(self) -> bool:
        raise NotImplementedError

    def start(self, timeout: float = READY_SECONDS) -> None:
        """Start the server; return once it accepts connections (after any recovery)."""
        if self.running:
            return
        log = open(self.log_path, "ab")  # noqa: SIM115 (the child holds it; closed below)
        try:
            user = self._user()
            self.process = subprocess.Popen(
                self._command(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.directory,
                start_new_session=True,
                user=user,
                group=None if user is None else pwd.getpwuid(user).pw_gid,
                extra_groups=None if user is None else [],
            )
        finally:
            log.close()
        self._wait_ready(timeout)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.running:
                raise RuntimeError(f"the private {self.name} exited at start:\n{self.log_tail()}")
            if self._accepts():
                return
            time.sleep(0.05)
        raise RuntimeError(
            f"the private {self.name} is not ready after {timeout} s:\n{self.log_tail()}"
        )

    def kill9(self) -> None:
        """SIGKILL the server and every process it started (a crash); wait until they are gone."""
        process = self.process
        if process is None or process.poll() is not None:
            return
        with suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        self._wait_group_gone(process.pid)
        self.kills += 1

    def restart(self, timeout: float = READY_SECONDS) -> None:
        """Start the server again on the same port and data; return once it accepts connections."""
        if self.running:
            self.stop()
        self.start(timeout)

    def stop(self, timeout: float = STOP_SECONDS) -> None:
        """A clean shutdown (SIGINT to PostgreSQL, SIGTERM to Redis); SIGKILL after ``timeout``."""
        process = self.process
        if process is None or process.poll() is not None:
            return
        process.send_signal(self._stop_signal())
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        self._wait_group_gone(process.pid)

    def _stop_signal(self) -> int:
        return signal.SIGTERM

    @staticmethod
    def _wait_group_gone(pgid: int, seconds: float = 10.0) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            except PermissionError:
                pass
            time.sleep(0.02)

    def log_tail(self, lines: int = 20) -> str:
        """The last lines of the server's log, for a failure message."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


class PrivatePostgres(_Server):
    """A PostgreSQL cluster of our own; ``dsn`` names its ``postgres`` database."""

    name = "postgres"

    def __init__(
        self, directory: Path, port: int, bindir: Path, settings: Mapping[str, str]
    ) -> None:
        super().__init__(directory, port)
        self.bindir = bindir
        self.data = directory / "data"
        self.settings = dict(settings)
        self.dsn = f"postgresql://postgres@127.0.0.1:{port}/postgres"

    def _user(self) -> int | None:
        return _unprivileged_uid()

    def init(self) -> None:
        """Create the cluster (``initdb``, trust authentication, superuser ``postgres``)."""
        done = subprocess.run(
            [
                *(str(self.bindir / "initdb"), "-D", str(self.data), "-A", "trust"),
                *("-U", "postgres", "-E", "UTF8", "--locale=C", "--no-sync", "--no-instructions"),
            ],
            capture_output=True,
            cwd=self.directory,
            user=self._user(),
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"initdb failed: {done.stderr.decode(errors='replace')[-2000:]}")

    def _command(self) -> list[str]:
        settings = {
            "listen_addresses": "127.0.0.1",
            "port": str(self.port),
            "unix_socket_directories": "",
            "fsync": "on",
            "synchronous_commit": "on",
            "full_page_writes": "on",
            "recovery_init_sync_method": "syncfs",  # one syncfs() at crash recovery
            "max_connections": "100",
            "shared_buffers": "32MB",
            **self.settings,
        }
        command = [str(self.bindir / "postgres"), "-D", str(self.data)]
        for key, value in settings.items():
            command += ["-c", f"{key}={value}"]
        return command

    def _stop_signal(self) -> int:
        return signal.SIGINT  # "fast" shutdown, as pg_ctl stop -m fast

    def _accepts(self) -> bool:
        import psycopg

        try:
            with psycopg.connect(self.dsn, connect_timeout=2, autocommit=True) as connection:
                connection.execute("select 1")
        except psycopg.Error:
            return False
        return True


class PrivateRedis(_Server):
    """A ``redis-server`` of our own; ``url`` names its database 0."""

    name = "redis"

    def __init__(
        self, directory: Path, port: int, binary: str, settings: Mapping[str, str]
    ) -> None:
        super().__init__(directory, port)
        self.binary = binary
        self.settings = dict(settings)
        self.url = f"redis://127.0.0.1:{port}/0"
        self.aof_fixes = 0

    def start(self, timeout: float = READY_SECONDS) -> None:
        """Start; when it refuses an append-only file a crash cut short, repair the file
        with ``redis-check-aof --fix`` and start again."""
        logged = self.log_path.stat().st_size if self.log_path.exists() else 0
        try:
            super().start(timeout)
        except RuntimeError:
            with open(self.log_path, "rb") as log:
                log.seek(logged)
                if AOF_CUT not in log.read().decode(errors="replace"):
                    raise
            self.fix_aof()
            super().start(timeout)

    def fix_aof(self) -> None:
        """``redis-check-aof --fix`` on the append-only files (the server stopped)."""
        checker = shutil.which("redis-check-aof")
        if checker is None:
            raise ServerUnavailable("redis-check-aof is not installed (Debian's redis-tools)")
        manifests = glob.glob(str(self.directory / "appendonlydir" / "*.manifest"))
        subprocess.run(
            [checker, "--fix", *manifests],
            input=b"y\n",
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            check=True,
        )
        self.aof_fixes += 1

    def _command(self) -> list[str]:
        settings = {
            "port": str(self.port),
            "bind": "127.0.0.1",
            "dir": str(self.directory),
            "daemonize": "no",
            "protected-mode": "no",
            "logfile": "",
            **self.settings,
        }
        command = [self.binary]
        for key, value in settings.items():
            command += [f"--{key}", value]
        return command

    def _accepts(self) -> bool:
        import redis

        client = redis.Redis(
            host="127.0.0.1", port=self.port, socket_timeout=2, socket_connect_timeout=2
        )
        try:
            return bool(client.ping())
        except redis.RedisError:  # refused, or -LOADING while it reads its append-only file
            return False
        finally:
            client.close()


def _unprivileged_uid() -> int | None:
    """Who PostgreSQL runs as: ourselves, or under root the ``postgres`` user (else ``nobody``)."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        try:
            return pwd.getpwnam(name).pw_uid
        except KeyError:
            continue
    raise ServerUnavailable(
        "running as root with neither a postgres nor a nobody user to run PostgreSQL as"
    )


def _private_directory(prefix: str, owner: int | None) -> Path:
    # Under /tmp itself (not pytest's tmp_path, which is 0700 root's): the server's user
    # must reach it.
    directory = Path(tempfile.mkdtemp(prefix=prefix))
    if owner is not None:
        os.chown(directory, owner, pwd.getpwuid(owner).pw_gid)
    return directory


@contextmanager
def running_postgres(settings: Mapping[str, str] | None = None) -> Iterator[PrivatePostgres]:
    """A fresh private PostgreSQL cluster, started; stopped and deleted on exit.

    Raises ``ServerUnavailable`` when the binaries are missing.
    """
    bindir = postgres_bindir()
    directory = _private_directory("touba-pg-", _unprivileged_uid())
    server = PrivatePostgres(directory, free_port(), bindir, settings or {})
    try:
        server.init()
        server.start()
        yield server
    finally:
        server.stop()
        shutil.rmtree(directory, ignore_errors=True)


@contextmanager
def running_redis(settings: Mapping[str, str] | None = None) -> Iterator[PrivateRedis]:
    """A private ``redis-server`` (``REDIS_DURABLE``, then ``settings``), started; stopped
    and deleted on exit.

    Raises ``ServerUnavailable`` when ``redis-server`` is missing.
    """
    binary = shutil.which("redis-server")
    if binary is None:
        raise ServerUnavailable("redis-server is not installed (Debian's redis-server package)")
    directory = _private_directory("touba-redis-", None)
    server = PrivateRedis(directory, free_port(), binary, {**REDIS_DURABLE, **(settings or {})})
    try:
        server.start()
        yield server
    finally:
        server.stop()
        shutil.rmtree(directory, ignore_errors=True)


def require(make: Callable[[], T]) -> T:
    """``make()``, with ``ServerUnavailable`` turned into a skip (a failure under ``CI=true``)."""
    from tests._services import unavailable

    try:
        return make()
    except ServerUnavailable as e:
        unavailable(str(e))


@contextmanager
def private_postgres_or_skip(
    settings: Mapping[str, str] | None = None,
) -> Iterator[PrivatePostgres]:
    """``running_postgres`` for a test or fixture: a skip (a failure under ``CI=true``)
    when the binaries are missing."""
    manager = running_postgres(settings)
    server = require(manager.__enter__)
    try:
        yield server
    finally:
        manager.__exit__(None, None, None)


@contextmanager
def private_redis_or_skip(settings: Mapping[str, str] | None = None) -> Iterator[PrivateRedis]:
    """``running_redis`` for a test or fixture: a skip (a failure under ``CI=true``) when
    ``redis-server`` is missing."""
    manager = running_redis(settings)
    server = require(manager.__enter__)
    try:
        yield server
    finally:
        manager.__exit__(None, None, None)

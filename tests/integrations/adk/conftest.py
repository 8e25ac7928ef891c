"""Stores for the ADK session-service tests: each backend kind, opened by namespace.

``backend`` names the store kind; ``open_backend(namespace="main", limits=...)``
opens a backend on that store. The same namespace reopens the same data on a
persistent store (``opener.persistent``); different namespaces never share
data (PostgreSQL: another table prefix in the test's schema; Redis: another key
prefix; SQLite: another file). Everything a test creates is removed after it.

``make_opener(kind, directory, name)`` is also called by the crash test's child
process (``_writer.py``) with the test's ``name``: it must then open the same
data (create a schema only if it is absent; the cleanup is the parent's).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.integrations._stores import STORES, create_schema, delete_keys, drop_schema
from touba.integrations.adk._backend import AdkBackend, AdkLimits


@dataclass
class BackendOpener:
    """Opens backends of one kind for one test; closes them all at the end."""

    kind: str
    persistent: bool
    make: Callable[[str, AdkLimits], AdkBackend]
    opened: list[AdkBackend] = field(default_factory=list)

    def __call__(self, namespace: str = "main", limits: AdkLimits | None = None) -> AdkBackend:
        backend = self.make(namespace, limits if limits is not None else AdkLimits())
        self.opened.append(backend)
        return backend


def make_opener(kind: str, directory: Path, name: str) -> tuple[BackendOpener, Callable[[], None]]:
    """An opener of ``kind`` backends for a test named ``name``, and its cleanup."""
    if kind == "memory":
        from touba.integrations.adk._memory import MemoryAdkBackend

        return BackendOpener(kind, False, lambda ns, limits: MemoryAdkBackend(limits)), lambda: None
    if kind == "sqlite":
        from touba.integrations.adk._sqlite import SqliteAdkBackend

        def sqlite(ns: str, limits: AdkLimits) -> AdkBackend:
            return SqliteAdkBackend(str(directory / f"adk-{ns}.sqlite"), limits)

        return BackendOpener(kind, True, sqlite), lambda: None
    if kind == "postgres":
        return _postgres_opener(name)
    if kind == "redis":
        return _redis_opener(name)
    raise AssertionError(f"unknown backend kind {kind!r}")


def _redis_opener(name: str) -> tuple[BackendOpener, Callable[[], None]]:
    """Redis backends under the prefix ``touba-adk-test:<name>:<namespace>:``, deleted after."""
    from tests._services import redis_url
    from touba.integrations.adk._redis import RedisAdkBackend

    url = redis_url()
    prefix = f"touba-adk-test:{name}:"

    def make(ns: str, limits: AdkLimits) -> AdkBackend:
        return RedisAdkBackend(url, limits, prefix=f"{prefix}{ns}:")

    return BackendOpener("redis", True, make), lambda: delete_keys(prefix)


def _postgres_opener(name: str) -> tuple[BackendOpener, Callable[[], None]]:
    """PostgreSQL backends in a schema of the test's own (a namespace: a table prefix in
    it), dropped with everything in it afterwards."""
    from tests._services import postgres_dsn
    from touba.integrations.adk._postgres import PostgresAdkBackend

    dsn = postgres_dsn()
    schema = f"touba_adk_{name}"
    create_schema(schema, exist_ok=True)  # a writer process opens it again

    def postgres(ns: str, limits: AdkLimits) -> AdkBackend:
        return PostgresAdkBackend(dsn, limits, table_prefix=f"{schema}.{ns.replace('-', '_')}")

    return BackendOpener("postgres", True, postgres), lambda: drop_schema(schema)


@pytest.fixture(params=STORES)  # the parent's, with RAM; store_name is the parent's
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def open_backend(
    backend: str, private_dir: Path, store_name: str
) -> AsyncIterator[BackendOpener]:
    opener, cleanup = make_opener(backend, private_dir, store_name)
    try:
        yield opener
    finally:
        for opened in opener.opened:
            await opened.close()
        cleanup()


@pytest.fixture
def adk_backend(open_backend: BackendOpener) -> AdkBackend:
    return open_backend()

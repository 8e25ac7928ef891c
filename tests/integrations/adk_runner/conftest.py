"""A ``ToubaSessionService`` per touba store, and a way to reopen it on the same data.

Each test gets its own SQLite file, PostgreSQL schema or Redis key prefix, removed
afterwards (other sessions of the suite share the servers).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, TypeAlias

import pytest

from tests.integrations import _stores
from tests.integrations._stores import STORES, open_store
from touba.integrations.adk import ToubaSessionService

# ``open()`` is a new ToubaSessionService on the same data
Store: TypeAlias = _stores.Store[ToubaSessionService]


@pytest.fixture(params=STORES)
def store(request: pytest.FixtureRequest, private_dir: Path) -> Iterator[Store]:
    yield from _store(str(request.param), private_dir)


@pytest.fixture(params=STORES[1:])
def persistent_store(request: pytest.FixtureRequest, private_dir: Path) -> Iterator[Store]:
    yield from _store(str(request.param), private_dir)


def _store(name: str, private_dir: Path) -> Iterator[Store]:
    package = "touba.integrations.adk"
    yield from open_store(name, private_dir, ToubaSessionService, package=package, label="adk")


@pytest.fixture
async def service(store: Store) -> AsyncIterator[Any]:
    opened = store.open()
    try:
        yield opened
    finally:
        await opened.close()

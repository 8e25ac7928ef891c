"""Fixtures over every built-in history store (see ``_stores.py``)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.history._stores import DURABLE, KINDS, Stores


async def _built(kind: str, tmp_path: Path) -> AsyncIterator[Stores]:
    built = Stores(kind, tmp_path)
    built.prepare()
    yield built
    await built.cleanup()


@pytest.fixture(params=KINDS)
async def stores(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Stores]:
    """Each built-in store in turn (RAM, SQLite, PostgreSQL, Redis)."""
    async for built in _built(request.param, tmp_path):
        yield built


@pytest.fixture(params=DURABLE)
async def durable(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Stores]:
    """Each durable built-in store in turn (SQLite, PostgreSQL, Redis)."""
    async for built in _built(request.param, tmp_path):
        yield built

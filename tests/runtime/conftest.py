"""The runtime's stores, in each place they can live (see ``_stores.py``)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from ._stores import DURABLE_KINDS, KINDS, Place, place


@pytest.fixture(params=KINDS)
async def where(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Place]:
    """Each place in turn: RAM, SQLite, PostgreSQL."""
    async with place(request.param, tmp_path) as found:
        yield found


@pytest.fixture(params=DURABLE_KINDS)
async def durable(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Place]:
    """Each durable place in turn."""
    async with place(request.param, tmp_path) as found:
        yield found


@pytest.fixture
async def pg(tmp_path: Path) -> AsyncIterator[Place]:
    """The PostgreSQL place alone."""
    async with place("postgres", tmp_path) as found:
        yield found

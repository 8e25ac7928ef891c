"""A ``ToubaSaver`` per touba store, and a way to reopen it on the same data.

Each test gets its own SQLite file, PostgreSQL schema or Redis key prefix, removed
afterwards (other sessions of the suite share the servers).
"""

from __future__ import annotations

import importlib.util
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TypeAlias

import pytest

from tests.integrations import _stores
from tests.integrations._stores import STORES, own_prefix, own_schema
from touba.integrations.langgraph import ToubaSaver

Store: TypeAlias = _stores.Store[ToubaSaver]  # ``open()`` is a new ToubaSaver on the same data


@pytest.fixture(params=STORES)
def store(request: pytest.FixtureRequest, private_dir: Path) -> Iterator[Store]:
    yield from _store(str(request.param), private_dir)


@pytest.fixture(params=STORES[1:])
def persistent_store(request: pytest.FixtureRequest, private_dir: Path) -> Iterator[Store]:
    yield from _store(str(request.param), private_dir)


def _store(name: str, private_dir: Path) -> Iterator[Store]:
    if importlib.util.find_spec(f"touba.integrations.langgraph._{name}") is None:
        pytest.skip(f"the {name} backend of ToubaSaver is not on this branch")
    tag = uuid.uuid4().hex[:12]
    if name == "memory":
        yield Store(name, ToubaSaver.memory, persistent=False)
    elif name == "sqlite":
        path = str(private_dir / "checkpoints.sqlite")
        yield Store(name, lambda: ToubaSaver.sqlite(path), persistent=True)
    elif name == "postgres":
        schema = f"touba_lg_graphs_{tag}"
        with own_schema(schema) as dsn:
            prefix = f"{schema}.lg"
            yield Store(
                name, lambda: ToubaSaver.postgres(dsn, table_prefix=prefix), persistent=True
            )
    else:
        prefix = f"touba-lg-graphs:{tag}:"
        with own_prefix(prefix) as url:
            yield Store(name, lambda: ToubaSaver.redis(url, prefix=prefix), persistent=True)

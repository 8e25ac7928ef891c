"""The panel over an encrypted memory store: the key-event search (run in Python on the
opened rows, the columns being sealed) finds what it finds over a plain store, and the
pages show the opened text."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from touba import Encryption
from touba.memory import KeyEventsConfig, KeyEventService, SqliteMemoryStore

CONFIG = KeyEventsConfig(enabled=True, types=("refund", "bug"))


@pytest.fixture
async def memory(private_dir: Path) -> AsyncIterator[SqliteMemoryStore]:
    sealed = Encryption(keys={"k1": b"k" * 32}, current="k1")
    async with SqliteMemoryStore(private_dir / "memory.sqlite", encryption=sealed) as store:
        yield store


def _files(directory: Path) -> bytes:
    return b"".join(p.read_bytes() for p in directory.glob("memory.sqlite*"))


def _titles(html: str) -> list[str]:
    return re.findall(r'<a href="/event\?owner=[^"]+">([^<]*)</a>', html)


async def test_the_key_event_search_works_on_sealed_rows(
    client: TestClient, memory: SqliteMemoryStore, private_dir: Path
) -> None:
    service = KeyEventService(memory, CONFIG)
    await service.create("user:alice", "refund", "Refund order A1", "asked twice", "s-1")
    await service.create("user:bob", "refund", "Refund for B7", "", "s-2")
    await service.create("user:bob", "bug", "App crashes", "on the refund screen", "s-2")
    done = await service.create("session:anon-1", "bug", "Old matter", "refund done", "a-1")
    await service.update("session:anon-1", done.id, status="closed", session_id="a-1")
    html = client.get("/events?text=REFUND").text
    assert _titles(html) == ["App crashes", "Refund for B7", "Refund order A1"]
    assert "3 found across every user" in html
    assert _titles(client.get("/events?type=bug&text=crash").text) == ["App crashes"]
    assert _titles(client.get("/events?text=refund&status=closed").text) == ["Old matter"]
    assert _titles(client.get("/events?owner=user:bob&text=refund").text) == [
        "App crashes",
        "Refund for B7",
    ]
    assert b"Refund" not in _files(private_dir)

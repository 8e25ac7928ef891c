"""The load test, short (issue 29, item 5): chat on PostgreSQL while the panel is used.

``bench/load.py`` runs the full load (8 chat workers, 20 panel clients and an
operator for 2 minutes, with the chat alone before and after for the
decisions/s ratio, and the panel's times per page kind); this runs the same
driver with 2 chat workers, 5 clients and the operator for a few seconds:
``touba panel`` in its own process over PostgreSQL memory, history and
checkpoint stores, the clients in another, logged in with the token and
posting the forms with their CSRF token. Times are not asserted (bench only).
"""

from __future__ import annotations

import pytest
from bench.load import run_load

from tests._services import postgres_dsn

pytestmark = pytest.mark.postgres


async def test_panel_under_chat_load_fails_no_request_and_the_chat_goes_on() -> None:
    report = await run_load(
        dsn=postgres_dsn(), seconds=2.0, workers=2, clients=5, think=0.05, quiet=False
    )
    seen = report.clients
    assert seen.failures == []
    assert report.server_errors == []
    # Every page kind (each GET route of the app, found from its routes) was fetched.
    assert set(seen.client_ms) >= report.kinds
    assert all(len(seen.client_ms[kind]) >= 1 for kind in report.kinds)
    # The operator's forms were saved, and the store holds each save as the operator's.
    assert seen.settings_saved >= 1
    assert seen.events_edited >= 1
    assert report.settings_changes == seen.settings_saved + seen.settings_reset
    assert report.event_edits == seen.events_edited
    # The chat made progress meanwhile, every turn answered.
    assert report.loaded_decisions > 0
    assert report.chat_turns > 0
    assert report.chat_failures == []

"""langgraph-checkpoint-conformance's validate() on ToubaSaver, so ``make test`` covers it.

``make peers`` runs the same suite through peers/langgraph/run_conformance.py on every
store (tests/peers/run_langgraph.py); here too, on every store. The factories of
tests/peers/langgraph_savers.py give each of the suite's entries a fresh, isolated store
(a new private directory, PostgreSQL schema or Redis key prefix), removed afterwards.
"""

from __future__ import annotations

import pytest
from langgraph.checkpoint.conformance import checkpointer_test, validate
from langgraph.checkpoint.conformance.report import ProgressCallbacks

from tests._services import postgres_dsn, redis_url
from tests.peers import langgraph_savers


@pytest.mark.parametrize(
    "store",
    [
        "memory",
        "sqlite",
        pytest.param("postgres", marks=pytest.mark.postgres),
        pytest.param("redis", marks=pytest.mark.redis),
    ],
)
async def test_every_capability_passes_extended_ones_included(store: str) -> None:
    if store == "postgres":
        postgres_dsn()  # skips (fails under CI=true) when the server is unreachable
    elif store == "redis":
        redis_url()
    registered = checkpointer_test(name=f"ToubaSaver.{store}")(getattr(langgraph_savers, store))
    report = await validate(registered, progress=ProgressCallbacks.quiet())
    failures = {cap: r.failures for cap, r in report.results.items() if r.failures}
    assert failures == {}
    assert all(r.detected and r.passed is True for r in report.results.values())
    assert {str(getattr(cap, "value", cap)) for cap in report.results} >= {
        "delete_for_runs",
        "copy_thread",
        "prune",
    }
    assert report.conformance_level() == "FULL"
    assert sum(r.tests_passed for r in report.results.values()) == 81

"""langgraph-checkpoint-conformance's validate() on ToubaSaver, so ``make test`` covers it.

``make peers`` runs the same suite through peers/langgraph/run_conformance.py on every
store (tests/peers/run_langgraph.py); here, the RAM and SQLite stores.
"""

from __future__ import annotations

import pytest
from langgraph.checkpoint.conformance import checkpointer_test, validate
from langgraph.checkpoint.conformance.report import ProgressCallbacks

from tests.peers import langgraph_savers


@pytest.mark.parametrize("store", ["memory", "sqlite"])
async def test_every_capability_passes_extended_ones_included(store: str) -> None:
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

"""Running the store conformance checks: one by name, or all of them.

:data:`CHECK_NAMES` lists every check in the order :func:`check_store` runs
them, each on a fresh store from the factory and bounded by
:data:`~touba.testing._conformance_base.CHECK_TIMEOUT`; :func:`run_check`
runs one (``touba.testing.store_conformance.StoreConformance`` makes each a
pytest test). A check skipped for a missing capability is reported, not
failed; the failures are raised together in one :class:`AssertionError`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Final

from touba.history._store import HistoryStore
from touba.testing import _conformance_optional as optional
from touba.testing import _conformance_transact as transact
from touba.testing._conformance_base import (
    CHECK_TIMEOUT,
    CheckSkipped,
    ConformanceReport,
    ExpiringStoreFactory,
    LimitedStoreFactory,
    StoreFactory,
    open_store,
)

__all__ = [
    "CHECK_NAMES",
    "check_store",
    "run_check",
]


# -- running ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Options:
    limited_factory: LimitedStoreFactory | None
    expect_busy_error: bool


_StoreCheck = Callable[[HistoryStore, _Options], Awaitable[None]]

_STORE_CHECKS: Final[dict[str, _StoreCheck]] = {
    "round_trip": lambda store, _: transact.check_round_trip(store),
    "private_snapshots": lambda store, _: transact.check_private_snapshots(store),
    "exception_keeps_state": lambda store, _: transact.check_exception_keeps_state(store),
    "cancellation_keeps_state": lambda store, _: transact.check_cancellation_keeps_state(store),
    "exclusion": lambda store, o: transact.check_exclusion(
        store, expect_busy_error=o.expect_busy_error
    ),
    "atomicity": lambda store, _: transact.check_atomicity(store),
    "read": lambda store, _: optional.check_read(store),
    "delete": lambda store, _: optional.check_delete(store),
    "recover": lambda store, _: optional.check_recover(store),
    "list": lambda store, _: optional.check_list(store),
    "log_interface": lambda store, o: optional.check_log_interface(
        store, expect_busy_error=o.expect_busy_error
    ),
}

CHECK_NAMES: Final[tuple[str, ...]] = (*_STORE_CHECKS, "capacity", "expiry")
"""Every check, in the order :func:`check_store` runs them."""


async def run_check(
    name: str,
    factory: StoreFactory,
    *,
    limited_factory: LimitedStoreFactory | None = None,
    expect_busy_error: bool = True,
    expiring_factory: ExpiringStoreFactory | None = None,
) -> None:
    """Run one check on a fresh store from ``factory``; see :data:`CHECK_NAMES`."""
    if name not in CHECK_NAMES:
        raise ValueError(f"unknown check {name!r}; choose one of {', '.join(CHECK_NAMES)}")
    try:
        async with asyncio.timeout(CHECK_TIMEOUT):
            if name == "capacity":
                await optional.check_capacity(limited_factory)
                return
            if name == "expiry":
                await optional.check_expiry(expiring_factory)
                return
            async with open_store(factory()) as store:
                await _STORE_CHECKS[name](store, _Options(limited_factory, expect_busy_error))
    except TimeoutError as e:
        raise AssertionError(
            f"check {name!r} did not finish within {CHECK_TIMEOUT:g} s: the store is stuck "
            "(a lock never released?)"
        ) from e


async def check_store(
    factory: StoreFactory,
    *,
    limited_factory: LimitedStoreFactory | None = None,
    expect_busy_error: bool = True,
    expiring_factory: ExpiringStoreFactory | None = None,
) -> ConformanceReport:
    """Run every check, each on a fresh store from ``factory``.

    ``factory`` returns a store, an awaitable of one, or an async context
    manager yielding one; it is called inside the running event loop.
    ``limited_factory(max_sessions=..., max_store_bytes=...)`` enables the
    capacity check; ``expiring_factory(ttl_seconds=...)`` the expiry check (about
    1.5 s). Set ``expect_busy_error=False`` for an adapter that makes
    a second operation on a key wait instead of raising ``DecisionHistoryBusy``.

    Raises one :class:`AssertionError` listing every failed check; returns
    the names of passed checks and why others were skipped.
    """
    passed: list[str] = []
    skipped: dict[str, str] = {}
    failures: list[tuple[str, Exception]] = []
    for name in CHECK_NAMES:
        try:
            await run_check(
                name,
                factory,
                limited_factory=limited_factory,
                expect_busy_error=expect_busy_error,
                expiring_factory=expiring_factory,
            )
        except CheckSkipped as e:
            skipped[name] = str(e)
        except Exception as e:
            failures.append((name, e))
        else:
            passed.append(name)
    if failures:
        lines = [f"- {name}: {type(e).__name__}: {e}" for name, e in failures]
        raise AssertionError(
            f"{len(failures)} of {len(CHECK_NAMES)} store conformance checks failed "
            "(SPEC section 6):\n" + "\n".join(lines)
        ) from failures[0][1]
    return ConformanceReport(tuple(passed), skipped)

"""A contract suite any :class:`~touba.history.HistoryStore` adapter can run.

It checks what SPEC section 6 asks of a store: JSON round trips, private
snapshots, exception and cancellation keep the old state, per-key exclusion
(busy), atomicity under concurrency, and, when the store offers them,
``read``, ``delete``, ``recover``, ``list``, capacity limits, expiry (and the
read-only ``purge=False`` look) and the ``transact_log`` interface of built-in
stores. Missing optional capabilities
are skipped, not failed. Every built-in store passes it.

With pytest, subclass :class:`StoreConformance` and give it a ``store_factory``
fixture; each check becomes one test::

    import pytest
    from touba.testing.store_conformance import StoreConformance

    class TestMyStore(StoreConformance):
        @pytest.fixture
        def store_factory(self):
            return lambda: MyStore(url="...")  # called once per check

Without pytest, ``await check_store(lambda: MyStore(url="..."))`` runs every
check and raises one :class:`AssertionError` listing the failures.

A factory returns a store, an awaitable of one, or an async context manager
yielding one. It is called inside the event loop running the check, so
connections it opens belong to that loop; the store is closed afterwards
(``async with`` when supported, else ``close()``). pytest is only needed for
:class:`StoreConformance`, and it needs no async plugin: each test runs its
check with ``asyncio.run``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, ClassVar

from touba.testing._conformance_base import (
    CheckSkipped,
    ConformanceReport,
    ExpiringStoreFactory,
    LimitedStoreFactory,
    StoreFactory,
    StoreSource,
    open_store,
)
from touba.testing._conformance_optional import (
    check_capacity,
    check_delete,
    check_expiry,
    check_list,
    check_log_interface,
    check_read,
    check_recover,
)
from touba.testing._conformance_run import CHECK_NAMES, check_store, run_check
from touba.testing._conformance_transact import (
    check_atomicity,
    check_cancellation_keeps_state,
    check_exception_keeps_state,
    check_exclusion,
    check_private_snapshots,
    check_round_trip,
)

if TYPE_CHECKING:
    import pytest

__all__ = [
    "CHECK_NAMES",
    "CheckSkipped",
    "ConformanceReport",
    "ExpiringStoreFactory",
    "LimitedStoreFactory",
    "StoreConformance",
    "StoreFactory",
    "StoreSource",
    "check_atomicity",
    "check_cancellation_keeps_state",
    "check_capacity",
    "check_delete",
    "check_exception_keeps_state",
    "check_exclusion",
    "check_expiry",
    "check_list",
    "check_log_interface",
    "check_private_snapshots",
    "check_read",
    "check_recover",
    "check_round_trip",
    "check_store",
    "open_store",
    "run_check",
]


def _case(
    check: Callable[..., Awaitable[None]],
) -> Callable[[StoreConformance, StoreFactory], None]:
    """A test method running ``check`` (its doc is the check's: one place says the rule)."""
    name = check.__name__.removeprefix("check_")

    def test(self: StoreConformance, store_factory: StoreFactory) -> None:
        self._check(name, store_factory)

    test.__name__ = f"test_{name}"
    test.__qualname__ = f"StoreConformance.test_{name}"
    test.__doc__ = check.__doc__
    return test


class StoreConformance:
    """Base class of a pytest suite for one store; subclass it as ``TestSomething``.

    Fixtures the subclass provides:

    - ``store_factory`` (required): a callable returning a fresh store (or an
      awaitable / async context manager giving one), called once per check.
    - ``limited_store_factory`` (optional): a callable accepting
      ``max_sessions=`` and ``max_store_bytes=``; without it (or when it
      returns None) the capacity test is skipped.
    - ``expiring_store_factory`` (optional): a callable accepting
      ``ttl_seconds=``; without it the expiry test is skipped.

    Set ``expect_busy_error = False`` for an adapter that makes a second
    operation on a busy key wait instead of raising ``DecisionHistoryBusy``.
    """

    expect_busy_error: ClassVar[bool] = True

    def _check(
        self,
        name: str,
        store_factory: StoreFactory,
        limited_store_factory: LimitedStoreFactory | None = None,
        expiring_store_factory: ExpiringStoreFactory | None = None,
    ) -> None:
        __tracebackhide__ = True
        try:
            asyncio.run(
                run_check(
                    name,
                    store_factory,
                    limited_factory=limited_store_factory,
                    expect_busy_error=self.expect_busy_error,
                    expiring_factory=expiring_store_factory,
                )
            )
        except CheckSkipped as e:
            import pytest

            pytest.skip(str(e))

    test_round_trip = _case(check_round_trip)
    test_private_snapshots = _case(check_private_snapshots)
    test_exception_keeps_state = _case(check_exception_keeps_state)
    test_cancellation_keeps_state = _case(check_cancellation_keeps_state)
    test_exclusion = _case(check_exclusion)
    test_atomicity = _case(check_atomicity)
    test_read = _case(check_read)
    test_delete = _case(check_delete)
    test_recover = _case(check_recover)
    test_list = _case(check_list)
    test_log_interface = _case(check_log_interface)

    def test_capacity(self, store_factory: StoreFactory, request: pytest.FixtureRequest) -> None:
        """:func:`check_capacity` on ``limited_store_factory`` (skipped without one)."""
        import pytest

        try:
            limited: LimitedStoreFactory | None = request.getfixturevalue("limited_store_factory")
        except pytest.FixtureLookupError:
            limited = None
        self._check("capacity", store_factory, limited)

    def test_expiry(self, store_factory: StoreFactory, request: pytest.FixtureRequest) -> None:
        """:func:`check_expiry` on ``expiring_store_factory`` (skipped without one)."""
        import pytest

        try:
            expiring: ExpiringStoreFactory | None = request.getfixturevalue(
                "expiring_store_factory"
            )
        except pytest.FixtureLookupError:
            expiring = None
        self._check("expiry", store_factory, expiring_store_factory=expiring)

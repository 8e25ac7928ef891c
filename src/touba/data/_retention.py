"""``apply_retention``: a :class:`~touba.data.Retention` over every store of a deployment.

The rules of each kind are those of :mod:`touba.memory._retention` (where the value and
the report live, so that the extraction worker, below this package, applies them too).
"""

from __future__ import annotations

from datetime import datetime

from touba.data._stores import Stores
from touba.errors import ConfigurationError
from touba.memory._retention import Retention, RetentionReport, purge_stores

__all__ = ["apply_retention"]


async def apply_retention(
    stores: Stores,
    retention: Retention,
    *,
    now: datetime | None = None,
    dry_run: bool = False,
) -> RetentionReport:
    """Delete what ``retention`` no longer keeps from ``stores``: old turns (and ended
    sessions left empty, finished extraction jobs), closed key events and their
    history, abandoned checkpoints, old turns' traces; and the decision histories that
    already expired. Returns the counts per store and kind (never content).

    ``now`` (aware): the moment ages are measured from (default: the memory store's
    clock, else the system's). ``dry_run``: count what would go, delete nothing.
    ``Retention()`` deletes only the decision histories already expired. The resource
    binding holds no record with an age and is not touched.

    Raises ``ConfigurationError`` (nothing deleted) for ``stores`` that is not a
    ``touba.data.Stores``, a naive ``now``, or a store a set bound applies to that has
    no ``purge_before``; a store's own error when it fails (the batches committed
    before stay done: run it again to finish).
    """
    if not isinstance(stores, Stores):
        raise ConfigurationError(f"stores must be a touba.data.Stores, got {type(stores).__name__}")
    return await purge_stores(
        retention,
        memory=stores.memory,
        checkpoints=stores.checkpoints,
        histories=tuple(stores.histories),
        now=now,
        dry_run=dry_run,
    )

"""The stores of one deployment, as the operations over a user's data take them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from touba.history._store import AdminStore
from touba.memory import MemoryStore
from touba.runtime import CheckpointStore, ResourceBinding

__all__ = ["Stores"]


@dataclass(frozen=True, slots=True)
class Stores:
    """Every store a deployment keeps a user's data in; each is optional.

    ``memory``: chat sessions, turns, key events and their history, extraction jobs.
    ``histories``: the decision-history stores (built-in ones: RAM, SQLite,
    PostgreSQL, Redis). ``checkpoints``: the runtime's checkpoint store (approvals,
    arguments, traces). ``resources``: the runtime's resource binding.
    """

    memory: MemoryStore | None = None
    histories: Sequence[AdminStore] = field(default_factory=tuple)
    checkpoints: CheckpointStore | None = None
    resources: ResourceBinding | None = None

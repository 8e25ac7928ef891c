"""Erase one user everywhere (a deletion request, GDPR art. 17), and prove it.

Decisions:

- **What** is the user's: :func:`touba.data._owned.owned_by` (sessions of ``user:<id>``,
  their turns with each turn's context, key events with their update history,
  extraction jobs; decision histories, checkpoints (approvals, arguments, traces) and
  ``run``/``session``/``user``-scoped resource values of the user's runs). Kept: memory
  settings (per agent), ``agent``-scoped resources, other users' rows.
- **Order, for resumability.** Everything is derived first (reading only). Then the
  dependents are erased: decision histories, resource values, checkpoints (the run ids
  of the user's checkpoints are an input of the derivation, so they go after what they
  point at), and the memory store LAST, in one transaction: its sessions are what the
  rest is found from. A crash midway leaves the sessions in place, so a rerun derives
  the same set and finishes; a rerun after success finds nothing and erases nothing
  (idempotent). Give the same ``run_ids`` to the rerun.
- **Busy.** A conversation of the user's that a worker holds (an active history
  reservation) refuses the erase with ``DecisionHistoryBusy``, a ``running`` checkpoint
  with ``InvocationBusy``, before anything is erased; ``force=True`` frees such
  reservations as ``recover(key, worker_stopped=True)`` does (the worker must be stopped
  or about to fail: its next write is refused) and erases the running checkpoints.
- **Bytes.** SQLite stores delete with ``PRAGMA secure_delete`` on (the deleted cells
  and pages are overwritten with zeros) and then checkpoint their WAL (``TRUNCATE``),
  so neither the file nor the WAL keeps the erased bytes once no reader holds the WAL.
  Out of scope: backups and copies of files, PostgreSQL's dead tuples (until
  ``VACUUM``) and its WAL archive, Redis AOF and RDB files and replicas, OS-level copies
  (swap, snapshots, file-system journals), logs and traces sent elsewhere by the host.
- **Receipt.** Counts per store and kind, a timestamp, and the user id hashed (SHA-256):
  never the id or any content. It is logged at INFO on ``touba.data`` the same way.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from touba.data._owned import Owned, check_user, owned_by
from touba.data._stores import Stores
from touba.errors import ConfigurationError, DecisionHistoryBusy, InvocationBusy
from touba.history._model import JSON
from touba.history._store import AdminStore, StoredConversation
from touba.runtime._checkpoints import CheckpointInfo, encode_checkpoint, owned_checkpoint

__all__ = ["ErasureReceipt", "erase_user", "user_hash", "verify_erased"]

logger = logging.getLogger("touba.data")

Counts = dict[str, dict[str, int]]


def user_hash(user: str) -> str:
    """The SHA-256 hex digest of the user id (UTF-8): how receipts and logs name a user."""
    return hashlib.sha256(check_user(user).encode("utf-8", "surrogatepass")).hexdigest()


@dataclass(frozen=True, slots=True)
class ErasureReceipt:
    """What :func:`erase_user` erased: never the user id nor any content.

    ``user_hash``: SHA-256 hex of the user id. ``erased_at``: when the erase finished
    (aware, UTC). ``counts``: store label (``memory``, ``history`` or ``history:N`` when
    there are several, ``checkpoints``, ``resources``) to kind to rows erased; a store
    or kind with nothing erased is left out, so a rerun's receipt is empty.
    """

    user_hash: str
    erased_at: datetime
    counts: Mapping[str, Mapping[str, int]] = field(default_factory=dict)

    @property
    def total(self) -> int:
        """Every row erased, all stores and kinds together."""
        return sum(n for kinds in self.counts.values() for n in kinds.values())

    def as_json(self) -> dict[str, JSON]:
        """The receipt as JSON data: ``user_hash``, ``erased_at`` (ISO 8601) and ``counts``."""
        return {
            "user_hash": self.user_hash,
            "erased_at": self.erased_at.isoformat(),
            "counts": {store: dict(kinds) for store, kinds in self.counts.items()},
        }


def _history_labels(stores: Stores) -> list[tuple[str, AdminStore]]:
    histories = list(stores.histories)
    if len(histories) == 1:
        return [("history", histories[0])]
    return [(f"history:{i}", store) for i, store in enumerate(histories)]


def _check_stores(stores: object) -> Stores:
    if not isinstance(stores, Stores):
        raise ConfigurationError(
            "stores must be a touba.data.Stores (memory=, histories=, checkpoints=, "
            "resources=); nothing was read or changed"
        )
    memory = stores.memory
    if memory is not None and not callable(getattr(memory, "erase_owner", None)):
        raise ConfigurationError(
            f"the memory store {type(memory).__name__} has no erase_owner/count_owner: only "
            "the built-in memory stores can be erased; nothing was changed"
        )
    for _, history in _history_labels(stores):
        if not callable(getattr(history, "list", None)) or not callable(
            getattr(history, "delete", None)
        ):
            raise ConfigurationError(
                f"the history store {type(history).__name__} cannot list and delete "
                "conversations (use a built-in store); nothing was changed"
            )
    checkpoints = stores.checkpoints
    if checkpoints is not None and not (
        callable(getattr(checkpoints, "owned_checkpoints", None))
        or callable(getattr(checkpoints, "list", None))
    ):
        raise ConfigurationError(
            f"the checkpoint store {type(checkpoints).__name__} cannot list its checkpoints; "
            "nothing was changed"
        )
    resources = stores.resources
    if resources is not None and not callable(getattr(resources, "erase_scope_keys", None)):
        raise ConfigurationError(
            f"the resource binding {type(resources).__name__} has no erase_scope_keys/"
            "count_scope_keys (the built-in bindings have them); nothing was changed"
        )
    return stores


async def _conversations(store: AdminStore, owned: Owned) -> list[StoredConversation]:
    """The store's conversations whose identity ``run_id`` is one of the user's."""
    found = await store.list(purge=False)
    return [
        c for c in found if c.identity is not None and c.identity.get("run_id") in owned.run_ids
    ]


async def _checkpoints(stores: Stores, owned: Owned) -> list[CheckpointInfo]:
    store: Any = stores.checkpoints
    if store is None:
        return []
    finder = getattr(store, "owned_checkpoints", None)
    if finder is not None:
        found: list[CheckpointInfo] = await finder(run_ids=owned.run_ids, user=owned.user)
        return found
    out = []
    for info in await store.list():
        body = await store.get(info.checkpoint_id)
        text = "" if body is None else encode_checkpoint(body)
        if owned_checkpoint(info.run_id, text, owned.run_ids, owned.user):
            out.append(info)
    return out


def _refuse_busy(
    held: list[tuple[str, AdminStore, StoredConversation]], running: list[CheckpointInfo]
) -> None:
    if held:
        _, _, conversation = held[0]
        raise DecisionHistoryBusy(
            f"{len(held)} conversation(s) of this user are held by a worker (first: "
            f"{conversation.key}); nothing was erased. Wait for the worker to finish, or "
            "stop it and erase with force=True (touba users erase --force)",
            session_key=conversation.key,
        )
    if running:
        info = running[0]
        raise InvocationBusy(
            f"{len(running)} checkpoint(s) of this user are being run by a worker (first: "
            f"{info.checkpoint_id}); nothing was erased. Wait for it to finish, or stop it "
            "and erase with force=True (touba users erase --force)",
            checkpoint_id=info.checkpoint_id,
            holder={},
        )


async def erase_user(
    user: str, stores: Stores, *, run_ids: Iterable[str] = (), force: bool = False
) -> ErasureReceipt:
    """Erase every row of ``user`` in ``stores`` and return the receipt.

    What is erased and kept, the order and why a crash midway is finished by a rerun:
    the module docstring of :mod:`touba.data._erase` (and ``docs/data/erase.md``).
    ``run_ids``: the user's runs invoked outside a chat session (give them again to a
    rerun). Idempotent: a second call erases nothing and returns an empty receipt.

    Raises, before anything is erased: ``ConfigurationError`` for an empty user id, a
    ``stores`` that is not a :class:`~touba.data.Stores`, or a store that cannot be
    erased (a custom one without the primitives); ``DecisionHistoryBusy`` when a worker
    holds one of the user's conversations (an active reservation) and
    ``InvocationBusy`` when one of the user's checkpoints is ``running``, unless
    ``force=True``, which frees those reservations as ``recover(key,
    worker_stopped=True)`` does and erases the running checkpoints (stop the worker
    first). A store's own error (``...Unavailable``) when it fails midway: what was
    erased stays erased, and a rerun finishes.
    """
    check_user(user)
    if not isinstance(force, bool):
        raise ConfigurationError("force must be True or False")
    _check_stores(stores)
    owned = await owned_by(user, stores, run_ids)
    histories = [
        (label, store, await _conversations(store, owned))
        for label, store in _history_labels(stores)
    ]
    checkpoints = await _checkpoints(stores, owned)
    held = [(label, store, c) for label, store, found in histories for c in found if c.active]
    running = [info for info in checkpoints if info.status == "running"]
    if not force:
        _refuse_busy(held, running)
    for _, store, conversation in held:
        await store.recover(conversation.key, worker_stopped=True)

    counts: Counts = {}
    for label, store, found in histories:
        keys = [c.key for c in found]
        eraser = getattr(store, "erase", None)
        if callable(eraser):
            await eraser(keys)
        else:
            for key in keys:
                await store.delete(key)
        _add(counts, label, "conversations", len(found))
        _add(counts, label, "messages", sum(c.messages for c in found))
    if stores.resources is not None:
        erased: dict[str, int] = await stores.resources.erase_scope_keys(  # type: ignore[attr-defined]
            owned.resource_keys()
        )
        for scope, n in erased.items():
            _add(counts, "resources", f"{scope}_values", n)
    if stores.checkpoints is not None:
        checkpoint_store: Any = stores.checkpoints
        if callable(getattr(checkpoint_store, "erase_owned", None)):
            n = await checkpoint_store.erase_owned(run_ids=owned.run_ids, user=owned.user)
        else:
            n = 0
            for info in checkpoints:
                n += await checkpoint_store.take(info.checkpoint_id) is not None
        _add(counts, "checkpoints", "checkpoints", n)
    if stores.memory is not None:
        memory: Any = stores.memory
        for kind, n in (await memory.erase_owner(owned.owners, owned.session_ids)).items():
            _add(counts, "memory", kind, n)

    receipt = ErasureReceipt(user_hash(user), datetime.now(UTC), counts)
    logger.info("erased user %s: %s", receipt.user_hash, receipt.as_json()["counts"])
    return receipt


def _add(counts: Counts, store: str, kind: str, n: int) -> None:
    if n:
        kinds = counts.setdefault(store, {})
        kinds[kind] = kinds.get(kind, 0) + n


async def verify_erased(user: str, stores: Stores, *, run_ids: Iterable[str] = ()) -> Counts:
    """What is left of ``user`` in ``stores``: store label to kind to rows remaining
    (labels and kinds as in :class:`ErasureReceipt`); an empty dict means nothing is
    left. Reads only.

    It derives what belongs to the user as :func:`erase_user` does, from what the stores
    hold now (so pass the same ``run_ids``). ``ConfigurationError`` as ``erase_user``;
    a store's own error when it fails.
    """
    check_user(user)
    _check_stores(stores)
    owned = await owned_by(user, stores, run_ids)
    counts: Counts = {}
    for label, store in _history_labels(stores):
        found = await _conversations(store, owned)
        _add(counts, label, "conversations", len(found))
        _add(counts, label, "messages", sum(c.messages for c in found))
    if stores.resources is not None:
        left: dict[str, int] = await stores.resources.count_scope_keys(  # type: ignore[attr-defined]
            owned.resource_keys()
        )
        for scope, n in left.items():
            _add(counts, "resources", f"{scope}_values", n)
    _add(counts, "checkpoints", "checkpoints", len(await _checkpoints(stores, owned)))
    if stores.memory is not None:
        memory: Any = stores.memory
        for kind, n in (await memory.count_owner(owned.owners, owned.session_ids)).items():
            _add(counts, "memory", kind, n)
    return counts

"""The journal: a running invocation's checkpoint, kept current so that nothing is lost.

An invocation writes its state to the checkpoint store (status ``running``)
before it starts a batch of calls, marking them ``started``, and again once
they are answered. So whatever stops it (a provider error, a store error, a
kill -9), the store holds every observation obtained and knows which calls
had started. The rules, in the order they apply:

- **Calls.** A call is recorded as started, durably, before it runs. A call
  found started without an outcome (its worker died during it) is never run
  again: the resume answers it with an ``error`` observation saying its
  outcome is unknown (seed 000: recovering frees storage, it decides nothing
  about an uncertain business effect). A call approved and not yet started
  runs once.
- **Stops.** An invocation that pauses for approval, or fails with a
  retryable error (``ToubaError.retryable``) after calls ran, is saved under
  a new id (the journal's ``successor``, chosen in advance) and the running
  journal is then removed: the id a caller gets is always new, and a crash
  between the two writes leaves a running journal whose successor exists,
  which a resume recognises as superseded. An invocation that completes, or
  fails for good, removes its journal.
- **Claims.** ``resume`` claims a checkpoint by replacing it, compare-and-swap
  on its ``revision``, with the running journal of the new worker: of two
  resumers, one wins. A worker whose journal was claimed by another (after
  an operator declared it stopped) finds out at its next write and stops
  before running anything more.
- **RAM.** A store with ``durable = False`` (the default
  :class:`~touba.runtime.MemoryCheckpointStore`) is emptied by the crash it
  would protect against: the writes during a run are skipped, the stops are
  saved as above.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from typing import Any

from touba.errors import InvocationBusy, ToubaError
from touba.history._common import Reservation
from touba.history._model import JSON
from touba.providers._types import Decision
from touba.runtime._checkpoints import CheckpointStore
from touba.runtime._state import Paused
from touba.runtime._trace import Trace

__all__ = ["Journal", "JournalLost"]


class JournalLost(InvocationBusy):
    """Another worker claimed this invocation's journal: this one must stop now."""


class Journal:
    """The running checkpoint of one top-level invocation (see the module docstring).

    ``checkpoint_id`` and ``revision`` name a checkpoint this worker has just
    claimed (a resume); None for a new invocation, whose journal is created
    by its first write. ``snapshot`` returns the invocation tree as it is now.
    """

    def __init__(
        self,
        store: CheckpointStore,
        *,
        worker_id: str,
        checkpoint_id: str | None = None,
        revision: int = 0,
    ) -> None:
        self.store = store
        self.id = checkpoint_id or str(uuid.uuid4())
        self.revision = revision
        self.written = checkpoint_id is not None
        self.successor = str(uuid.uuid4())
        self.holder = Reservation.new(worker_id)
        self.durable = bool(getattr(store, "durable", True)) and callable(
            getattr(store, "replace", None)
        )
        self.snapshot: Callable[[], tuple[Paused, Trace]] | None = None
        # Final decisions that a stopped worker had saved in history and never
        # reported, by invocation_id: the resume completes those invocations from them.
        self.recovered: dict[str, Decision] = {}
        self._lock = asyncio.Lock()

    def body(
        self,
        paused: Paused,
        trace: Trace,
        status: str,
        *,
        revision: int,
        error: ToubaError | None = None,
    ) -> dict[str, JSON]:
        """The checkpoint JSON for ``paused`` (the root of the tree) in ``status``."""
        body = paused.to_dict()
        body["checkpoint_id"] = self.id if status == "running" else self.successor
        body["status"] = status
        body["revision"] = revision
        body["trace"] = trace.to_dicts()
        if status == "running":
            body["holder"] = self.holder.describe()
            body["successor"] = self.successor
        if error is not None:
            body["error"] = {"code": error.code, "message": error.message}
        return body

    def _current(self) -> tuple[Paused, Trace]:
        assert self.snapshot is not None, "the runtime sets snapshot before running"
        return self.snapshot()

    async def sync(self) -> None:
        """Write the tree as it is now (status ``running``); a no-op on RAM.

        Raises :class:`JournalLost` when another worker claimed the journal,
        and the store's own errors when the write failed (nothing started).
        A cancellation does not interrupt the write: it ends before the
        journal's next use (a stop waits for it).
        """
        if not self.durable:
            return
        await asyncio.shield(self._sync())

    async def _sync(self) -> None:
        async with self._lock:
            paused, trace = self._current()
            body = self.body(paused, trace, "running", revision=self.revision + 1)
            if not self.written:
                await self.store.save(self.id, body)
                self.written = True
            elif not await self._replace(body):
                raise self.lost()
            self.revision += 1

    async def claim(self, paused: Paused, trace: Trace) -> bool:
        """Take over the checkpoint this journal was built on (a resume), atomically.

        Replaces it with ``paused`` as this worker's running journal if its
        revision is still the one read; False when another resume was first.
        """
        async with self._lock:
            if getattr(self.store, "replace", None) is None:
                self.written = False  # save/get/take only: consumed now, saved again at a stop
                return await self.store.take(self.id) is not None
            body = self.body(paused, trace, "running", revision=self.revision + 1)
            if not await self._replace(body):
                return False
            self.revision += 1
            return True

    async def stop(self, status: str, error: ToubaError | None = None) -> str:
        """Save the tree under the successor id in ``status``, then drop the journal."""
        async with self._lock:
            paused, trace = self._current()
            await self.store.save(
                self.successor, self.body(paused, trace, status, revision=0, error=error)
            )
            await self._remove()
            return self.successor

    async def finish(self) -> None:
        """Remove the journal: the invocation ended for good."""
        async with self._lock:
            await self._remove()

    async def _remove(self) -> None:
        if self.written:
            self.written = False
            if not await self._replace(None):
                raise self.lost()

    async def _replace(self, body: dict[str, JSON] | None) -> bool:
        replace: Any = getattr(self.store, "replace", None)
        if replace is None:  # a store with save/get/take only: best effort
            taken = await self.store.take(self.id)
            if body is not None:
                await self.store.save(self.id, body)
            return taken is not None
        return bool(await replace(self.id, body, revision=self.revision))

    def lost(self) -> JournalLost:
        return JournalLost(
            f"checkpoint {self.id} of this invocation was resumed by another worker (this one "
            "had been declared stopped); this worker stopped before running anything more",
            checkpoint_id=self.id,
            holder=self.holder.describe(),
        )

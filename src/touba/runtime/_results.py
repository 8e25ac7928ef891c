"""``InvocationResult``: how an invocation (or a resume) ended."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from touba.errors import ToubaError
from touba.history._model import JSON, CapabilityCall
from touba.runtime._trace import Trace

__all__ = ["InvocationResult", "InvocationStatus"]

InvocationStatus = Literal["completed", "awaiting_approval", "failed", "cancelled"]


@dataclass(frozen=True, slots=True)
class InvocationResult:
    """The end of :meth:`Runtime.invoke` or :meth:`Runtime.resume`.

    - ``completed``: ``output`` is the agent's final output.
    - ``awaiting_approval``: ``checkpoint_id`` names the saved checkpoint and
      ``pending`` lists the calls awaiting a decision (those of delegated
      sub-invocations included); pass ``approvals={call_id: True | False}``
      to :meth:`Runtime.resume`.
    - ``failed``: ``error`` is the :class:`~touba.errors.ToubaError`.
    - ``cancelled``: only for a stream its consumer stopped early
      (:attr:`InvocationStream.result <touba.runtime.InvocationStream.result>`);
      ``checkpoint_id`` names a checkpoint to resume when a decision was saved
      or a call ran (None otherwise: nothing to continue), ``pending`` the calls of that
      checkpoint still awaiting a reviewer, and the trace ends with
      ``decision_cancelled``. ``invoke`` and ``resume`` never return it: a
      cancelled ``invoke`` raises ``CancelledError`` (after saving the same
      checkpoint).

    ``run_id``, ``invocation_id`` and ``agent_ref`` identify the invocation;
    a resume keeps them.
    """

    status: InvocationStatus
    run_id: str
    invocation_id: str
    agent_ref: str
    output: JSON = None
    checkpoint_id: str | None = None
    pending: tuple[CapabilityCall, ...] = ()
    error: ToubaError | None = None
    trace: Trace = field(default_factory=Trace)

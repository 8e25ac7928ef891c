"""``Trace``: what an invocation did, in order, exportable as JSON lines.

One trace per top-level invocation; delegated sub-invocations write into
their parent's trace, every entry naming its own ``invocation_id`` and
``agent_ref``. Entry kinds and their fields (besides ``at``, ``kind``,
``run_id``, ``invocation_id``, ``agent_ref``):

- ``invocation_started`` (``input``, ``parent_invocation_id`` for a delegate;
  ``prior_turns`` (how many) and ``tools`` (names) when invoked with an
  :class:`~touba.runtime.InvocationContext`),
  ``invocation_resumed`` (``checkpoint_id``), ``invocation_completed``
  (``output``), ``invocation_failed`` (``error_code``, ``error``,
  ``provider_error_code`` when the provider gave one),
  ``awaiting_approval`` (``checkpoint_id``: the store's key for the top
  level, the nested checkpoint's id for a delegate; ``pending``: the calls
  awaiting a reviewer, with arguments).
- ``decision`` (``number``, ``calls`` with ids, names and arguments,
  ``final``, ``output``, ``text``, ``input_tokens``, ``output_tokens``).
- ``call`` (``call_id``, ``name``, ``arguments``): a call starts running.
- ``denial`` (``call_id``, ``name``, ``reason``, ``error``): a check refused it.
- ``observation`` (``call_id``, ``name``, ``status``, ``result`` or ``error``):
  exactly one per call answered, denied ones included.
- ``approval_requested`` / ``approval_granted`` / ``approval_refused``
  (``call_id``, ``name``; ``arguments`` on the request; ``given`` on a
  refusal: False when ``approvals`` left the call out; ``actor`` on a grant
  or refusal when the resume named who decided, e.g. ``"operator"`` from the
  memory panel).
- ``sub_invocation_started`` / ``sub_invocation_finished`` (``call_id``,
  ``child_invocation_id``, ``child_agent_ref``; ``status`` when finished).
- ``history_event``: a :class:`~touba.HistoryEvent`'s fields, its kind as
  ``event`` (history windows, trimming, summaries, context-guard counts,
  ``resumed_without_messages``); never message content.
- ``provider_error`` (``error_code``, ``error``, ``provider_error_code``).
- ``decision_cancelled``: the invocation's task was cancelled (a stream stopped
  early; see :mod:`touba.runtime._stream`). ``number`` (the decision being
  written, or whose calls were running), ``stage`` (``"deciding"``,
  ``"calls"`` or ``"between"``), ``deltas`` (stream pieces received of that
  decision), for ``"calls"`` ``calls``, ``answered``, ``interrupted`` and
  ``not_started`` (counts), and ``checkpoint_id`` (the checkpoint that
  resumes it, None when nothing was kept; None on a delegate's entry, which
  comes before its parent's). The last entry of a stopped invocation's trace.
- ``flow_step_started`` / ``flow_step_finished`` (``kind="flow"``: ``step``,
  ``index``; ``type`` and, for a capability step, ``calls`` when started;
  ``status``, ``output`` and ``error`` when finished). See
  :mod:`touba.runtime._flow`.
- ``resource_access`` (``call_id``, ``name`` of the capability,
  ``resource``, ``scope``, ``operation``, ``key`` or ``prefix``, ``outcome``
  ``"ok"`` or ``"denied"``, ``reason`` when denied); never a value. See
  :mod:`touba.runtime._resources`.

Arguments, results, inputs and outputs are the host's business data and are
kept (the host decides where a trace goes). Provider keys, headers and
message content never enter a trace. A capability's exception appears as its
type name and its message, truncated: do not put secrets in the messages of
exceptions a capability raises.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from touba.history._model import JSON

__all__ = ["Trace", "TraceEntry"]


@dataclass(frozen=True, slots=True)
class TraceEntry:
    """One fact of an invocation; ``data`` holds the kind's own fields."""

    kind: str
    run_id: str
    invocation_id: str
    agent_ref: str
    data: Mapping[str, JSON] = field(default_factory=dict)
    at: datetime = field(default_factory=lambda: datetime.now(UTC))

    def __getitem__(self, key: str) -> JSON:
        return self.data[key]

    def get(self, key: str, default: JSON = None) -> JSON:
        """The field ``key`` of ``data``, or ``default`` when the entry has none."""
        return self.data.get(key, default)

    def to_dict(self) -> dict[str, JSON]:
        """The entry as one flat JSON object: ``at`` (ISO 8601), the identity, then ``data``."""
        return {
            "at": self.at.isoformat(),
            "kind": self.kind,
            "run_id": self.run_id,
            "invocation_id": self.invocation_id,
            "agent_ref": self.agent_ref,
            **self.data,
        }

    @classmethod
    def from_dict(cls, value: Mapping[str, Any]) -> TraceEntry:
        """The entry :meth:`to_dict` made; KeyError or ValueError when a field is missing or
        ``at`` is not ISO 8601."""
        data = {
            k: v
            for k, v in value.items()
            if k not in ("at", "kind", "run_id", "invocation_id", "agent_ref")
        }
        return cls(
            kind=value["kind"],
            run_id=value["run_id"],
            invocation_id=value["invocation_id"],
            agent_ref=value["agent_ref"],
            data=data,
            at=datetime.fromisoformat(value["at"]),
        )


class Trace:
    """The ordered entries of an invocation and of the sub-invocations it started."""

    def __init__(self, entries: tuple[TraceEntry, ...] | list[TraceEntry] = ()) -> None:
        self._entries: list[TraceEntry] = list(entries)

    @property
    def entries(self) -> tuple[TraceEntry, ...]:
        """Every entry, oldest first (a snapshot: later entries are not added to it)."""
        return tuple(self._entries)

    def __iter__(self) -> Iterator[TraceEntry]:
        return iter(tuple(self._entries))

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Trace({len(self._entries)} entries)"

    def of_kind(self, kind: str, *, invocation_id: str | None = None) -> list[TraceEntry]:
        """Entries of ``kind`` (of one invocation if ``invocation_id`` is given)."""
        return [
            e
            for e in self._entries
            if e.kind == kind and (invocation_id is None or e.invocation_id == invocation_id)
        ]

    def add(
        self, kind: str, run_id: str, invocation_id: str, agent_ref: str, **data: JSON
    ) -> TraceEntry:
        """Append an entry of ``kind`` for that invocation, ``data`` its fields; return it."""
        entry = TraceEntry(kind, run_id, invocation_id, agent_ref, data)
        self._entries.append(entry)
        return entry

    def copy(self) -> Trace:
        """A new trace holding the same entries (entries are immutable)."""
        return Trace(self._entries)

    def to_dicts(self) -> list[dict[str, JSON]]:
        """Each entry's :meth:`TraceEntry.to_dict`, oldest first."""
        return [e.to_dict() for e in self._entries]

    @classmethod
    def from_dicts(cls, values: list[Mapping[str, Any]]) -> Trace:
        """The trace :meth:`to_dicts` made (see :meth:`TraceEntry.from_dict` for errors)."""
        return cls([TraceEntry.from_dict(v) for v in values])

    def to_jsonl(self) -> str:
        """One JSON object per line, oldest first, timestamps in ISO 8601 with offset."""
        return "".join(
            json.dumps(e.to_dict(), ensure_ascii=False, separators=(",", ":"), default=str) + "\n"
            for e in self._entries
        )

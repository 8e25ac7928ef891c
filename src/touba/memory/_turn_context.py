"""What a chat turn's invocation was given: the per-turn context record, as plain data.

Seed 004 gives the memory panel one job: "when a customer says the agent does
not remember the previous turn, look here first". So each stored turn keeps a
record of what its invocation was given (sizes, ids and settings, never
message content): the memory settings in effect and where they came from, the
earlier turns sent (by number) and which carried their whole tool trace, the
key events injected, the system prompt's size, and what each decision sent
(the windows, read from the invocation's trace).

The record is one JSON object, built in two pure steps so that it can be
tested without a store or a model:

- :func:`given_context` when the turn starts (before the invocation): what
  the session decided to give. A turn resumed after an approval keeps this
  part as it was when the turn started, like its context;
- :func:`turn_context` when the turn is stored: the given part, plus the
  decision windows and the decision history's conversation key, read from the
  trace of the invocation (never from a store).

Schema (``version`` 1; a reader skips keys it does not know):

- ``version``: 1; ``mode``: ``"live"`` or ``"preview"`` (preview turns are
  given no earlier turn and no key event: blank memory);
- ``settings``: ``short_term_turns``, ``full_context_turns``,
  ``key_events`` (``enabled``, ``types``), ``source`` (``"saved"``: saved in
  the memory store, by the panel or an API caller; ``"program"``: the
  program's ``MemoryConfig``; ``"defaults"``), ``saved_at`` (ISO 8601 with
  offset, or null) and ``saved_by`` (``"operator"`` from the panel, the API
  caller's name, or null);
- ``turns``: the earlier turns sent, oldest first: ``number`` (1-based, as
  the panel numbers them), ``full_trace`` (sent with its whole tool trace)
  and ``calls`` (how many tool calls that turn's trace holds);
- ``key_events``: the events injected: ``id``, ``type``, ``title``,
  ``status``; ``key_events_active``: the switch on and a type configured;
- ``system_prompt``: ``bytes`` (UTF-8) of the instructions the model got,
  ``agent_bytes`` (the agent's own) and ``key_events_bytes`` (the injected
  block; the separator between them is in ``bytes`` only);
- ``windows``: one object per decision of the top-level invocation, oldest
  first: ``decision`` (its number, null when the provider failed), what the
  history window sent (``messages``, ``bytes``), ``trimmed`` (``exchanges``,
  ``messages``, ``bytes`` dropped), ``summary`` (``covered_exchanges``,
  ``bytes``, ``new``), ``summary_failed``, ``resumed_without_messages``,
  ``guard`` (the context guard's counts: ``counts`` made, ``tokens`` of the
  request sent, ``reserve``, ``window``, ``fits``, ``messages`` and
  ``bytes`` after its cut), ``input_tokens`` (what the provider reported);
  ``error`` (an error code) when the decision failed. A decision of a
  provider without history has no window event: only its number and tokens;
- ``rebuilt_at_resume``: true when the turn was resumed after an approval
  by another process or session object (``resume(checkpoint_id=...)``): the
  record, like the context, is then the one built at the resume;
- ``conversation_key``: the decision history's conversation of the top-level
  invocation (null when its provider keeps none); ``decision_history``:
  ``"retained"`` or ``"deleted"`` (the session's ``retain_decision_history``).

Nothing here grows with the stored history: the inputs are the turns the
session already read for the window, at most five key events and the trace of
one invocation.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, Final

from touba.history._model import JSON
from touba.memory._config import MemoryConfig
from touba.memory._model import KeyEvent, SessionMode, StoredTurn
from touba.runtime._trace import Trace

__all__ = [
    "TURN_CONTEXT_VERSION",
    "describe_context",
    "describe_history",
    "describe_windows",
    "given_context",
    "human_bytes",
    "turn_context",
]

TURN_CONTEXT_VERSION: Final = 1
NOT_RECORDED: Final = "not recorded (stored before this touba version)"
UNKNOWN_FORMAT: Final = "recorded in a form this touba does not read (no version)"
_SOURCES: Final = ("saved", "program", "defaults")


def _stamp(moment: datetime | None) -> str | None:
    if moment is None:
        return None
    if moment.tzinfo is None or moment.utcoffset() is None:
        raise ValueError(f"a settings time must be timezone-aware, got {moment!r}")
    return moment.isoformat()


def given_context(
    *,
    mode: SessionMode,
    config: MemoryConfig,
    source: str,
    saved_at: datetime | None = None,
    saved_by: str | None = None,
    recent: Sequence[StoredTurn] = (),
    key_events: Sequence[KeyEvent] = (),
    agent_instructions: str = "",
    injected: str = "",
) -> dict[str, JSON]:
    """The part of a turn's record known when it starts (see the module documentation).

    ``recent``: the session's latest stored turns, in order, as read for the
    window (the last ``short_term_turns`` of them are sent, the last
    ``full_context_turns`` of those with their trace, as
    :func:`~touba.memory.select_prior_turns` does); ignored in preview.
    ``key_events``: the events injected; ``injected``: the block appended to
    ``agent_instructions``. ``ValueError`` for an unknown ``source`` or a
    naive ``saved_at``.
    """
    if source not in _SOURCES:
        raise ValueError(f"source must be one of {_SOURCES}, got {source!r}")
    turns: list[JSON] = []
    events: list[JSON] = []
    if mode != "preview":
        window = list(recent)[-config.short_term_turns :] if config.short_term_turns else []
        traced_from = len(window) - config.full_context_turns
        turns = [
            {
                "number": turn.index + 1,
                "full_trace": i >= traced_from,
                "calls": sum(len(group) for group in turn.trace),
            }
            for i, turn in enumerate(window)
        ]
        events = [
            {"id": e.id, "type": e.type, "title": e.title, "status": e.status} for e in key_events
        ]
    prompt = "\n\n".join(t for t in (agent_instructions, injected) if t)
    return {
        "version": TURN_CONTEXT_VERSION,
        "mode": mode,
        "settings": {
            "short_term_turns": config.short_term_turns,
            "full_context_turns": config.full_context_turns,
            "key_events": {
                "enabled": config.key_events.enabled,
                "types": list(config.key_events.types),
            },
            "source": source,
            "saved_at": _stamp(saved_at),
            "saved_by": saved_by,
        },
        "turns": turns,
        "key_events_active": mode != "preview" and config.key_events.active,
        "key_events": events,
        "system_prompt": {
            "bytes": len(prompt.encode("utf-8")),
            "agent_bytes": len(agent_instructions.encode("utf-8")),
            "key_events_bytes": len(injected.encode("utf-8")) if mode != "preview" else 0,
        },
    }


def _int(value: JSON) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


class _Window:
    """The history and guard events of one decision, gathered until its entry comes."""

    def __init__(self) -> None:
        self.data: dict[str, JSON] = {}
        self.counts: list[Mapping[str, JSON]] = []

    def take(self, fields: Mapping[str, JSON]) -> None:
        event = fields.get("event")
        if event == "history_window":
            self.data["messages"] = _int(fields.get("message_count"))
            self.data["bytes"] = _int(fields.get("bytes"))
        elif event == "history_trimmed":
            self.data["trimmed"] = {
                "exchanges": _int(fields.get("removed_exchanges")),
                "messages": _int(fields.get("removed_messages")),
                "bytes": _int(fields.get("removed_bytes")),
            }
        elif event == "decision_history_summary":
            self.data["summary"] = {
                "covered_exchanges": _int(fields.get("covered_exchanges")),
                "bytes": _int(fields.get("summary_bytes")),
                "new": True,
            }
        elif event == "decision_history_summary_failed":
            self.data["summary_failed"] = True
        elif event == "resumed_without_messages":
            self.data["resumed_without_messages"] = True
        elif event == "provider_context_count":
            self.counts.append(fields)

    def close(self, decision: int | None, **extra: JSON) -> dict[str, JSON]:
        out: dict[str, JSON] = {"decision": decision, **self.data}
        if self.counts:
            # The guard keeps the least it must drop: of the counts that fit, the
            # largest request is the one sent.
            fitting = [c for c in self.counts if c.get("fits") is True]
            sent = max(fitting, key=lambda c: _int(c.get("count")) or 0) if fitting else None
            last = sent if sent is not None else self.counts[-1]
            guard: dict[str, JSON] = {
                "counts": len(self.counts),
                "tokens": _int(last.get("count")),
                "reserve": _int(last.get("reserve")),
                "window": _int(last.get("window")),
                "fits": sent is not None,
                "messages": _int(last.get("message_count")),
                "bytes": _int(last.get("bytes")),
            }
            sent_turns = _int(last.get("prior_turns"))
            if sent_turns is not None:  # the earlier turns in the request counted
                guard["prior_turns"] = sent_turns
            out["guard"] = guard
        out.update({k: v for k, v in extra.items() if v is not None})
        return out


def _windows(trace: Trace, invocation_id: str) -> tuple[list[JSON], str | None]:
    windows: list[JSON] = []
    key: str | None = None
    pending: _Window | None = None
    for entry in trace:
        if entry.invocation_id != invocation_id:
            continue
        if entry.kind == "history_event":
            pending = pending or _Window()
            pending.take(entry.data)
            session_key = entry.get("session_key")
            if isinstance(session_key, str):
                key = session_key
        elif entry.kind == "decision":
            pending = pending or _Window()
            windows.append(
                pending.close(
                    _int(entry.get("number")), input_tokens=_int(entry.get("input_tokens"))
                )
            )
            pending = None
        elif entry.kind == "provider_error":
            code = entry.get("error_code")
            pending = pending or _Window()
            windows.append(pending.close(None, error=code if isinstance(code, str) else None))
            pending = None
    if pending is not None:  # events of a decision that never came (the invocation stopped)
        windows.append(pending.close(None))
    return windows, key


def turn_context(
    given: Mapping[str, JSON], trace: Trace, invocation_id: str, *, retained: bool
) -> dict[str, JSON]:
    """The whole record of a turn: ``given`` (from :func:`given_context`, unchanged)
    plus the windows of invocation ``invocation_id`` read from ``trace``, its
    conversation key and whether its decision history is ``retained``."""
    windows, key = _windows(trace, invocation_id)
    return {
        **given,
        "windows": windows,
        "conversation_key": key,
        "decision_history": "retained" if retained else "deleted",
    }


# -- rendering (the panel's line, `touba chat`'s /context) ---------------------------------


def human_bytes(size: int) -> str:
    """``size`` bytes for a reader: ``512 B``, ``3.2 KiB``, ``32 MiB``."""
    value = float(size)
    for unit in ("B", "KiB", "MiB"):
        if value < 1024 or unit == "MiB":
            if unit == "B":
                return f"{size} B"
            text = f"{value:.1f}".removesuffix(".0")
            return f"{text} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _plural(count: int, word: str) -> str:
    return f"{count} {word}" if count == 1 else f"{count} {word}s"


def _when(stamp: Any) -> str:
    if not isinstance(stamp, str):
        return "at an unknown time"
    try:
        moment = datetime.fromisoformat(stamp)
    except ValueError:
        return stamp
    return moment.strftime("%Y-%m-%d %H:%M %Z").strip()


def _source(settings: Mapping[str, Any]) -> str:
    source = settings.get("source")
    if source == "program":
        return "from the program"
    if source == "defaults":
        return "touba's defaults (the program sets none)"
    who = settings.get("saved_by")
    where = "saved in the panel" if who == "operator" else f"saved by {who}" if who else "saved"
    return f"{where} {_when(settings.get('saved_at'))}"


def _turns(turns: Any) -> str:
    if not isinstance(turns, list) or not turns:
        return "given no earlier turn"

    def one(turn: Mapping[str, Any]) -> str:
        if not turn.get("full_trace"):
            return f"{turn.get('number')} (text only)"
        calls = turn.get("calls") or 0
        return f"{turn.get('number')} (full trace{'' if calls else ', no tool call'})"

    word = "turn" if len(turns) == 1 else "turns"
    return f"given {word} " + ", ".join(one(t) for t in turns if isinstance(t, Mapping))


def _events(record: Mapping[str, Any]) -> str:
    if not record.get("key_events_active"):
        return "key events: off"
    events = record.get("key_events")
    if not isinstance(events, list) or not events:
        return "key events: none open"
    listed = ", ".join(f"{e.get('id')} ({e.get('status')})" for e in events if isinstance(e, dict))
    return f"key events: {listed}"


def describe_context(record: Mapping[str, Any] | None) -> str:
    """One line saying what a turn was given, from its record (None: not recorded).

    ``"given turns 2 (full trace); short-term memory 1 turn, saved in the panel
    2026-12-07 08:20 UTC; key events: none open"``; a preview turn says
    ``"preview: blank memory"``.
    """
    if record is None:
        return NOT_RECORDED
    version = record.get("version")
    if isinstance(version, bool) or not isinstance(version, int):
        return UNKNOWN_FORMAT
    if record.get("mode") == "preview":
        return "preview: blank memory (no earlier turn, no key event)"
    settings = record.get("settings")
    settings = settings if isinstance(settings, Mapping) else {}
    short = settings.get("short_term_turns")
    full = settings.get("full_context_turns")
    memory = f"short-term memory {_plural(short, 'turn') if isinstance(short, int) else '?'}"
    if isinstance(full, int) and full:
        memory += f" ({full} with full trace)"
    parts = [_turns(record.get("turns")), f"{memory}, {_source(settings)}", _events(record)]
    if record.get("rebuilt_at_resume"):
        parts.append("built again when resumed by another process")
    return "; ".join(parts)


def _window_line(window: Mapping[str, Any], given_turns: int) -> str:
    number = window.get("decision")
    head = f"decision {number}" if number is not None else "failed decision"
    parts: list[str] = []
    if isinstance(window.get("messages"), int):
        parts.append(
            f"history window {_plural(window['messages'], 'message')}, "
            f"{human_bytes(window.get('bytes') or 0)}"
        )
    else:
        parts.append("no history window (the provider keeps no decision history)")
    trimmed = window.get("trimmed")
    if isinstance(trimmed, Mapping):
        parts.append(
            f"trimmed {_plural(trimmed.get('exchanges') or 0, 'exchange')} "
            f"({_plural(trimmed.get('messages') or 0, 'message')}, "
            f"{human_bytes(trimmed.get('bytes') or 0)})"
        )
    summary = window.get("summary")
    if isinstance(summary, Mapping):
        parts.append(
            f"new summary of {_plural(summary.get('covered_exchanges') or 0, 'exchange')} "
            f"({human_bytes(summary.get('bytes') or 0)})"
        )
    if window.get("summary_failed"):
        parts.append("summary failed, trimmed plainly")
    if window.get("resumed_without_messages"):
        parts.append("resumed without its messages")
    guard = window.get("guard")
    if isinstance(guard, Mapping):
        verdict = "fits" if guard.get("fits") else "does not fit"
        parts.append(
            f"guard: {guard.get('tokens')} tokens counted, reserve {guard.get('reserve')} of "
            f"{guard.get('window')} ({verdict}; {_plural(guard.get('counts') or 0, 'count')})"
        )
        sent = guard.get("prior_turns")
        if isinstance(sent, int) and sent < given_turns:
            parts.append(
                f"the guard dropped the oldest {given_turns - sent} of the "
                f"{_plural(given_turns, 'earlier turn')} given (sent {sent})"
            )
    if isinstance(window.get("input_tokens"), int):
        parts.append(f"provider reported {window['input_tokens']} input tokens")
    if isinstance(window.get("error"), str):
        parts.append(f"error {window['error']}")
    return f"{head}: " + "; ".join(parts)


def describe_windows(record: Mapping[str, Any] | None) -> list[str]:
    """The details of a record, one line each: system prompt, key events, windows."""
    if record is None:
        return []
    lines: list[str] = []
    prompt = record.get("system_prompt")
    if isinstance(prompt, Mapping):
        lines.append(
            f"system prompt {human_bytes(prompt.get('bytes') or 0)} (agent instructions "
            f"{human_bytes(prompt.get('agent_bytes') or 0)}, key events block "
            f"{human_bytes(prompt.get('key_events_bytes') or 0)})"
        )
    events = record.get("key_events")
    lines.extend(
        f"key event {e.get('id')} [{e.get('type')}] {e.get('title')} ({e.get('status')})"
        for e in (events if isinstance(events, list) else [])
        if isinstance(e, Mapping)
    )
    windows = record.get("windows")
    turns = record.get("turns")
    given_turns = len(turns) if isinstance(turns, list) else 0
    lines.extend(
        _window_line(w, given_turns)
        for w in (windows if isinstance(windows, list) else [])
        if isinstance(w, Mapping)
    )
    return lines


def describe_history(record: Mapping[str, Any] | None) -> str | None:
    """Where the turn's decision history went, from its record (None: not recorded)."""
    if record is None:
        return None
    key = record.get("conversation_key")
    if not isinstance(key, str):
        return "no decision history (its provider keeps none)"
    if record.get("decision_history") == "deleted":
        return "decision history deleted when the turn was stored (retain_decision_history=False)"
    return f"decision history retained: conversation {key}"

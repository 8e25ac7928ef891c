"""What a decision step checks before it writes or sends anything.

- **Values given to a step** (:func:`check_observations`): every observation
  must be an :class:`Observation` whose fields are JSON data a store can keep
  and give back as it was (:func:`~touba.history._model.json_problem`: no
  set, bytes, object, non-str key, NaN or ±Infinity, lone surrogate, nor
  nesting deeper than ``MAX_JSON_DEPTH``). A bad one is the caller's mistake,
  so it is a ``ConfigurationError`` (a ``ValueError``) naming the path of the
  bad value, e.g. ``observations[0].result["a"][3]``, raised before the
  conversation is even reserved. It is not a ``DecisionHistoryRecordInvalid``:
  nothing stored is wrong, and nothing was stored.
- **A decision** (:func:`check_decision_json`): what the provider returned is kept
  in history, so it must be JSON data too; a model's arguments holding NaN
  (which Python's JSON parser accepts) are bad JSON, reported as
  ``AgentDecisionProviderSchemaViolation`` (``invalid_json``) and never stored.
- **The window** (:func:`check_window`): before any provider request, each
  exchange sent must be well formed: a data message alone, or a decision
  followed by exactly one result per call, with the call's id and name, in
  the calls' order; no result without its call, no empty exchange, no
  summary inside one. Built-in stores keep messages as rows that anyone with
  access to the database can damage (a deleted result row, an edited
  ``call_id``); sending such a window would make the provider answer 400,
  read as a retryable outage. It is refused with
  ``DecisionHistoryRecordInvalid`` naming the conversation: no request is
  sent and nothing is appended. The check reads only the window (O(window)),
  never the retained history; a store that keeps messages between decisions
  remembers which of its unchanged exchanges passed it (``known``), so they
  are not checked again.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from typing import Any

from touba.errors import (
    AgentDecisionProviderSchemaViolation,
    ConfigurationError,
    DecisionHistoryRecordInvalid,
)
from touba.history._model import (
    DataMessage,
    DecisionMessage,
    Message,
    Observation,
    ResultMessage,
    json_problem,
    message_to_dict,
)

__all__ = ["check_decision_json", "check_observations", "check_window"]

_STATUSES = ("ok", "error", "denied")


def _observation_problem(observation: object, where: str) -> str | None:
    if not isinstance(observation, Observation):
        return f"{where} is a {type(observation).__name__}, not a touba Observation"
    for name in ("call_id", "name"):
        value = getattr(observation, name)
        if not isinstance(value, str):
            return f"{where}.{name} must be a str, got {type(value).__name__}"
    if observation.status not in _STATUSES:
        return f"{where}.status must be one of {', '.join(_STATUSES)}, got {observation.status!r}"
    error: object = observation.error  # typed, but callers may pass anything
    if error is not None and not isinstance(error, str):
        return f"{where}.error must be a str or None, got {type(error).__name__}"
    arguments: Any = observation.arguments
    if not hasattr(arguments, "keys"):
        return f"{where}.arguments must be a mapping, got {type(arguments).__name__}"
    fields = (
        (dict(arguments), "arguments"),
        (observation.result, "result"),
        (observation.error, "error"),
        (observation.call_id, "call_id"),
        (observation.name, "name"),
    )
    for value, name in fields:
        problem = json_problem(value, f"{where}.{name}")
        if problem is not None:
            return problem
    return None


def check_observations(
    observations: Sequence[Observation], data: Sequence[Observation] = ()
) -> None:
    """Refuse observations that are not JSON data (see the module docstring)."""
    for group, name in ((observations, "observations"), (data, "data")):
        for index, observation in enumerate(group):
            problem = _observation_problem(observation, f"{name}[{index}]")
            if problem is not None:
                raise ConfigurationError(
                    f"{problem}; observations must hold JSON data (dict, list, str, int, "
                    "finite float, bool, None). Nothing was written and no model was called"
                )


def check_decision_json(decision: DecisionMessage) -> None:
    """Refuse a decision that history could not keep as JSON (see the module docstring)."""
    problem = json_problem(message_to_dict(decision), "decision")
    if problem is not None:
        raise AgentDecisionProviderSchemaViolation(
            f"the decision received is not JSON data ({problem}); it was not stored",
            provider_error_code="invalid_json",
        )


def _exchange_problem(exchange: Sequence[Message]) -> str | None:
    """Why one exchange of a window is not well formed, or None."""
    if not exchange:
        return "it holds no message"
    first, rest = exchange[0], exchange[1:]
    if isinstance(first, DataMessage):
        return "a data message shares it with other messages" if rest else None
    if not isinstance(first, DecisionMessage):
        if isinstance(first, ResultMessage):
            return f"result {first.call_id!r} comes without the decision that made its call"
        return f"it starts with a {first.kind} message"
    calls = first.calls
    if len({c.call_id for c in calls}) != len(calls):
        return "its decision repeats a call id"
    for position, message in enumerate(rest):
        if not isinstance(message, ResultMessage):
            return f"a {message.kind} message follows its decision"
        if position >= len(calls):
            return f"result {message.call_id!r} answers no call of its decision"
        call = calls[position]
        if (message.call_id, message.name) != (call.call_id, call.name):
            return (
                f"result {position} answers {message.call_id!r} ({message.name}) where call "
                f"{call.call_id!r} ({call.name}) awaits it"
            )
    if len(rest) < len(calls):
        missing = ", ".join(repr(c.call_id) for c in calls[len(rest) :])
        return f"call(s) {missing} have no result"
    return None


def check_window(
    session_key: str,
    start: int,
    exchanges: Sequence[Sequence[Message]],
    known: Container[int] = (),
) -> None:
    """Refuse a window a provider would reject (see the module docstring).

    ``start`` is the index of the first exchange, to name the damaged one;
    exchanges whose index is in ``known`` passed this check before, unchanged
    since, and are skipped.
    """
    for offset, exchange in enumerate(exchanges):
        if start + offset in known:
            continue
        problem = _exchange_problem(exchange)
        if problem is not None:
            raise DecisionHistoryRecordInvalid(
                f"conversation {session_key} is damaged: in exchange {start + offset}, "
                f"{problem}. Nothing was sent to the provider and nothing was written. "
                f"Inspect it with `touba history show {session_key}`, and delete it "
                f"(`touba history rm {session_key}`) to start the conversation again"
            )

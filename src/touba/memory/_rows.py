"""The SQL both built-in stores run, and the codecs from their rows to the records.

:data:`STATEMENTS` is the common subset of SQLite (>= 3.35) and PostgreSQL:
``RETURNING``, ``ON CONFLICT DO NOTHING`` (and ``DO UPDATE ... excluded``),
``CAST(%s AS TEXT) IS NULL`` for optional filters, ``strpos`` and ``lower``
(SQLite gets Unicode-aware ones as functions). ``{sessions}``, ``{turns}``,
``{events}``, ``{history}``, ``{jobs}``, ``{configs}`` and ``{changes}`` (the
history of the settings) are table names,
``{for_update}`` and ``{skip_locked}`` row-lock clauses (empty in SQLite,
whose writers are serialised), ``{*_cols}`` the column lists and
``{mode_filter}``, ``{event_filters}`` the optional filters below; each
backend fills them in once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

from touba.errors import ConfigurationError, MemoryStoreUnavailable
from touba.history._model import STORED_JSON_DEPTH, canonical_json, json_problem, parse_json
from touba.memory._config import MemoryConfig, config_from_data
from touba.memory._model import (
    ExtractedOp,
    ExtractionJob,
    FieldChange,
    KeyEvent,
    KeyEventUpdate,
    MemoryConfigChange,
    SessionMeta,
    StoredTurn,
    op_from_dict,
    op_to_dict,
    trace_from_data,
)

__all__ = [
    "COLUMNS",
    "EXPIRED_LAST_ATTEMPT",
    "MAX_ERROR_CHARS",
    "STATEMENTS",
    "Row",
    "change_from_row",
    "changes_json",
    "config_from_text",
    "dumps",
    "event_from_row",
    "job_from_row",
    "loads",
    "ops_json",
    "session_from_row",
    "turn_from_row",
    "update_from_row",
]

Row = Sequence[Any]
Ts = Callable[[Any], datetime]

SESSION_COLUMNS = "session_id, owner, agent_ref, mode, created_at, ended_at, turns"
TURN_COLUMNS = "session_id, idx, user_text, replies, trace, invocation_id, created_at, context"
EVENT_COLUMNS = "id, owner, type, title, status, details, created_at, updated_at, session_id"
HISTORY_COLUMNS = "at, session_id, changes, op_id, actor"
CHANGE_COLUMNS = "agent_ref, before_config, after_config, at, actor"
JOB_COLUMNS = (
    "id, session_id, owner, agent_ref, transcript_ref, status, attempts, max_attempts, "
    "next_attempt_at, created_at, updated_at, lease_owner, lease_token, lease_expires_at, "
    "last_error, ops, result"
)
MAX_ERROR_CHARS = 2000
EXPIRED_LAST_ATTEMPT = (
    "the worker's lease expired on the last attempt (the worker crashed or overran "
    "lease_seconds); requeue the job once the cause is fixed"
)


COLUMNS = {
    "session_cols": SESSION_COLUMNS,
    "turn_cols": TURN_COLUMNS,
    "event_cols": EVENT_COLUMNS,
    "history_cols": HISTORY_COLUMNS,
    "change_cols": CHANGE_COLUMNS,
    "job_cols": JOB_COLUMNS,
    # Optional filters, each parameter given twice (``None`` turns the filter off). Text
    # is matched with ``strpos``: a plain substring, where ``%``, ``_`` and ``\`` are
    # characters like any other.
    "mode_filter": "(CAST(%s AS TEXT) IS NULL OR mode = %s)",
    "event_filters": "(CAST(%s AS TEXT) IS NULL OR type = %s)"
    " AND (CAST(%s AS TEXT) IS NULL OR status = %s) AND (%s OR status <> 'closed')"
    " AND (CAST(%s AS TEXT) IS NULL OR strpos(lower(title), lower(%s)) > 0"
    " OR strpos(lower(details), lower(%s)) > 0)",
}
# {sessions} {turns} {events} {history} {jobs} {configs} {changes}: table names; {for_update} and
# {skip_locked}: row-lock clauses (empty in SQLite, whose writers are serialised).
STATEMENTS: dict[str, str] = {
    "session": "SELECT {session_cols} FROM {sessions} WHERE session_id = %s",
    "insert_session": "INSERT INTO {sessions} (session_id, owner, agent_ref, mode, created_at)"
    " VALUES (%s, %s, %s, %s, %s) ON CONFLICT DO NOTHING",
    "end_session": "UPDATE {sessions} SET ended_at = COALESCE(ended_at, %s) WHERE session_id = %s",
    # Retention (``SqlMemoryStore.purge_before``): each delete or update touches at most
    # a batch (the LIMIT of its subquery) and re-checks its condition on the rows it
    # changes, so that a row changed meanwhile (an event reopened) is left alone.
    "count_old_turns": "SELECT COUNT(*) FROM {turns} WHERE created_at < %s",
    "delete_old_turns": "DELETE FROM {turns} WHERE created_at < %s AND (session_id, idx) IN"
    " (SELECT session_id, idx FROM {turns} WHERE created_at < %s LIMIT %s)",
    "count_emptied_sessions": "SELECT COUNT(*) FROM {sessions} s WHERE s.ended_at < %s"
    " AND NOT EXISTS (SELECT 1 FROM {turns} t WHERE t.session_id = s.session_id"
    " AND t.created_at >= %s)",
    "delete_empty_sessions": "DELETE FROM {sessions} WHERE ended_at < %s AND session_id IN"
    " (SELECT s.session_id FROM {sessions} s WHERE s.ended_at < %s AND NOT EXISTS"
    " (SELECT 1 FROM {turns} t WHERE t.session_id = s.session_id) LIMIT %s)",
    "count_finished_jobs": "SELECT COUNT(*) FROM {jobs}"
    " WHERE status IN ('done', 'failed') AND updated_at < %s",
    "delete_finished_jobs": "DELETE FROM {jobs} WHERE status IN ('done', 'failed')"
    " AND updated_at < %s AND id IN (SELECT id FROM {jobs}"
    " WHERE status IN ('done', 'failed') AND updated_at < %s LIMIT %s)",
    "count_closed_events": "SELECT COUNT(*) FROM {events}"
    " WHERE status = 'closed' AND updated_at < %s",
    "count_closed_updates": "SELECT COUNT(*) FROM {history} h JOIN {events} e"
    " ON e.id = h.event_id WHERE e.status = 'closed' AND e.updated_at < %s",
    "delete_closed_events": "DELETE FROM {events} WHERE status = 'closed' AND updated_at < %s"
    " AND id IN (SELECT id FROM {events} WHERE status = 'closed' AND updated_at < %s LIMIT %s)"
    " RETURNING id",
    "delete_event_history": "DELETE FROM {history} WHERE event_id = %s",
    "count_traces": "SELECT COUNT(*) FROM {turns} WHERE created_at < %s"
    " AND (trace <> '[]' OR context IS NOT NULL)",
    "drop_traces": "UPDATE {turns} SET trace = '[]', context = NULL WHERE created_at < %s"
    " AND (trace <> '[]' OR context IS NOT NULL) AND (session_id, idx) IN"
    " (SELECT session_id, idx FROM {turns} WHERE created_at < %s"
    " AND (trace <> '[]' OR context IS NOT NULL) LIMIT %s)",
    "list_sessions": "SELECT {session_cols} FROM {sessions}"
    " WHERE (CAST(%s AS TEXT) IS NULL OR owner = %s) AND {mode_filter}"
    " ORDER BY created_at DESC, session_id LIMIT %s OFFSET %s",
    "count_sessions": "SELECT COUNT(*) FROM {sessions}"
    " WHERE (CAST(%s AS TEXT) IS NULL OR owner = %s) AND {mode_filter}",
    "owners": "SELECT owner, COUNT(*), SUM(turns), MAX(created_at),"
    " SUM(CASE WHEN mode = 'preview' THEN 1 ELSE 0 END) FROM {sessions} WHERE {mode_filter}"
    " GROUP BY owner ORDER BY MAX(created_at) DESC, owner LIMIT %s OFFSET %s",
    "count_owners": "SELECT COUNT(DISTINCT owner) FROM {sessions} WHERE {mode_filter}",
    "event_owners": "SELECT DISTINCT owner FROM {events} ORDER BY owner LIMIT %s OFFSET %s",
    "owner_events": "SELECT COUNT(*), SUM(CASE WHEN status <> 'closed' THEN 1 ELSE 0 END)"
    " FROM {events} WHERE owner = %s",
    "delete_turns": "DELETE FROM {turns} WHERE session_id = %s",
    "delete_session": "DELETE FROM {sessions} WHERE session_id = %s",
    "next_turn": "UPDATE {sessions} SET turns = turns + 1"
    " WHERE session_id = %s AND ended_at IS NULL RETURNING turns",
    "insert_turn": "INSERT INTO {turns} ({turn_cols}) VALUES (%s, %s, %s, %s, %s, %s, %s, %s)",
    "recent_turns": "SELECT {turn_cols} FROM {turns} WHERE session_id = %s"
    " ORDER BY idx DESC LIMIT %s",
    # Fork and rewind: the session row locked first, so that appends and rewinds of it
    # wait for the copy (SQLite's writers are serialised anyway).
    "session_locked": "SELECT {session_cols} FROM {sessions} WHERE session_id = %s{for_update}",
    "copy_turns": "INSERT INTO {turns} ({turn_cols}) SELECT CAST(%s AS TEXT), idx, user_text,"
    " replies, trace, invocation_id, created_at, context FROM {turns}"
    " WHERE session_id = %s AND idx < %s",
    "set_turns": "UPDATE {sessions} SET turns = %s WHERE session_id = %s",
    "drop_turns_after": "DELETE FROM {turns} WHERE session_id = %s AND idx >= %s",
    "turns_page": "SELECT {turn_cols} FROM {turns} WHERE session_id = %s"
    " ORDER BY idx LIMIT %s OFFSET %s",
    "turns_page_newest": "SELECT {turn_cols} FROM {turns} WHERE session_id = %s"
    " ORDER BY idx DESC LIMIT %s OFFSET %s",
    "event_by_op": "SELECT {event_cols} FROM {events} WHERE op_id = %s",
    "event": "SELECT {event_cols} FROM {events} WHERE id = %s AND owner = %s",
    "event_locked": "SELECT {event_cols} FROM {events} WHERE id = %s AND owner = %s{for_update}",
    "insert_event": "INSERT INTO {events} ({event_cols}, touched, op_id)"
    " VALUES (%s, %s, %s, %s, 'open', %s, %s, %s, %s,"
    " (SELECT COALESCE(MAX(e.touched), 0) + 1 FROM {events} e WHERE e.owner = %s), %s)"
    " ON CONFLICT DO NOTHING",
    "op_applied": "SELECT 1 FROM {history} WHERE op_id = %s",
    "update_event": "UPDATE {events} SET status = %s, title = %s, details = %s, updated_at = %s,"
    " touched = (SELECT COALESCE(MAX(e.touched), 0) + 1 FROM {events} e WHERE e.owner = %s)"
    " WHERE id = %s",
    "insert_history": "INSERT INTO {history} (event_id, at, session_id, changes, op_id, actor)"
    " VALUES (%s, %s, %s, %s, %s, %s)",
    "history": "SELECT {history_cols} FROM {history} WHERE event_id = %s ORDER BY seq",
    "query_events": "SELECT {event_cols} FROM {events} WHERE owner = %s AND {event_filters}"
    " ORDER BY touched DESC, id DESC LIMIT %s OFFSET %s",
    "count_events": "SELECT COUNT(*) FROM {events} WHERE owner = %s AND {event_filters}",
    # Across owners (the panel's search): ``touched`` counts per owner, so the clock orders.
    "query_all_events": "SELECT {event_cols} FROM {events} WHERE {event_filters}"
    " ORDER BY updated_at DESC, touched DESC, id DESC LIMIT %s OFFSET %s",
    "count_all_events": "SELECT COUNT(*) FROM {events} WHERE {event_filters}",
    "insert_job": "INSERT INTO {jobs} (id, session_id, owner, agent_ref, transcript_ref, status,"
    " attempts, max_attempts, next_attempt_at, created_at, updated_at)"
    " VALUES (%s, %s, %s, %s, %s, 'pending', 0, %s, %s, %s, %s) ON CONFLICT DO NOTHING",
    "job": "SELECT {job_cols} FROM {jobs} WHERE id = %s",
    "expire_jobs": "UPDATE {jobs} SET status = 'failed', last_error = %s, lease_owner = NULL,"
    " lease_token = NULL, lease_expires_at = NULL, updated_at = %s"
    " WHERE status = 'running' AND lease_expires_at <= %s AND attempts >= max_attempts",
    "due_job": "SELECT id FROM {jobs} WHERE ((status = 'pending' AND next_attempt_at <= %s)"
    " OR (status = 'running' AND lease_expires_at <= %s AND attempts < max_attempts))"
    " AND (CAST(%s AS TEXT) IS NULL OR id = %s)"
    " ORDER BY next_attempt_at, created_at, id LIMIT 1{skip_locked}",
    "claim_job": "UPDATE {jobs} SET status = 'running', attempts = attempts + 1,"
    " lease_owner = %s, lease_token = %s, lease_expires_at = %s, updated_at = %s WHERE id = %s",
    "leased_job": "SELECT {job_cols} FROM {jobs}"
    " WHERE id = %s AND status = 'running' AND lease_token = %s{for_update}",
    "set_ops": "UPDATE {jobs} SET ops = COALESCE(ops, %s), updated_at = %s WHERE id = %s",
    "finish_job": "UPDATE {jobs} SET status = %s, result = %s, next_attempt_at = %s,"
    " last_error = %s, lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL,"
    " updated_at = %s WHERE id = %s",
    "requeue_job": "UPDATE {jobs} SET status = 'pending', attempts = 0, next_attempt_at = %s,"
    " updated_at = %s WHERE id = %s AND status = 'failed'",
    "list_jobs": "SELECT {job_cols} FROM {jobs} WHERE CAST(%s AS TEXT) IS NULL OR status = %s"
    " ORDER BY updated_at DESC, id LIMIT %s OFFSET %s",
    "job_counts": "SELECT status, COUNT(*) FROM {jobs} GROUP BY status",
    "load_config": "SELECT config, updated_at, saved_by FROM {configs} WHERE agent_ref = %s",
    # A save inserts, or else locks the saved row and updates it: concurrent saves of
    # one agent queue up, so each change records the settings it really replaced.
    "insert_config": "INSERT INTO {configs} (agent_ref, config, updated_at, saved_by)"
    " VALUES (%s, %s, %s, %s) ON CONFLICT DO NOTHING",
    "config_locked": "SELECT config FROM {configs} WHERE agent_ref = %s{for_update}",
    "update_config": "UPDATE {configs} SET config = %s, updated_at = %s, saved_by = %s"
    " WHERE agent_ref = %s",
    "delete_config": "DELETE FROM {configs} WHERE agent_ref = %s RETURNING config",
    "insert_change": "INSERT INTO {changes} ({change_cols}) VALUES (%s, %s, %s, %s, %s)",
    "config_changes": "SELECT {change_cols} FROM {changes} WHERE agent_ref = %s"
    " ORDER BY seq DESC LIMIT %s",
    # Import (touba.data.import_records): records inserted as exported, ids and times
    # kept; an id already there changes nothing. An imported event is touched before
    # its owner's others (exports list them newest first).
    "import_session": "INSERT INTO {sessions} ({session_cols}) VALUES (%s, %s, %s, %s, %s, %s, %s)"
    " ON CONFLICT DO NOTHING",
    "import_turn": "INSERT INTO {turns} ({turn_cols}) VALUES (%s, %s, %s, %s, %s, %s, %s, %s)"
    " ON CONFLICT DO NOTHING",
    "import_event": "INSERT INTO {events} ({event_cols}, touched, op_id)"
    " VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s,"
    " (SELECT COALESCE(MIN(e.touched), 1) - 1 FROM {events} e WHERE e.owner = %s), NULL)"
    " ON CONFLICT DO NOTHING",
    "import_history": "INSERT INTO {history} (event_id, at, session_id, changes, op_id, actor)"
    " VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT DO NOTHING",
    "event_owner": "SELECT owner FROM {events} WHERE id = %s",
    "import_job": "INSERT INTO {jobs} ({job_cols})"
    " VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)"
    " ON CONFLICT DO NOTHING",
    # Erasing one user (``erase_owner`` / ``count_owner``): the rows are gathered by id
    # first, then deleted one statement per id, in one transaction.
    "owner_session_ids": "SELECT session_id FROM {sessions} WHERE owner = %s",
    "session_exists": "SELECT session_id FROM {sessions} WHERE session_id = %s",
    "session_turn_count": "SELECT COUNT(*) FROM {turns} WHERE session_id = %s",
    "owner_event_ids": "SELECT id FROM {events} WHERE owner = %s",
    "event_history_count": "SELECT COUNT(*) FROM {history} WHERE event_id = %s",
    "owner_job_ids": "SELECT id FROM {jobs} WHERE owner = %s",
    "session_job_ids": "SELECT id FROM {jobs} WHERE session_id = %s",
    "erase_event_history": "DELETE FROM {history} WHERE event_id = %s",
    "erase_event": "DELETE FROM {events} WHERE id = %s",
    "erase_job": "DELETE FROM {jobs} WHERE id = %s",
    # Encryption at rest (``encryption=``): an update history row is sealed bound to its
    # ``seq``, known once inserted; rotation finds the values sealed with another key by
    # their token's prefix (``substr``: the same in both dialects) and re-seals them.
    "insert_history_seq": "INSERT INTO {history} (event_id, at, session_id, changes, op_id,"
    " actor) VALUES (%s, %s, %s, %s, %s, %s) RETURNING seq",
    "history_seq": "SELECT seq, {history_cols} FROM {history} WHERE event_id = %s ORDER BY seq",
    "reseal_history": "UPDATE {history} SET changes = %s WHERE seq = %s",
    # Each from a cursor (the last key seen, NULL: from the start) in key order, so that
    # a rotation reads each row once over all its calls.
    "stale_turns": "SELECT session_id, idx, user_text, replies, trace, context FROM {turns}"
    " WHERE (CAST(%s AS TEXT) IS NULL OR (session_id, idx) > (%s, %s))"
    " AND (substr(user_text, 1, %s) <> %s OR substr(replies, 1, %s) <> %s"
    " OR substr(trace, 1, %s) <> %s OR substr(context, 1, %s) <> %s)"
    " ORDER BY session_id, idx LIMIT %s{for_update}",
    "reseal_turn": "UPDATE {turns} SET user_text = %s, replies = %s, trace = %s, context = %s"
    " WHERE session_id = %s AND idx = %s",
    "stale_events": "SELECT id, owner, title, details FROM {events}"
    " WHERE (CAST(%s AS TEXT) IS NULL OR id > %s)"
    " AND (substr(title, 1, %s) <> %s OR substr(details, 1, %s) <> %s)"
    " ORDER BY id LIMIT %s{for_update}",
    "reseal_event": "UPDATE {events} SET title = %s, details = %s WHERE id = %s",
    "stale_history": "SELECT seq, event_id, changes FROM {history}"
    " WHERE (CAST(%s AS BIGINT) IS NULL OR seq > %s) AND substr(changes, 1, %s) <> %s"
    " ORDER BY seq LIMIT %s{for_update}",
    "stale_jobs": "SELECT id, ops, result FROM {jobs}"
    " WHERE (CAST(%s AS TEXT) IS NULL OR id > %s)"
    " AND (substr(ops, 1, %s) <> %s OR substr(result, 1, %s) <> %s)"
    " ORDER BY id LIMIT %s{for_update}",
    "reseal_job": "UPDATE {jobs} SET ops = %s, result = %s WHERE id = %s",
    # Encryption at rest, for what SQL cannot do over sealed values: the retention of
    # traces selects in Python, a page of old turns at a time (key order, from a cursor);
    # an imported update history row is sealed bound to the ``seq`` its insert gives.
    # A token's length follows its plaintext's (padded base64), so the turns whose trace
    # and context are tokens of the current key as long as a sealed ``[]`` and ``null``
    # hold exactly those (no other trace or context is that short) and are skipped.
    "old_turn_traces": "SELECT session_id, idx, trace, context FROM {turns}"
    " WHERE created_at < %s AND (CAST(%s AS TEXT) IS NULL OR (session_id, idx) > (%s, %s))"
    " AND NOT (substr(trace, 1, %s) = %s AND length(trace) = %s"
    " AND substr(COALESCE(context, ''), 1, %s) = %s AND length(COALESCE(context, '')) = %s)"
    " ORDER BY session_id, idx LIMIT %s{for_update}",
    "set_trace": "UPDATE {turns} SET trace = %s, context = %s WHERE session_id = %s AND idx = %s",
    "import_history_seq": "INSERT INTO {history} (event_id, at, session_id, changes, op_id,"
    " actor) VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT DO NOTHING RETURNING seq",
}


def dumps(value: Any, what: str = "value") -> str:
    """Compact JSON, refusing what JSON or UTF-8 cannot hold (NaN and ±Infinity included):
    ConfigurationError naming the path of the bad value from ``what``."""
    problem = json_problem(value, what, max_depth=STORED_JSON_DEPTH)
    if problem is not None:
        raise ConfigurationError(f"{problem}; it must be JSON data, and nothing was saved")
    return canonical_json(value)


def loads(text: str, what: str) -> Any:
    try:
        return parse_json(text)
    except ValueError as e:
        raise MemoryStoreUnavailable(f"stored {what} is not JSON; repair or delete it") from e


def session_from_row(row: Sequence[Any], ts: Ts) -> SessionMeta:
    session_id, owner, agent_ref, mode, created, ended_at, turns = row
    end = None if ended_at is None else ts(ended_at)
    return SessionMeta(session_id, owner, agent_ref, mode, ts(created), end, turns)


def turn_from_row(row: Sequence[Any], ts: Ts) -> StoredTurn:
    session_id, index, user, replies, trace, invocation_id, created, context = row
    parsed_user, parsed_replies = loads(user, "user message"), loads(replies, "replies")
    parsed_context = None if context is None else loads(context, "turn context")
    if parsed_context is not None and not isinstance(parsed_context, dict):
        raise MemoryStoreUnavailable(f"turn {index} of session {session_id}: bad context")
    try:
        parsed_trace = trace_from_data(loads(trace, "trace"))
    except ValueError as e:
        raise MemoryStoreUnavailable(f"turn {index} of session {session_id}: {e}") from e
    if not isinstance(parsed_user, str) or not isinstance(parsed_replies, list):
        raise MemoryStoreUnavailable(f"turn {index} of session {session_id} is malformed")
    return StoredTurn(
        session_id,
        index,
        parsed_user,
        tuple(parsed_replies),
        parsed_trace,
        invocation_id,
        ts(created),
        parsed_context,
    )


def event_from_row(
    row: Sequence[Any], ts: Ts, history: tuple[KeyEventUpdate, ...] | None = None
) -> KeyEvent:
    event_id, owner, type_, title, status, details, created, updated, session_id = row
    return KeyEvent(
        event_id,
        owner,
        type_,
        title,
        status,
        details,
        ts(created),
        ts(updated),
        session_id,
        history,
    )


def update_from_row(row: Sequence[Any], ts: Ts) -> KeyEventUpdate:
    at, session_id, changes, op_id, actor = row
    parsed = loads(changes, "event history")
    return KeyEventUpdate(
        ts(at),
        session_id,
        tuple(FieldChange(c[0], c[1], c[2]) for c in parsed),
        op_id,
        "operator" if actor == "operator" else "model",
    )


def config_from_text(text: str, what: str, fix: str) -> MemoryConfig:
    """Settings as stored; ``MemoryStoreUnavailable`` saying ``what`` is invalid and
    what to do (``fix``) when they cannot be read."""
    try:
        return config_from_data(loads(text, what))
    except ValueError as e:
        raise MemoryStoreUnavailable(f"{what} are invalid ({e}); {fix}") from e


def change_from_row(row: Sequence[Any], ts: Ts) -> MemoryConfigChange:
    agent_ref, before, after, at, actor = row

    def config(text: str) -> MemoryConfig:
        what = f"the memory settings in the settings history of agent {agent_ref!r}"
        return config_from_text(text, what, "repair or delete that history row")

    return MemoryConfigChange(
        agent_ref,
        None if before is None else config(before),
        None if after is None else config(after),
        ts(at),
        actor,
    )


def changes_json(changes: Sequence[FieldChange]) -> str:
    return dumps([[c.field, c.old, c.new] for c in changes])


def ops_json(ops: Sequence[ExtractedOp]) -> str:
    return dumps([op_to_dict(op) for op in ops])


def job_from_row(row: Sequence[Any], ts: Ts) -> ExtractionJob:
    (job_id, session_id, owner, agent_ref, transcript_ref, status, attempts, max_attempts) = row[:8]
    next_at, created, updated, lease_owner, lease_token, lease_exp, error, ops, result = row[8:]
    parsed_ops = None
    if ops is not None:
        try:
            parsed_ops = tuple(op_from_dict(op) for op in loads(ops, "job ops"))
        except (ValueError, TypeError, AttributeError) as e:
            raise MemoryStoreUnavailable(f"extraction job {job_id} holds bad ops: {e}") from e
    return ExtractionJob(
        id=job_id,
        session_id=session_id,
        owner=owner,
        agent_ref=agent_ref,
        transcript_ref=transcript_ref,
        status=status,
        attempts=attempts,
        max_attempts=max_attempts,
        next_attempt_at=ts(next_at),
        created_at=ts(created),
        updated_at=ts(updated),
        lease_owner=lease_owner,
        lease_token=lease_token,
        lease_expires_at=None if lease_exp is None else ts(lease_exp),
        last_error=error,
        ops=parsed_ops,
        result=None if result is None else loads(result, "job result"),
    )

"""Every SQL statement of ToubaSaver's PostgreSQL backend (:mod:`._postgres`).

Composed once per table prefix with ``psycopg.sql.Identifier`` (never formatted into SQL
text); the tables, their keys and what each statement guarantees are described beside
it. Kept apart from the backend's Python, as :mod:`touba.history._pg_sql` is from
:mod:`touba.history.postgres`.
"""

from __future__ import annotations

from typing import Final, LiteralString

from psycopg import sql

__all__ = ["READ_ONLY", "RECORD", "SCHEMA_VERSION", "Statements"]

SCHEMA_VERSION: Final = 1
READ_ONLY: Final = sql.SQL("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
RECORD: Final = (
    "thread_id, ns, checkpoint_id, parent_id, type, checkpoint, metadata_type, metadata,"
    " metadata_json, run_id, versions, logs"
)


class Statements:
    """Every statement of the backend, composed once from the prefix's identifiers."""

    def __init__(self, parts: tuple[str, ...]) -> None:
        *schema, name = parts
        names = {
            key: sql.Identifier(*schema, f"{name}_{key}")
            for key in ("checkpoints", "blobs", "writes", "logs", "entries", "meta")
        }
        names["run_idx"] = sql.Identifier(f"{name}_checkpoints_run")
        names["id_idx"] = sql.Identifier(f"{name}_checkpoints_id")
        self.checkpoints = names["checkpoints"]
        self.meta = names["meta"]

        def q(text: LiteralString) -> sql.Composed:
            return sql.SQL(text).format(**names)

        self.create = [
            q(
                "CREATE TABLE {checkpoints} ("
                " thread_id text NOT NULL, ns text NOT NULL, checkpoint_id text NOT NULL,"
                " parent_id text, type text NOT NULL, checkpoint bytea NOT NULL,"
                " metadata_type text NOT NULL, metadata bytea NOT NULL,"
                " metadata_json text NOT NULL, run_id text, versions text NOT NULL,"
                " logs text NOT NULL, PRIMARY KEY (thread_id, ns, checkpoint_id))"
            ),
            q("CREATE INDEX {run_idx} ON {checkpoints} (run_id) WHERE run_id IS NOT NULL"),
            q("CREATE INDEX {id_idx} ON {checkpoints} (checkpoint_id)"),
            q(
                "CREATE TABLE {blobs} ("
                " thread_id text NOT NULL, ns text NOT NULL, channel text NOT NULL,"
                " version text NOT NULL, type text, data bytea,"
                " PRIMARY KEY (thread_id, ns, channel, version))"
            ),
            q(
                "CREATE TABLE {writes} ("
                " thread_id text NOT NULL, ns text NOT NULL, checkpoint_id text NOT NULL,"
                " task_id text NOT NULL, idx integer NOT NULL, channel text NOT NULL,"
                " type text NOT NULL, data bytea NOT NULL, task_path text NOT NULL,"
                " PRIMARY KEY (thread_id, ns, checkpoint_id, task_id, idx))"
            ),
            q(
                "CREATE TABLE {logs} ("
                " thread_id text NOT NULL, ns text NOT NULL, channel text NOT NULL,"
                " token text NOT NULL, length bigint NOT NULL,"
                " PRIMARY KEY (thread_id, ns, channel))"
            ),
            q(
                "CREATE TABLE {entries} ("
                " thread_id text NOT NULL, ns text NOT NULL, channel text NOT NULL,"
                " position bigint NOT NULL, type text NOT NULL, data bytea NOT NULL,"
                " PRIMARY KEY (thread_id, ns, channel, position))"
            ),
        ]

        # -- put: the logs (locked until the commit) and their new entries, then the rest
        # put: one statement. It upserts the logs it appends to (their rows locked until
        # it commits), inserts the new entries at each log's end, the new blobs, and the
        # checkpoint row with its spans: the base (merged) followed by the appended
        # range, joined to the base's last span when adjacent. A base ending past its
        # log's end makes those spans NULL, which the NOT NULL of ``logs`` refuses:
        # the statement, so everything it did, is rolled back.
        self.put = q(
            "WITH held AS (SELECT pg_advisory_xact_lock_shared(%(lock)s)),"
            " input AS ("
            " SELECT i.* FROM held, unnest(%(channels)s::text[], %(counts)s::bigint[],"
            " %(tokens)s::text[], %(bases)s::text[], %(base_ends)s::bigint[])"
            " AS i(channel, n, token, base, base_end)),"
            " lg AS ("
            " INSERT INTO {logs} AS l (thread_id, ns, channel, token, length)"
            " SELECT %(thread)s, %(ns)s, channel, token, n FROM input ORDER BY channel"
            " ON CONFLICT (thread_id, ns, channel)"
            " DO UPDATE SET length = l.length + excluded.length"
            " RETURNING channel, token, length),"
            " at AS ("
            " SELECT i.channel, i.n, i.base::jsonb AS base, i.base_end, lg.token,"
            " lg.length - i.n AS start FROM input i JOIN lg ON lg.channel = i.channel),"
            " ins AS ("
            " INSERT INTO {entries} (thread_id, ns, channel, position, type, data)"
            " SELECT %(thread)s, %(ns)s, e.channel, at.start + e.idx, e.type, e.data"
            " FROM unnest(%(e_channels)s::text[], %(e_idx)s::bigint[], %(e_types)s::text[],"
            " %(e_data)s::bytea[]) AS e(channel, idx, type, data)"
            " JOIN at ON at.channel = e.channel),"
            " b AS ("
            " INSERT INTO {blobs} (thread_id, ns, channel, version, type, data)"
            " SELECT %(thread)s, %(ns)s, * FROM unnest(%(b_channels)s::text[],"
            " %(b_versions)s::text[], %(b_types)s::text[], %(b_data)s::bytea[])"
            " ON CONFLICT DO NOTHING),"
            " spans AS ("
            " SELECT bool_or(base_end > start) AS bad, jsonb_object_agg(channel, CASE"
            " WHEN n = 0 THEN base"
            " WHEN jsonb_array_length(base) > 0 AND (base -> -1 ->> 1)::bigint = start"
            " THEN (base - (-1)) || jsonb_build_array(jsonb_build_array(base -> -1 -> 0,"
            " start + n))"
            " ELSE base || jsonb_build_array(jsonb_build_array(start, start + n)) END) AS logs"
            " FROM at),"
            " cp AS ("
            " INSERT INTO {checkpoints} (thread_id, ns, checkpoint_id, parent_id, type,"
            " checkpoint, metadata_type, metadata, metadata_json, run_id, versions, logs)"
            " SELECT %(thread)s, %(ns)s, %(id)s, %(parent)s, %(type)s, %(checkpoint)s,"
            " %(metadata_type)s, %(metadata)s, %(metadata_json)s, %(run_id)s, %(versions)s,"
            " CASE WHEN spans.bad THEN NULL ELSE coalesce(spans.logs, '{{}}'::jsonb)::text END"
            " FROM spans"
            " ON CONFLICT (thread_id, ns, checkpoint_id) DO UPDATE SET"
            " parent_id = excluded.parent_id, type = excluded.type,"
            " checkpoint = excluded.checkpoint, metadata_type = excluded.metadata_type,"
            " metadata = excluded.metadata, metadata_json = excluded.metadata_json,"
            " run_id = excluded.run_id, versions = excluded.versions, logs = excluded.logs)"
            " SELECT channel, token, start FROM at"
        )
        self.put_writes = q(
            "WITH input AS ("
            " SELECT * FROM unnest(%(tasks)s::text[], %(idx)s::integer[], %(channels)s::text[],"
            " %(types)s::text[], %(data)s::bytea[], %(paths)s::text[])"
            " AS w(task_id, idx, channel, type, data, task_path)),"
            " special AS ("
            " INSERT INTO {writes} AS o (thread_id, ns, checkpoint_id, task_id, idx, channel,"
            " type, data, task_path)"
            " SELECT %(thread)s, %(ns)s, %(id)s, * FROM input WHERE idx < 0"
            " ON CONFLICT (thread_id, ns, checkpoint_id, task_id, idx) DO UPDATE SET"
            " channel = excluded.channel, type = excluded.type, data = excluded.data,"
            " task_path = excluded.task_path)"
            " INSERT INTO {writes} (thread_id, ns, checkpoint_id, task_id, idx, channel, type,"
            " data, task_path)"
            " SELECT %(thread)s, %(ns)s, %(id)s, * FROM input WHERE idx >= 0"
            " ON CONFLICT DO NOTHING"
        )

        # -- delete, copy, prune
        # a thread's lock: every put holds it shared (in its statement, before it touches
        # a log), delete, copy (of the source) and prune hold it alone, taken in a
        # statement of its own so that the statements after it see every put before it
        self.lock_thread = sql.SQL("SELECT pg_advisory_xact_lock(%s)")
        self.delete_thread = q(
            "WITH c AS (DELETE FROM {checkpoints} WHERE thread_id = %(t)s),"
            " b AS (DELETE FROM {blobs} WHERE thread_id = %(t)s),"
            " w AS (DELETE FROM {writes} WHERE thread_id = %(t)s),"
            " e AS (DELETE FROM {entries} WHERE thread_id = %(t)s)"
            " DELETE FROM {logs} WHERE thread_id = %(t)s"
        )
        self.delete_for_runs = q(
            "WITH gone AS (DELETE FROM {checkpoints} WHERE run_id = ANY(%s)"
            " RETURNING thread_id, ns, checkpoint_id)"
            " DELETE FROM {writes} w USING gone g WHERE w.thread_id = g.thread_id"
            " AND w.ns = g.ns AND w.checkpoint_id = g.checkpoint_id"
        )
        # copy: the source's logs held still, the target's appended to at their end
        self.logs_of_thread = q(
            "SELECT ns, channel, length FROM {logs} WHERE thread_id = %s ORDER BY ns, channel"
        )
        self.extend_logs = q(
            "WITH input AS ("
            " SELECT * FROM unnest(%(ns)s::text[], %(channels)s::text[], %(counts)s::bigint[],"
            " %(tokens)s::text[]) AS i(ns, channel, n, token))"
            " , up AS ("
            " INSERT INTO {logs} AS l (thread_id, ns, channel, token, length)"
            " SELECT %(target)s, ns, channel, token, n FROM input ORDER BY ns, channel"
            " ON CONFLICT (thread_id, ns, channel)"
            " DO UPDATE SET length = l.length + excluded.length"
            " RETURNING ns, channel, length)"
            " SELECT up.ns, up.channel, up.length - i.n FROM up JOIN input i"
            " ON i.ns = up.ns AND i.channel = up.channel"
        )
        self.copy_entries = q(
            "INSERT INTO {entries} (thread_id, ns, channel, position, type, data)"
            " SELECT %(target)s, e.ns, e.channel, e.position + o.shift, e.type, e.data"
            " FROM unnest(%(ns)s::text[], %(channels)s::text[], %(lengths)s::bigint[],"
            " %(shifts)s::bigint[]) AS o(ns, channel, length, shift)"
            " JOIN {entries} e ON e.thread_id = %(source)s AND e.ns = o.ns"
            " AND e.channel = o.channel AND e.position < o.length"
        )
        self.copy_blobs = q(
            "INSERT INTO {blobs} (thread_id, ns, channel, version, type, data)"
            " SELECT %(target)s, ns, channel, version, type, data FROM {blobs}"
            " WHERE thread_id = %(source)s ON CONFLICT DO NOTHING"
        )
        self.copy_writes = q(
            "INSERT INTO {writes} (thread_id, ns, checkpoint_id, task_id, idx, channel, type,"
            " data, task_path)"
            " SELECT %(target)s, ns, checkpoint_id, task_id, idx, channel, type, data, task_path"
            " FROM {writes} WHERE thread_id = %(source)s ON CONFLICT DO NOTHING"
        )
        self.spans_of_thread = q(
            "SELECT ns, checkpoint_id, logs FROM {checkpoints} WHERE thread_id = %s"
        )
        self.copy_checkpoints = q(
            "INSERT INTO {checkpoints} (thread_id, ns, checkpoint_id, parent_id, type,"
            " checkpoint, metadata_type, metadata, metadata_json, run_id, versions, logs)"
            " SELECT %(target)s, c.ns, c.checkpoint_id, c.parent_id, c.type, c.checkpoint,"
            " c.metadata_type, c.metadata, c.metadata_json, c.run_id, c.versions, s.logs"
            " FROM unnest(%(ns)s::text[], %(ids)s::text[], %(logs)s::text[])"
            " AS s(ns, checkpoint_id, logs)"
            " JOIN {checkpoints} c ON c.thread_id = %(source)s AND c.ns = s.ns"
            " AND c.checkpoint_id = s.checkpoint_id"
            " ON CONFLICT DO NOTHING"
        )
        self.latest_per_ns = q(
            "SELECT DISTINCT ON (ns) ns, checkpoint_id, versions, logs FROM {checkpoints}"
            " WHERE thread_id = %s ORDER BY ns, checkpoint_id DESC"
        )
        self.prune_checkpoints = q(
            "DELETE FROM {checkpoints} c WHERE c.thread_id = %(t)s AND NOT EXISTS ("
            " SELECT 1 FROM unnest(%(ns)s::text[], %(ids)s::text[]) AS k(ns, checkpoint_id)"
            " WHERE k.ns = c.ns AND k.checkpoint_id = c.checkpoint_id)"
        )
        self.prune_writes = q(
            "DELETE FROM {writes} w WHERE w.thread_id = %(t)s AND NOT EXISTS ("
            " SELECT 1 FROM unnest(%(ns)s::text[], %(ids)s::text[]) AS k(ns, checkpoint_id)"
            " WHERE k.ns = w.ns AND k.checkpoint_id = w.checkpoint_id)"
        )
        self.prune_blobs = q(
            "DELETE FROM {blobs} b WHERE b.thread_id = %(t)s AND NOT EXISTS ("
            " SELECT 1 FROM unnest(%(ns)s::text[], %(channels)s::text[], %(versions)s::text[])"
            " AS k(ns, channel, version)"
            " WHERE k.ns = b.ns AND k.channel = b.channel AND k.version = b.version)"
        )
        self.prune_entries = q(
            "WITH gone AS ("
            " DELETE FROM {entries} e WHERE e.thread_id = %(t)s AND NOT EXISTS ("
            " SELECT 1 FROM unnest(%(ns)s::text[], %(channels)s::text[], %(starts)s::bigint[],"
            " %(ends)s::bigint[]) AS k(ns, channel, s, e)"
            " WHERE k.ns = e.ns AND k.channel = e.channel AND e.position >= k.s"
            " AND e.position < k.e)"
            " RETURNING ns, channel),"
            " touched AS (SELECT DISTINCT ns, channel FROM gone)"
            " UPDATE {logs} l SET token = %(token)s"
            " FROM touched t WHERE l.thread_id = %(t)s AND l.ns = t.ns AND l.channel = t.channel"
        )

        # -- reads
        record = "SELECT " + RECORD + " FROM {checkpoints}"  # noqa: S608 - constant text
        # get: one statement (one snapshot, one round trip) returning the row and, as
        # arrays, its blobs, its writes in LangGraph's order, its logs' states and the
        # entries its spans name at or above what the caller holds
        # Each lookup below is a LATERAL subquery with a LIMIT, which the planner runs
        # once per outer row as an index probe (or range): left to join freely, it
        # estimates 100 rows per JSON set function and prefers scanning a whole table.
        parts_of_get = (
            " SELECT c.*, bl.*, wr.*, lg.*, en.* FROM c"
            " LEFT JOIN LATERAL ("
            " SELECT array_agg(v.channel) AS b_channels, array_agg(b.type) AS b_types,"
            " array_agg(b.data) AS b_data"
            " FROM jsonb_each_text(c.versions::jsonb) AS v(channel, version)"
            " CROSS JOIN LATERAL (SELECT b.type, b.data FROM {blobs} b"
            " WHERE b.thread_id = c.thread_id AND b.ns = c.ns AND b.channel = v.channel"
            " AND b.version = v.version LIMIT 1) AS b) bl ON true"
            " LEFT JOIN LATERAL ("
            " SELECT array_agg(w.task_id ORDER BY w.task_path, w.task_id, w.idx) AS w_tasks,"
            " array_agg(w.idx ORDER BY w.task_path, w.task_id, w.idx) AS w_idx,"
            " array_agg(w.channel ORDER BY w.task_path, w.task_id, w.idx) AS w_channels,"
            " array_agg(w.type ORDER BY w.task_path, w.task_id, w.idx) AS w_types,"
            " array_agg(w.data ORDER BY w.task_path, w.task_id, w.idx) AS w_data,"
            " array_agg(w.task_path ORDER BY w.task_path, w.task_id, w.idx) AS w_paths"
            " FROM {writes} w WHERE w.thread_id = c.thread_id AND w.ns = c.ns"
            " AND w.checkpoint_id = c.checkpoint_id) wr ON true"
            " LEFT JOIN LATERAL ("
            " SELECT array_agg(k.channel) AS l_channels, array_agg(l.token) AS l_tokens,"
            " array_agg(l.length) AS l_lengths"
            " FROM jsonb_object_keys(c.logs::jsonb) AS k(channel)"
            " CROSS JOIN LATERAL (SELECT l.token, l.length FROM {logs} l"
            " WHERE l.thread_id = c.thread_id AND l.ns = c.ns AND l.channel = k.channel"
            " LIMIT 1) AS l) lg ON true"
            " LEFT JOIN LATERAL ("
            " SELECT array_agg(r.channel) AS e_channels, array_agg(e.position) AS e_positions,"
            " array_agg(e.type) AS e_types, array_agg(e.data) AS e_data"
            # each span, from what the caller holds when the log's token is its
            " FROM (SELECT s.channel,"
            " greatest((sp.span ->> 0)::bigint, coalesce(h.length, 0)) AS lo,"
            " (sp.span ->> 1)::bigint AS hi"
            " FROM jsonb_each(c.logs::jsonb) AS s(channel, spans)"
            " CROSS JOIN LATERAL jsonb_array_elements(s.spans) AS sp(span)"
            " CROSS JOIN LATERAL (SELECT l.token FROM {logs} l"
            " WHERE l.thread_id = c.thread_id AND l.ns = c.ns AND l.channel = s.channel"
            " LIMIT 1) AS l"
            " LEFT JOIN unnest(%(h_channels)s::text[], %(h_tokens)s::text[],"
            " %(h_lengths)s::bigint[]) AS h(channel, token, length)"
            " ON h.channel = s.channel AND h.token = l.token) AS r"
            " CROSS JOIN LATERAL (SELECT e.position, e.type, e.data FROM {entries} e"
            " WHERE e.thread_id = c.thread_id AND e.ns = c.ns AND e.channel = r.channel"
            " AND e.position >= r.lo AND e.position < r.hi"
            " ORDER BY e.position LIMIT greatest(r.hi - r.lo, 0)) AS e"
            ") en ON true"
        )
        self.get_latest = q(
            "WITH c AS (" + record + " WHERE thread_id = %(t)s AND ns = %(ns)s"
            " ORDER BY checkpoint_id DESC LIMIT 1)" + parts_of_get
        )
        self.get_one = q(
            "WITH c AS (" + record + " WHERE thread_id = %(t)s AND ns = %(ns)s"
            " AND checkpoint_id = %(id)s)" + parts_of_get
        )
        self.list_head = sql.SQL(record).format(**names)
        self.blobs_of = q(
            "SELECT k.thread_id, k.ns, k.channel, k.version, b.type, b.data"
            " FROM unnest(%s::text[], %s::text[], %s::text[], %s::text[])"
            " AS k(thread_id, ns, channel, version)"
            " JOIN {blobs} b ON b.thread_id = k.thread_id AND b.ns = k.ns"
            " AND b.channel = k.channel AND b.version = k.version"
        )
        self.writes_of = q(
            "SELECT w.thread_id, w.ns, w.checkpoint_id, w.task_id, w.idx, w.channel, w.type,"
            " w.data, w.task_path"
            " FROM unnest(%s::text[], %s::text[], %s::text[]) AS k(thread_id, ns, checkpoint_id)"
            " JOIN {writes} w ON w.thread_id = k.thread_id AND w.ns = k.ns"
            " AND w.checkpoint_id = k.checkpoint_id"
            " ORDER BY w.thread_id, w.ns, w.checkpoint_id, w.task_path, w.task_id, w.idx"
        )
        self.logs_of = q(
            "SELECT l.thread_id, l.ns, l.channel, l.token, l.length"
            " FROM unnest(%s::text[], %s::text[], %s::text[]) AS k(thread_id, ns, channel)"
            " JOIN {logs} l ON l.thread_id = k.thread_id AND l.ns = k.ns"
            " AND l.channel = k.channel"
        )
        self.entries_of = q(
            "SELECT k.i, e.position, e.type, e.data"
            " FROM unnest(%s::integer[], %s::text[], %s::text[], %s::text[], %s::bigint[],"
            " %s::bigint[]) AS k(i, thread_id, ns, channel, s, e)"
            " JOIN {entries} e ON e.thread_id = k.thread_id AND e.ns = k.ns"
            " AND e.channel = k.channel AND e.position >= k.s AND e.position < k.e"
        )

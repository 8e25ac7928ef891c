"""The export format itself: any JSON content survives a line's round trip unchanged,
and through the stores (RAM history and checkpoint stores) too."""

from __future__ import annotations

import asyncio
import io
from typing import Any, cast

from hypothesis import given, settings
from hypothesis import strategies as st

from touba.data import Stores, import_records, write_export
from touba.data._export import checkpoint_line, conversation_line
from touba.data._format import FORMAT_VERSION, dump_line, header_line, parse_header, parse_line
from touba.history import ConversationIdentity, MemoryHistoryStore
from touba.history._record import new_head
from touba.runtime import MemoryCheckpointStore

TEXT = st.text(st.characters(codec="utf-8"), max_size=20)  # no lone surrogates
JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=20,
)
WHO = ConversationIdentity("app", "openai", "m", "native", "run", "inv", "agent")


def record_with(content: Any) -> dict[str, Any]:
    return new_head(WHO) | {"exchanges": [[{"kind": "input", "text": "x", "data": content}]]}


@given(content=JSON, key=TEXT.filter(bool))
def test_a_conversation_line_round_trips_any_json(content: Any, key: str) -> None:
    line = conversation_line(key, record_with(content))
    parsed = parse_line(dump_line(line), 2)
    assert parsed.model_dump(mode="json") == line


@given(body=st.dictionaries(TEXT, JSON, max_size=5), checkpoint_id=TEXT.filter(bool))
def test_a_checkpoint_line_round_trips_any_json(body: dict[str, Any], checkpoint_id: str) -> None:
    line = checkpoint_line(checkpoint_id, body)
    assert parse_line(dump_line(line), 2).model_dump(mode="json") == line


@given(selection=st.dictionaries(st.sampled_from(["session", "namespace"]), TEXT, max_size=1))
def test_the_header_round_trips(selection: dict[str, str]) -> None:
    header = header_line(selection)
    parsed = parse_header(dump_line(header))
    assert parsed.version == FORMAT_VERSION
    assert parsed.selection == selection


@settings(max_examples=40, deadline=None)
@given(content=JSON, body=st.dictionaries(TEXT, JSON, max_size=4))
def test_any_json_content_survives_export_then_import(content: Any, body: dict[str, Any]) -> None:
    async def scenario() -> None:
        source = Stores(
            histories=(cast(Any, MemoryHistoryStore()),), checkpoints=MemoryCheckpointStore()
        )
        record = record_with(content)

        async def put(current: Any) -> tuple[dict[str, Any], None]:
            return record, None

        await source.histories[0].transact("app:k", put)  # type: ignore[attr-defined]
        assert source.checkpoints is not None
        await source.checkpoints.save("cp", body | {"run_id": "run"})
        out = io.BytesIO()
        await write_export(source, out, session="run")
        target = Stores(
            histories=(cast(Any, MemoryHistoryStore()),), checkpoints=MemoryCheckpointStore()
        )

        report = await import_records(target, out.getvalue().splitlines())

        assert report.added == {"conversation": 1, "checkpoint": 1}
        assert await target.histories[0].read("app:k") == record
        assert target.checkpoints is not None
        assert await target.checkpoints.get("cp") == body | {"run_id": "run"}

    asyncio.run(scenario())

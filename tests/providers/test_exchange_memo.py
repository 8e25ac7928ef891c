"""The wires' memo of rendered exchanges: what it reuses, what it forgets, and the
Anthropic digest text it puts together (the bodies themselves are checked against
an empty memo's in every scenario of test_wire_fidelity.py)."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from touba.history import CapabilityCall, DecisionMessage
from touba.history._engine import HistoryWindow
from touba.history._model import Message, ResultMessage
from touba.history._window import ExchangeSize
from touba.providers._anthropic_wire import _digest_text, _message_text
from touba.providers._memo import ExchangeMemo
from touba.providers._types import DecisionInterface


def _exchange(n: int) -> tuple[Message, ...]:
    call = CapabilityCall(f"c{n}", "lookup", {"n": n})
    return (
        DecisionMessage(calls=(call,)),
        ResultMessage(call.call_id, call.name, call.arguments, "ok", {"n": n}),
    )


def _window(*exchanges: tuple[Message, ...], weight: int = 100) -> HistoryWindow:
    sizes = tuple(ExchangeSize(len(e), weight) for e in exchanges)
    return HistoryWindow("key", None, tuple(exchanges), sizes)


class Counting:
    """A render that says what it rendered, and counts its calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[Message, ...]] = []

    def __call__(self, exchange: tuple[Message, ...], interface: DecisionInterface) -> Any:
        self.calls.append(exchange)
        first = exchange[0]
        assert isinstance(first, DecisionMessage)
        return [interface, first.calls[0].call_id]


def test_an_exchange_handed_back_again_is_not_rendered_again() -> None:
    render = Counting()
    memo = ExchangeMemo(render)
    a, b, c = _exchange(1), _exchange(2), _exchange(3)
    assert memo.rendered(_window(a, b), "native") == [["native", "c1"], ["native", "c2"]]
    # the next decision: the same tuples, one new exchange
    assert memo.rendered(_window(a, b, c), "native")[2] == ["native", "c3"]
    assert render.calls == [a, b, c]


def test_an_equal_exchange_that_is_another_object_is_rendered_anew() -> None:
    """Identity, not equality: a reloaded exchange is new data as far as the memo knows."""
    render = Counting()
    memo = ExchangeMemo(render)
    memo.rendered(_window(_exchange(1)), "native")
    memo.rendered(_window(_exchange(1)), "native")
    assert len(render.calls) == 2


def test_another_interface_is_another_rendering() -> None:
    render = Counting()
    memo = ExchangeMemo(render)
    a = _exchange(1)
    assert memo.rendered(_window(a), "native") == [["native", "c1"]]
    assert memo.rendered(_window(a), "structured") == [["structured", "c1"]]
    assert len(render.calls) == 2


def test_what_is_kept_is_bounded_by_the_exchanges_weight() -> None:
    """Two generations of at most max_bytes: an exchange unused while they filled is
    forgotten (rendered again when it comes back), a used one stays."""
    render = Counting()
    memo = ExchangeMemo(render, max_bytes=1_000)
    kept, dropped = _exchange(0), _exchange(1)
    memo.rendered(_window(kept, dropped), "native")
    for n in range(2, 60):  # 58 more exchanges of 100 bytes, `kept` used every time
        memo.rendered(_window(kept, _exchange(n)), "native")
        assert len(memo) <= 2 * (1_000 // 100) + 2
    before = len(render.calls)
    memo.rendered(_window(kept, dropped), "native")
    assert render.calls[before:] == [dropped]  # kept was found, dropped rendered again


def test_a_list_of_messages_is_rendered_but_never_kept() -> None:
    """Only a tuple cannot change under the same id."""
    render = Counting()
    memo = ExchangeMemo(render)
    exchange: Any = list(_exchange(1))
    window = HistoryWindow("key", None, (exchange,), (ExchangeSize(2, 100),))
    memo.rendered(window, "native")
    memo.rendered(window, "native")
    assert len(render.calls) == 2
    assert len(memo) == 0


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
    max_leaves=8,
)
_block = st.dictionaries(st.text(), _json, max_size=4)


@given(
    role=st.sampled_from(["user", "assistant", "other", "é"]),
    blocks=st.lists(_block, max_size=4),
    known=st.lists(st.booleans(), min_size=4, max_size=4),
)
def test_the_digest_text_put_together_from_blocks_is_the_whole_messages_text(
    role: str, blocks: list[dict[str, Any]], known: list[bool]
) -> None:
    message = {"role": role, "content": blocks}
    texts = {id(b): _digest_text(b) for b, k in zip(blocks, known, strict=False) if k}
    assert _message_text(message, texts) == _digest_text(message)
    assert json.loads(_message_text(message, texts)) == message


def test_a_message_of_another_shape_is_serialised_whole() -> None:
    message = {"role": "user", "content": "plain text", "extra": 1}
    assert _message_text(message, {}) == _digest_text(message)


def test_a_window_without_a_weight_per_exchange_is_rendered_but_not_kept() -> None:
    """A hand-made window whose sizes do not match its exchanges: rendered as it is."""
    render = Counting()
    memo = ExchangeMemo(render)
    a, b = _exchange(1), _exchange(2)
    window = HistoryWindow("key", None, (a, b), (ExchangeSize(2, 100),))
    assert memo.rendered(window, "native") == [["native", "c1"], ["native", "c2"]]
    assert len(memo) == 0

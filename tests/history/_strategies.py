"""Hypothesis strategies the history tests share."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

__all__ = ["json_values"]


def json_values(
    *,
    text: st.SearchStrategy[str] | None = None,
    keys: st.SearchStrategy[str] | None = None,
    integers: st.SearchStrategy[int] | None = None,
    items: int = 4,
    leaves: int = 8,
) -> st.SearchStrategy[Any]:
    """JSON data: None, bools, ``integers`` (any int by default), finite floats and
    ``text`` (any str), in lists and dicts (``keys``, default ``text``) of at most
    ``items`` items, ``leaves`` scalars in all."""
    text = st.text() if text is None else text
    scalars = (
        st.none()
        | st.booleans()
        | (st.integers() if integers is None else integers)
        | st.floats(allow_nan=False, allow_infinity=False)
        | text
    )
    keys = text if keys is None else keys
    return st.recursive(
        scalars,
        lambda inner: (
            st.lists(inner, max_size=items) | st.dictionaries(keys, inner, max_size=items)
        ),
        max_leaves=leaves,
    )

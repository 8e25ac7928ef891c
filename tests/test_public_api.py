"""The public surface: what SPEC.md names is importable, and `__all__` is sorted."""

import importlib

import pytest

PACKAGES = ["touba", "touba.errors", "touba.history"]


@pytest.mark.parametrize("name", PACKAGES)
def test_all_is_sorted_and_importable(name: str) -> None:
    module = importlib.import_module(name)
    exported = list(module.__all__)
    assert exported == sorted(exported)
    for symbol in exported:
        assert hasattr(module, symbol), f"{name}.{symbol} is in __all__ but missing"


def test_history_surface_names_of_spec() -> None:
    from touba import history

    for symbol in (
        "HistoryConfig",
        "HistoryEvent",
        "HistoryStore",
        "MemoryHistoryStore",
        "conversation_key",
        "SummaryRequest",
    ):
        assert symbol in history.__all__
    import touba

    assert touba.HistoryConfig is history.HistoryConfig
    assert touba.HistoryEvent is history.HistoryEvent

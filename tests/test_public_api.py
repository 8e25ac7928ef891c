"""The public surface: what SPEC.md names is importable, and `__all__` is sorted."""

import importlib
import subprocess
import sys

import pytest

PACKAGES = [
    "touba",
    "touba.errors",
    "touba.history",
    "touba.providers",
    "touba.memory",
    "touba.runtime",
    "touba.testing",
]


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


def test_importing_touba_loads_no_provider_sdk() -> None:
    """Each SDK is an optional extra, imported only when its provider is created."""
    code = (
        "import sys, touba, touba.providers, touba.history, touba.runtime, touba.memory;"
        "loaded = [m for m in ('openai', 'anthropic', 'google.genai', 'psycopg', 'redis')"
        " if m in sys.modules];"
        "assert not loaded, loaded"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_spec_provider_factories_are_exported() -> None:
    from touba import providers

    for name in (
        "create_openai_decision_provider",
        "create_anthropic_decision_provider",
        "create_gemini_decision_provider",
        "create_openai_compatible_decision_provider",
        "create_function_decision_provider",
        "DecisionRequest",
        "Decision",
        "CapabilitySpec",
        "Observation",
        "CapabilityCall",
    ):
        assert name in providers.__all__


def test_runtime_postgres_stores_are_exported_lazily() -> None:
    from touba import runtime
    from touba.runtime._checkpoint_postgres import PostgresCheckpointStore
    from touba.runtime._resource_postgres import PostgresResourceBinding

    assert runtime.PostgresCheckpointStore is PostgresCheckpointStore
    assert runtime.PostgresResourceBinding is PostgresResourceBinding
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        runtime.Nope  # noqa: B018

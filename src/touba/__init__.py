"""touba: bounded, persistent and safe memory for LLM agents."""

from touba.errors import ToubaError
from touba.history import HistoryConfig, HistoryEvent

__version__ = "0.1.0"

__all__ = [
    "HistoryConfig",
    "HistoryEvent",
    "ToubaError",
    "__version__",
]

"""touba: bounded, persistent and safe memory for LLM agents."""

from touba._encryption import Encryption
from touba.data import erase_user, verify_erased
from touba.errors import ToubaError
from touba.history import HistoryConfig, HistoryEvent
from touba.memory import ChatSession, KeyEventsConfig, MemoryConfig
from touba.providers import (
    ContextConfig,
    create_anthropic_decision_provider,
    create_function_decision_provider,
    create_gemini_decision_provider,
    create_openai_compatible_decision_provider,
    create_openai_decision_provider,
)
from touba.runtime import (
    ApprovalRequired,
    DecisionCompleted,
    InvocationFinished,
    InvocationResult,
    Program,
    Runtime,
    TextDelta,
    ToolCallFinished,
    ToolCallStarted,
)

__version__ = "0.1.0"

__all__ = [
    "ApprovalRequired",
    "ChatSession",
    "ContextConfig",
    "DecisionCompleted",
    "Encryption",
    "HistoryConfig",
    "HistoryEvent",
    "InvocationFinished",
    "InvocationResult",
    "KeyEventsConfig",
    "MemoryConfig",
    "Program",
    "Runtime",
    "TextDelta",
    "ToolCallFinished",
    "ToolCallStarted",
    "ToubaError",
    "__version__",
    "create_anthropic_decision_provider",
    "create_function_decision_provider",
    "create_gemini_decision_provider",
    "create_openai_compatible_decision_provider",
    "create_openai_decision_provider",
    "erase_user",
    "verify_erased",
]

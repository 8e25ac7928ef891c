"""Decision history: bounded, trimmed by complete exchanges, stored safely.

The SQLite, PostgreSQL and Redis stores live in ``touba.history.sqlite``,
``touba.history.postgres`` and ``touba.history.redis``.
"""

from touba.history._config import HistoryConfig, HistoryEvent, SummaryRequest
from touba.history._engine import DecisionHistory, HistoryWindow
from touba.history._identity import ConversationIdentity, conversation_key
from touba.history._memory import MemoryHistoryStore
from touba.history._model import (
    CapabilityCall,
    DataMessage,
    DecisionMessage,
    Message,
    Observation,
    ResultMessage,
    SummaryMessage,
    message_bytes,
)
from touba.history._repair import (
    RawConversation,
    RawRow,
    RecordProblem,
    RepairPlan,
    check_record,
    plan_repair,
    raw_of_record,
)
from touba.history._store import HistoryStore, StoredConversation, StoreUsage
from touba.history._window import ExchangeSize, select_window

__all__ = [
    "CapabilityCall",
    "ConversationIdentity",
    "DataMessage",
    "DecisionHistory",
    "DecisionMessage",
    "ExchangeSize",
    "HistoryConfig",
    "HistoryEvent",
    "HistoryStore",
    "HistoryWindow",
    "MemoryHistoryStore",
    "Message",
    "Observation",
    "RawConversation",
    "RawRow",
    "RecordProblem",
    "RepairPlan",
    "ResultMessage",
    "StoreUsage",
    "StoredConversation",
    "SummaryMessage",
    "SummaryRequest",
    "check_record",
    "conversation_key",
    "message_bytes",
    "plan_repair",
    "raw_of_record",
    "select_window",
]

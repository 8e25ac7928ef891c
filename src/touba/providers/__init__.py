"""Decision providers: turn a DecisionRequest into a typed Decision (SPEC section 2).

The vendor factories import their SDK only when called; a missing SDK raises
an ImportError naming the extra to install.
"""

from touba.providers._base import DecisionProvider
from touba.providers._guard import ContextConfig
from touba.providers._stream import (
    DecisionDelta,
    DeltaSink,
    StreamedCall,
    StreamedDecision,
    StreamedText,
)
from touba.providers._types import (
    CapabilityCall,
    CapabilitySpec,
    Decision,
    DecisionRequest,
    Observation,
    TraceCall,
    Turn,
    Usage,
)
from touba.providers.anthropic import create_anthropic_decision_provider
from touba.providers.compatible import create_openai_compatible_decision_provider
from touba.providers.function import create_function_decision_provider
from touba.providers.gemini import create_gemini_decision_provider
from touba.providers.openai import create_openai_decision_provider
from touba.providers.summarizer import ModelSummarizer, SummaryUsage

__all__ = [
    "CapabilityCall",
    "CapabilitySpec",
    "ContextConfig",
    "Decision",
    "DecisionDelta",
    "DecisionProvider",
    "DecisionRequest",
    "DeltaSink",
    "ModelSummarizer",
    "Observation",
    "StreamedCall",
    "StreamedDecision",
    "StreamedText",
    "SummaryUsage",
    "TraceCall",
    "Turn",
    "Usage",
    "create_anthropic_decision_provider",
    "create_function_decision_provider",
    "create_gemini_decision_provider",
    "create_openai_compatible_decision_provider",
    "create_openai_decision_provider",
]

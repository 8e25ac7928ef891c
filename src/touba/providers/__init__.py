"""Decision providers: turn a DecisionRequest into a typed Decision (SPEC section 2).

The vendor factories import their SDK only when called; a missing SDK raises
an ImportError naming the extra to install.
"""

from touba.providers._base import DecisionProvider
from touba.providers._guard import ContextConfig
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
from touba.providers.function import create_function_decision_provider

__all__ = [
    "CapabilityCall",
    "CapabilitySpec",
    "ContextConfig",
    "Decision",
    "DecisionProvider",
    "DecisionRequest",
    "Observation",
    "TraceCall",
    "Turn",
    "Usage",
    "create_function_decision_provider",
]

"""An ADK session service on touba's stores (issue 28: being built)."""

from __future__ import annotations

from google.adk.sessions import BaseSessionService

__all__ = ["ToubaSessionService"]


class ToubaSessionService(BaseSessionService):
    """An ADK session service on touba's stores (being built)."""

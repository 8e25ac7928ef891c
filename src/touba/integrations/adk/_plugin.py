"""An ADK plugin that trims each model request to touba's window (issue 28: being built)."""

from __future__ import annotations

from google.adk.plugins import BasePlugin

__all__ = ["ToubaContextPlugin"]


class ToubaContextPlugin(BasePlugin):
    """Trims each model request to touba's window (being built)."""

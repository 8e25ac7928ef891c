"""A LangGraph checkpointer on touba's stores (issue 28: being built)."""

from __future__ import annotations

from langgraph.checkpoint.base import BaseCheckpointSaver

__all__ = ["ToubaSaver"]


class ToubaSaver(BaseCheckpointSaver[str]):
    """A LangGraph checkpointer on touba's stores (being built)."""

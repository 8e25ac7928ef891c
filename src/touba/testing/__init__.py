"""Test doubles and contract suites for people testing their own agents with touba.

- :class:`ScriptedProvider`: a scripted model that records what it was sent.
- ``touba.testing.fakes``: loopback servers speaking the OpenAI, Anthropic and
  Gemini wire formats, rejecting what the real APIs reject.
- ``touba.testing.store_conformance``: the contract suite for HistoryStore adapters.
"""

from touba.testing._scripted import ScriptedProvider, ScriptStep

__all__ = ["ScriptStep", "ScriptedProvider"]

"""touba's memory inside the agent frameworks people already use.

Each module imports its framework and needs that framework's extra:

- :mod:`touba.integrations.openai_agents`: ``ToubaSession``, an OpenAI Agents SDK
  session on touba's stores (``pip install "touba[openai-agents]"``);
- :mod:`touba.integrations.pydantic_ai`: the ``touba_history`` history processor and
  durable conversations for pydantic-ai (``pip install "touba[pydantic-ai]"``);
- :mod:`touba.integrations.langgraph`: a trimmer for LangChain message lists and
  LangGraph's ``pre_model_hook`` (``pip install "touba[langgraph]"``).

All of them cut by complete exchanges, the way touba's own window does: a tool call
and its result are never separated. See docs/integrations.md.
"""

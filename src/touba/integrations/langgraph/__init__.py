"""touba inside LangGraph: the window that trims what a model sees, and a checkpointer.

```python
from langchain.agents import create_agent
from touba.integrations.langgraph import ToubaSaver, ToubaWindowMiddleware

agent = create_agent(
    model, tools, middleware=[ToubaWindowMiddleware(max_messages=40)], checkpointer=saver
)
```

- :class:`ToubaWindowMiddleware`, :func:`touba_pre_model_hook`, :func:`trim_messages`
  and :func:`touba_trimmer` cut a LangChain message list by complete exchanges
  (see :mod:`touba.integrations.langgraph._window` for the rules);
- :class:`ToubaSaver` is a LangGraph checkpointer on touba's stores (RAM, SQLite,
  PostgreSQL, Redis) where the ``messages`` channel is an append-only log.

Both need ``pip install "touba[langgraph]"``.
"""

from __future__ import annotations

from touba.integrations.langgraph._saver import ToubaSaver
from touba.integrations.langgraph._window import (
    ToubaWindowMiddleware,
    touba_pre_model_hook,
    touba_trimmer,
    trim_messages,
)

__all__ = [
    "ToubaSaver",
    "ToubaWindowMiddleware",
    "touba_pre_model_hook",
    "touba_trimmer",
    "trim_messages",
]

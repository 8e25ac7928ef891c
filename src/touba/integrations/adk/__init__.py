"""touba's memory under Google ADK: a session service and a context plugin.

```python
from google.adk.apps import App
from google.adk.runners import Runner
from touba.integrations.adk import ToubaContextPlugin, ToubaSessionService

runner = Runner(
    app=App(name="support", root_agent=agent, plugins=[ToubaContextPlugin(max_messages=40)]),
    session_service=ToubaSessionService.sqlite(".touba/adk.sqlite"),
)
```

- :class:`ToubaSessionService` is an ADK ``BaseSessionService`` on touba's stores
  (RAM, SQLite, PostgreSQL, Redis) where a session's events are an append-only log;
- :class:`ToubaContextPlugin` trims each model request to touba's window, by whole
  exchanges.

Both need ``pip install "touba[adk]"``.
"""

from __future__ import annotations

from touba.integrations.adk._plugin import ToubaContextPlugin
from touba.integrations.adk._service import ToubaSessionService

__all__ = ["ToubaContextPlugin", "ToubaSessionService"]

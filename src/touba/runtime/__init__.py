"""The agent runtime: capabilities, checks, approvals, delegation, traces (SPEC section 7).

```
program = touba.Program()

@program.capability(permissions=("orders:read",))
async def lookup_order(order_id: str) -> dict: ...

program.agent("support", provider=..., capabilities=("lookup_order",),
              grants=("orders:read",))
runtime = touba.Runtime(program)
result = await runtime.invoke("support", input="Where is order A1?")
```

Flows (``kind="flow"``, :mod:`touba.runtime._flow`): declared steps run in
order instead of a free tool loop; capability steps go through the same
checks as a model's calls, model steps ask for an output with the earlier
steps' results as data, and steps refer to each other explicitly:

```
program.agent("triage", provider=..., kind="flow", grants=("orders:read",),
              steps=(Step.call("lookup_order", {"order_id": "$input.order_id"}),
                     Step.model("reply", instructions="Answer the customer.")))
```

Business resources (:mod:`touba.runtime._resources`): data shared under
declared scopes (run, session, user, agent), stored by a host binding,
read and written by capabilities through an injected :class:`Resources`
handle, every operation checked against the capability's declared
permissions and the agent's grants; scope keys come from the trusted
invocation identity, never from the model:

```
program.resource("order_notes", scopes=("user",), read=("notes:read",),
                 write=("notes:write",))

@program.capability(permissions=("notes:read",))
async def read_note(order_id: str, resources: Resources) -> str | None:
    return await resources["order_notes"].get(order_id)

runtime = touba.Runtime(program, resources=SqliteResourceBinding(filename=...))
```

Durable stores: :class:`SqliteCheckpointStore` and :class:`SqliteResourceBinding`
(a private SQLite file), :class:`PostgresCheckpointStore` and
:class:`PostgresResourceBinding` (a PostgreSQL table many workers share;
imported on first use, so psycopg stays optional: ``pip install "touba[postgres]"``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from touba.runtime._capability import CapabilityDefinition
from touba.runtime._checkpoints import (
    CheckpointInfo,
    CheckpointStore,
    MemoryCheckpointStore,
    SqliteCheckpointStore,
)
from touba.runtime._context import InvocationContext, InvocationTool, ToolCall
from touba.runtime._flow import CallStep, ModelStep, Step
from touba.runtime._program import AgentDefinition, Program
from touba.runtime._resource_sqlite import SqliteResourceBinding
from touba.runtime._resources import (
    MemoryResourceBinding,
    ResourceAddress,
    ResourceBinding,
    ResourceDefinition,
    ResourceHandle,
    ResourceItem,
    Resources,
    ResourceScope,
)
from touba.runtime._results import InvocationResult
from touba.runtime._runtime import Runtime
from touba.runtime._stream import (
    ApprovalRequired,
    DecisionCompleted,
    InvocationFinished,
    InvocationStream,
    StreamEvent,
    TextDelta,
    ToolCallFinished,
    ToolCallStarted,
)
from touba.runtime._trace import Trace, TraceEntry

if TYPE_CHECKING:
    from touba.runtime._checkpoint_postgres import PostgresCheckpointStore
    from touba.runtime._resource_postgres import PostgresResourceBinding

__all__ = [
    "AgentDefinition",
    "ApprovalRequired",
    "CallStep",
    "CapabilityDefinition",
    "CheckpointInfo",
    "CheckpointStore",
    "DecisionCompleted",
    "InvocationContext",
    "InvocationFinished",
    "InvocationResult",
    "InvocationStream",
    "InvocationTool",
    "MemoryCheckpointStore",
    "MemoryResourceBinding",
    "ModelStep",
    "PostgresCheckpointStore",
    "PostgresResourceBinding",
    "Program",
    "ResourceAddress",
    "ResourceBinding",
    "ResourceDefinition",
    "ResourceHandle",
    "ResourceItem",
    "ResourceScope",
    "Resources",
    "Runtime",
    "SqliteCheckpointStore",
    "SqliteResourceBinding",
    "Step",
    "StreamEvent",
    "TextDelta",
    "ToolCall",
    "ToolCallFinished",
    "ToolCallStarted",
    "Trace",
    "TraceEntry",
]


def __getattr__(name: str) -> Any:
    if name == "PostgresCheckpointStore":
        from touba.runtime._checkpoint_postgres import PostgresCheckpointStore

        return PostgresCheckpointStore
    if name == "PostgresResourceBinding":
        from touba.runtime._resource_postgres import PostgresResourceBinding

        return PostgresResourceBinding
    raise AttributeError(f"module 'touba.runtime' has no attribute {name!r}")

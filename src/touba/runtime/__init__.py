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
"""

from touba.runtime._checkpoints import (
    CheckpointStore,
    MemoryCheckpointStore,
    SqliteCheckpointStore,
)
from touba.runtime._context import InvocationContext, InvocationTool, ToolCall
from touba.runtime._program import AgentDefinition, CapabilityDefinition, Program
from touba.runtime._results import InvocationResult
from touba.runtime._runtime import Runtime
from touba.runtime._trace import Trace, TraceEntry

__all__ = [
    "AgentDefinition",
    "CapabilityDefinition",
    "CheckpointStore",
    "InvocationContext",
    "InvocationResult",
    "InvocationTool",
    "MemoryCheckpointStore",
    "Program",
    "Runtime",
    "SqliteCheckpointStore",
    "ToolCall",
    "Trace",
    "TraceEntry",
]

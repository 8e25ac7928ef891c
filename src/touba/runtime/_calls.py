"""Running one accepted capability call and turning what happened into an observation.

Async functions are awaited; sync ones run in a worker thread
(``asyncio.to_thread``). The result is converted to JSON data
(``pydantic_core.to_jsonable_python``: models, dataclasses, enums, dates);
what still is not JSON data (NaN, ±Infinity, nesting deeper than
``MAX_JSON_DEPTH``) becomes an ``error`` observation naming where it is.
An exception becomes an ``error`` observation whose text is the exception's
type name and its message, cut at :data:`ERROR_TEXT_LIMIT` characters: the
model and the trace see it, so a capability must not put secrets in the
messages of the exceptions it raises.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic_core import PydanticSerializationError, to_jsonable_python

from touba.history._model import CapabilityCall, Observation, json_problem
from touba.runtime._checks import Accepted

__all__ = ["ERROR_TEXT_LIMIT", "error_text", "observe_call", "run_capability"]

ERROR_TEXT_LIMIT = 500
"""Characters of a capability's exception message kept in its ``error`` observation."""


def error_text(error: BaseException) -> str:
    message = str(error)
    if len(message) > ERROR_TEXT_LIMIT:
        message = message[:ERROR_TEXT_LIMIT] + "..."
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


async def run_capability(call: CapabilityCall, accepted: Accepted) -> Observation:
    """Run the capability; never raises for what the capability does (only cancellation)."""
    function = accepted.capability.function
    assert function is not None, "delegations and tools are run by the invocation"
    kwargs = accepted.kwargs
    if accepted.capability.is_async:
        return await observe_call(call, lambda: function(**kwargs))
    return await observe_call(call, lambda: asyncio.to_thread(function, **kwargs))


async def observe_call(call: CapabilityCall, run: Callable[[], Awaitable[Any]]) -> Observation:
    """The observation of ``call`` from what ``run()`` returns (JSON data) or raises."""
    arguments = dict(call.arguments)
    try:
        value = await run()
    except Exception as e:
        return Observation(call.call_id, call.name, arguments, "error", error=error_text(e))
    try:
        result = to_jsonable_python(value)
    except (PydanticSerializationError, TypeError, ValueError, RecursionError):
        message = f"the capability returned a {type(value).__name__}, which is not JSON data"
        return Observation(call.call_id, call.name, arguments, "error", error=message)
    problem = json_problem(result, "result")  # NaN, ±Infinity, too deep, lone surrogates
    if problem is not None:
        message = f"the capability returned data that is not JSON: {problem}"
        return Observation(call.call_id, call.name, arguments, "error", error=message)
    return Observation(call.call_id, call.name, arguments, "ok", result=result)

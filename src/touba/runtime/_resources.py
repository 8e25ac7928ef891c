"""Business memory resources: data shared under declared scopes (seed 000).

Seed 000 keeps three states apart: the runtime's observations, the
conversational history (provider messages, kept by the SDK) and the
*memory resource*, business data shared under declared scopes, owned by the
Touba program and stored by a host binding. History grants no permission;
a resource grants none by itself either:

```
program.resource("order_notes", scopes=("user", "session"),
                 read=("notes:read",), write=("notes:write",))

@program.capability(permissions=("notes:write",))
async def save_note(order_id: str, text: str, resources: Resources) -> str:
    await resources["order_notes"].put(order_id, {"text": text}, scope="user")
    return "saved"

runtime = Runtime(program, resources=SqliteResourceBinding(filename=".touba/resources.db"))
```

- **Access.** A capability reaches resources through one parameter annotated
  :class:`Resources`: the schema generator leaves it out (the model never
  sees or fills it) and the runtime injects a handle for that call only.
  Such a capability must be ``async``. Every operation is checked when it
  runs, never from what history says: the capability must *declare* the
  resource's ``read`` (``get``, ``keys``) or ``write`` (``put``, ``delete``)
  permissions and the running agent must be *granted* them (the call itself
  was already checked like any call: catalog, grants, budget, arguments).
- **Scopes and keys.** ``run`` (the invocation's ``run_id``), ``session`` and
  ``user`` (the trusted ``session_id`` and ``user_id`` the host puts in the
  :class:`~touba.runtime.InvocationContext`; a :class:`~touba.ChatSession`
  does it), ``agent`` (the running agent's name). Scope keys never come from
  the model's arguments. An invocation without a user id has no ``user``
  scope (no fallback to another key); one without a session id has no
  ``session`` scope. In a ChatSession the run id is the session id, so
  ``run`` and ``session`` name the same data there. A delegated
  sub-invocation keeps its parent's session and user, uses its own agent
  name and its own grants. A checkpoint keeps the session and user ids; a
  resume must give the same ones (or no context).
- **Refusals.** A refused operation raises :class:`~touba.errors.ResourceAccessDenied`
  (``reason`` says which rule) inside the capability, before anything is read
  or written; uncaught, the call ends in an ``error`` observation naming the
  rule (the capability did run, so it is not a ``denied`` check). Each
  operation adds a ``resource_access`` trace entry (resource, scope,
  operation, key, ``outcome`` ``"ok"`` or ``"denied"`` with its ``reason``);
  values never enter the trace.
- **Bounds.** Keys are 1 to 256 characters; a value is JSON data of at most
  ``max_value_bytes`` (64 KiB by default) as compact JSON; ``keys`` returns
  at most 1,000 keys per call, sorted.

Bindings implement :class:`ResourceBinding` (``get``, ``put``, ``delete``,
``keys`` by :class:`ResourceAddress` and key): :class:`MemoryResourceBinding`
(the runtime's default, this process only, unbounded in count) and
:class:`~touba.runtime.SqliteResourceBinding` (a private SQLite file) and
:class:`~touba.runtime.PostgresResourceBinding` (a PostgreSQL table many
workers share).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Final, Literal, Protocol, cast, get_args, runtime_checkable

from touba.errors import ConfigurationError, ResourceAccessDenied, ResourceAccessReason
from touba.history._model import JSON, canonical_json, json_problem

__all__ = [
    "ERASABLE_SCOPES",
    "MAX_KEY_CHARS",
    "MAX_KEYS",
    "MemoryResourceBinding",
    "ResourceAccess",
    "ResourceAddress",
    "ResourceBinding",
    "ResourceDefinition",
    "ResourceHandle",
    "ResourceItem",
    "ResourceScope",
    "Resources",
    "check_binding",
    "encode_value",
    "scope_keys_of",
]

ResourceScope = Literal["run", "session", "user", "agent"]
SCOPES: Final[tuple[ResourceScope, ...]] = get_args(ResourceScope)
MAX_KEY_CHARS: Final = 256
MAX_KEYS: Final = 1000
Operation = Literal["get", "put", "delete", "keys"]
_WRITES: Final = ("put", "delete")


@dataclass(frozen=True, slots=True)
class ResourceDefinition:
    """A resource of the program: its scopes and the permissions to read and write it."""

    name: str
    scopes: tuple[ResourceScope, ...]
    read: tuple[str, ...]
    write: tuple[str, ...]
    description: str = ""
    max_value_bytes: int = 65536


@dataclass(frozen=True, slots=True)
class ResourceAddress:
    """Where a binding keeps items: one resource, under one scope and its key."""

    resource: str
    scope: ResourceScope
    scope_key: str


@dataclass(frozen=True, slots=True)
class ResourceItem:
    """A stored value and when it was last written (timezone-aware)."""

    key: str
    value: JSON
    updated_at: datetime


@runtime_checkable
class ResourceBinding(Protocol):
    """The host's storage of resources. Values are JSON data; return detached copies.

    ``put`` and ``delete`` are each atomic: a reader sees the old value or
    the new one, never a mix, and of concurrent deleters of one key exactly
    one gets True. ``keys`` lists the keys under ``address`` that start with
    ``prefix`` (literally), sorted by code point, at most ``limit`` of them.
    """

    async def get(self, address: ResourceAddress, key: str) -> ResourceItem | None:
        """The item under ``key`` at ``address`` (a detached copy), or None."""
        ...

    async def put(self, address: ResourceAddress, key: str, value: JSON) -> ResourceItem:
        """Store ``value`` under ``key`` atomically, replacing any value; the item as stored."""
        ...

    async def delete(self, address: ResourceAddress, key: str) -> bool:
        """Remove ``key`` atomically; False when it was not there (one deleter gets True)."""
        ...

    async def keys(self, address: ResourceAddress, *, prefix: str, limit: int) -> list[str]:
        """The keys starting with ``prefix``, sorted by code point, at most ``limit``."""
        ...


def encode_value(value: JSON) -> str:
    """A resource value as the JSON text every binding keeps; ConfigurationError (naming
    the path of the bad value) when it is not JSON data, NaN and ±Infinity included."""
    problem = json_problem(value, "value")
    if problem is not None:
        raise ConfigurationError(
            f"a resource value must be JSON data ({problem}); nothing was written"
        )
    return canonical_json(value)


ERASABLE_SCOPES: tuple[ResourceScope, ...] = ("run", "session", "user")


def scope_keys_of(scope_keys: object) -> dict[str, frozenset[str]]:
    """``erase_scope_keys``' argument, checked: a mapping of scope (``run``, ``session``,
    ``user``) to a collection of scope keys; ``ConfigurationError`` otherwise."""
    if not isinstance(scope_keys, Mapping):
        raise ConfigurationError("scope_keys must map a scope to a collection of scope keys")
    out: dict[str, frozenset[str]] = {}
    for scope, keys in scope_keys.items():
        if scope not in ERASABLE_SCOPES:
            raise ConfigurationError(
                f"scope_keys names scope {scope!r}; only 'run', 'session' and 'user' are a "
                "user's (scope 'agent' is the agent's)"
            )
        if isinstance(keys, str | bytes) or not isinstance(keys, Collection):
            raise ConfigurationError("each scope's keys must be a collection of str, not one str")
        if not all(isinstance(k, str) for k in keys):
            raise ConfigurationError("scope keys must be str")
        out[scope] = frozenset(keys)
    return out


def check_binding(binding: object) -> ResourceBinding:
    if not all(callable(getattr(binding, m, None)) for m in ("get", "put", "delete", "keys")):
        raise ConfigurationError(
            "resources must be a resource binding (get, put, delete, keys), e.g. "
            "touba.runtime.MemoryResourceBinding() or SqliteResourceBinding(filename=...)"
        )
    return cast(ResourceBinding, binding)


class MemoryResourceBinding:
    """Resources in this process's memory, lost when it exits (tests, one process)."""

    def __init__(self) -> None:
        self._items: dict[ResourceAddress, dict[str, tuple[str, datetime]]] = {}

    async def get(self, address: ResourceAddress, key: str) -> ResourceItem | None:
        """The item under ``key`` (a detached copy), or None."""
        found = self._items.get(address, {}).get(key)
        if found is None:
            return None
        return ResourceItem(key, json.loads(found[0]), found[1])

    async def put(self, address: ResourceAddress, key: str, value: JSON) -> ResourceItem:
        """Store ``value`` under ``key``, replacing any value there; the item as stored."""
        text, at = encode_value(value), datetime.now(UTC)
        self._items.setdefault(address, {})[key] = (text, at)
        return ResourceItem(key, json.loads(text), at)

    async def delete(self, address: ResourceAddress, key: str) -> bool:
        """Remove ``key``; False when it was not there."""
        items = self._items.get(address)
        if items is None or key not in items:
            return False
        del items[key]
        if not items:
            del self._items[address]
        return True

    async def keys(self, address: ResourceAddress, *, prefix: str, limit: int) -> list[str]:
        """The keys starting with ``prefix``, sorted by code point, at most ``limit``."""
        found = sorted(k for k in self._items.get(address, {}) if k.startswith(prefix))
        return found[:limit]

    # -- erasing one user (touba.erase_user) ---------------------------------------------

    def _under(self, scope_keys: Mapping[str, Collection[str]]) -> list[ResourceAddress]:
        wanted = scope_keys_of(scope_keys)
        return [a for a in self._items if a.scope_key in wanted.get(a.scope, ())]

    async def count_scope_keys(self, scope_keys: Mapping[str, Collection[str]]) -> dict[str, int]:
        """How many values are kept under these scope keys, by scope (none left out)."""
        counts: dict[str, int] = {}
        for address in self._under(scope_keys):
            counts[address.scope] = counts.get(address.scope, 0) + len(self._items[address])
        return counts

    async def erase_scope_keys(self, scope_keys: Mapping[str, Collection[str]]) -> dict[str, int]:
        """Remove every value of every resource under these scope keys (``scope_keys``:
        scope ``run``, ``session`` or ``user`` to its keys); how many, by scope."""
        counts = await self.count_scope_keys(scope_keys)
        for address in self._under(scope_keys):  # no await since counting: atomic
            del self._items[address]
        return counts

    # -- export and import (touba.data) --------------------------------------------------

    async def scope_items(
        self, scope: str, scope_key: str, *, after: tuple[str, str] = ("", ""), limit: int = 100
    ) -> list[tuple[ResourceAddress, ResourceItem]]:
        """The items of every resource under ``scope`` / ``scope_key``, ordered by
        (resource, key), the first ``limit`` after ``after`` (a (resource, key) cursor)."""
        found = sorted(
            (address.resource, key, address, text, at)
            for address, items in self._items.items()
            if address.scope == scope and address.scope_key == scope_key
            for key, (text, at) in items.items()
            if (address.resource, key) > after
        )
        return [
            (address, ResourceItem(key, json.loads(text), at))
            for _, key, address, text, at in found[: max(limit, 0)]
        ]

    async def import_item(
        self, address: ResourceAddress, key: str, value: JSON, updated_at: datetime
    ) -> bool:
        """Store ``value`` under ``key`` with its ``updated_at`` (an export's) unless a
        value is there; False, changing nothing, when one is. ConfigurationError when
        ``value`` is not JSON data."""
        text = encode_value(value)
        items = self._items.setdefault(address, {})
        if key in items:
            return False
        items[key] = (text, updated_at)
        return True


Note = Callable[..., None]


@dataclass(frozen=True, slots=True)
class ResourceAccess:
    """What the runtime knows, for one call, to check and address each operation."""

    definitions: Mapping[str, ResourceDefinition]
    binding: ResourceBinding
    agent: str
    grants: frozenset[str]
    capability: str
    declared: frozenset[str]
    scope_keys: Mapping[ResourceScope, str | None]
    call_id: str
    note: Note


def _check_key(key: object, what: str = "key") -> str:
    if not isinstance(key, str) or not 1 <= len(key) <= MAX_KEY_CHARS:
        raise ConfigurationError(f"a resource {what} must be a str of 1 to {MAX_KEY_CHARS} chars")
    try:
        key.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ConfigurationError(f"a resource {what} must be valid Unicode text") from e
    return key


class ResourceHandle:
    """One resource, as seen by one capability call; every operation is checked."""

    def __init__(self, access: ResourceAccess, definition: ResourceDefinition) -> None:
        self._access = access
        self._definition = definition

    @property
    def name(self) -> str:
        """The resource's name, as the program defined it."""
        return self._definition.name

    @property
    def scopes(self) -> tuple[ResourceScope, ...]:
        """The scopes the resource is shared under; with several, each call names its ``scope``."""
        return self._definition.scopes

    async def get(self, key: str, default: JSON = None, *, scope: str | None = None) -> JSON:
        """The value under ``key``, or ``default`` when there is none."""
        item = await self.item(key, scope=scope)
        return default if item is None else item.value

    async def item(self, key: str, *, scope: str | None = None) -> ResourceItem | None:
        """The stored item under ``key`` (value and ``updated_at``), or None."""
        address = self._address("get", scope, _check_key(key))
        return await self._access.binding.get(address, key)

    async def put(self, key: str, value: JSON, *, scope: str | None = None) -> None:
        """Store ``value`` (JSON data) under ``key``, replacing any value there."""
        _check_key(key)
        size = len(encode_value(value).encode("utf-8"))
        limit = self._definition.max_value_bytes
        if size > limit:
            raise ConfigurationError(
                f"this value of resource {self.name!r} is {size} bytes as JSON, over its "
                f"max_value_bytes={limit}; store less"
            )
        address = self._address("put", scope, key)
        await self._access.binding.put(address, key, value)

    async def delete(self, key: str, *, scope: str | None = None) -> bool:
        """Remove ``key``; False when it was not there."""
        address = self._address("delete", scope, _check_key(key))
        return await self._access.binding.delete(address, key)

    async def keys(
        self, *, prefix: str = "", limit: int = 100, scope: str | None = None
    ) -> list[str]:
        """The keys starting with ``prefix``, sorted, at most ``limit`` (1 to 1,000)."""
        if not isinstance(prefix, str) or len(prefix) > MAX_KEY_CHARS:
            raise ConfigurationError(f"prefix must be a str of at most {MAX_KEY_CHARS} chars")
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_KEYS:
            raise ConfigurationError(f"limit must be an int from 1 to {MAX_KEYS}")
        address = self._address("keys", scope, None, prefix=prefix)
        return list(await self._access.binding.keys(address, prefix=prefix, limit=limit))

    def _scope(self, scope: str | None) -> str:
        scopes = self._definition.scopes
        if scope is None:
            if len(scopes) == 1:
                return scopes[0]
            raise ConfigurationError(
                f"resource {self.name!r} has scopes {scopes}; pass scope=... to say which"
            )
        if not isinstance(scope, str):
            raise ConfigurationError(f"scope must be one of {SCOPES}")
        return scope

    def _address(
        self, operation: Operation, scope: str | None, key: str | None, *, prefix: str = ""
    ) -> ResourceAddress:
        """Check the operation (scope, declared permissions, grants) and address it."""
        access, definition = self._access, self._definition
        requested = self._scope(scope)
        declared = next((s for s in definition.scopes if s == requested), None)
        scope_key = access.scope_keys.get(declared) if declared is not None else None
        needed = definition.write if operation in _WRITES else definition.read
        kind = "write" if operation in _WRITES else "read"
        undeclared = [p for p in needed if p not in access.declared]
        ungranted = [p for p in needed if p not in access.grants]
        denial: tuple[ResourceAccessReason, str] | None = None
        if declared is None:
            denial = (
                "scope_not_declared",
                f"resource {self.name!r} has no scope {requested!r}; its scopes are "
                f"{definition.scopes}",
            )
        elif undeclared:
            denial = (
                "permission_not_declared",
                f"capability {access.capability!r} does not declare {', '.join(undeclared)}, "
                f"needed to {kind} resource {self.name!r}; add it to the capability's "
                "permissions",
            )
        elif ungranted:
            denial = (
                "permission_not_granted",
                f"agent {access.agent!r} is not granted {', '.join(ungranted)}, needed to "
                f"{kind} resource {self.name!r}",
            )
        elif scope_key is None:
            denial = (
                "no_scope_key",
                f"this invocation has no trusted {declared} id, so resource {self.name!r} has "
                f"no {declared!r} scope here; the host gives it in InvocationContext",
            )
        entry: dict[str, JSON] = {
            "call_id": access.call_id,
            "name": access.capability,
            "resource": self.name,
            "scope": requested,
            "operation": operation,
        }
        if key is not None:
            entry["key"] = key
        else:
            entry["prefix"] = prefix
        if denial is not None:
            reason, message = denial
            access.note("resource_access", **entry, outcome="denied", reason=reason)
            raise ResourceAccessDenied(
                message, resource=self.name, operation=operation, reason=reason
            )
        access.note("resource_access", **entry, outcome="ok")
        assert declared is not None
        assert scope_key is not None
        return ResourceAddress(self.name, declared, scope_key)


class Resources:
    """The resources a capability call may use, injected by the runtime.

    Annotate one parameter of an ``async`` capability with this type;
    ``resources["name"]`` is that resource's :class:`ResourceHandle`.
    """

    def __init__(self, access: ResourceAccess) -> None:
        self._access = access

    def __getitem__(self, name: str) -> ResourceHandle:
        definition = self._access.definitions.get(name)
        if definition is None:
            raise ConfigurationError(
                f"unknown resource {name!r}; define it with program.resource({name!r}, ...)"
            )
        return ResourceHandle(self._access, definition)

    def __contains__(self, name: object) -> bool:
        return name in self._access.definitions

    @property
    def names(self) -> tuple[str, ...]:
        """The names of the program's resources (each one ``resources[name]`` gives)."""
        return tuple(self._access.definitions)

    def __repr__(self) -> str:
        return f"Resources({', '.join(self.names)})"

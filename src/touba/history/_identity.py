"""Conversation identity (SPEC section 1)."""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass

from touba.errors import ConfigurationError

__all__ = ["IDENTITY_FIELDS", "ConversationIdentity", "conversation_key"]

IDENTITY_FIELDS = (
    "namespace",
    "provider",
    "model",
    "decision_interface",
    "run_id",
    "invocation_id",
    "agent_ref",
)


@dataclass(frozen=True, slots=True)
class ConversationIdentity:
    """The seven fields that name one conversation."""

    namespace: str
    provider: str
    model: str
    decision_interface: str
    run_id: str
    invocation_id: str
    agent_ref: str

    def __post_init__(self) -> None:
        for name in IDENTITY_FIELDS:
            _check_field(name, getattr(self, name))
        for name in ("run_id", "invocation_id", "agent_ref"):
            if not getattr(self, name):
                raise ConfigurationError(
                    f"{name} is required when history is enabled: pass run_id, "
                    "invocation_id and agent_ref (the touba runtime passes them for you)"
                )

    @property
    def key(self) -> str:
        """The conversation's ``session_key``: :func:`conversation_key` of every field."""
        return _key(self.as_tuple())

    def as_tuple(self) -> tuple[str, str, str, str, str, str, str]:
        """The identity fields in ``IDENTITY_FIELDS`` order."""
        return (
            self.namespace,
            self.provider,
            self.model,
            self.decision_interface,
            self.run_id,
            self.invocation_id,
            self.agent_ref,
        )

    def as_dict(self) -> dict[str, str]:
        """The identity fields by name, as stores keep them beside a record."""
        return dict(zip(IDENTITY_FIELDS, self.as_tuple(), strict=True))


def _check_field(name: str, value: object) -> None:
    if not isinstance(value, str):
        raise ConfigurationError(
            f"conversation identity field {name!r} must be a str, got {type(value).__name__}"
        )
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:  # lone surrogates: a str, but not storable text
        raise ConfigurationError(
            f"conversation identity field {name!r} is not valid Unicode text ({e.reason}); "
            "pass text without lone surrogates"
        ) from e


def conversation_key(
    namespace: str,
    provider: str,
    model: str,
    decision_interface: str,
    run_id: str,
    invocation_id: str,
    agent_ref: str,
) -> str:
    """Return the deterministic ``session_key`` of a conversation.

    The key is ``"<namespace-hash>:<sha256>"``-shaped text that depends on every
    field, is safe for any characters in them (fields are JSON-encoded before
    hashing, so no separator can be forged) and never leaks the fields
    themselves. Its prefix groups the keys of one namespace.
    """
    fields = (namespace, provider, model, decision_interface, run_id, invocation_id, agent_ref)
    for name, value in zip(IDENTITY_FIELDS, fields, strict=True):
        _check_field(name, value)
    canonical = json.dumps(fields, ensure_ascii=False, separators=(",", ":"))
    digest = hashlib.sha256(canonical.encode("utf-8")).hexdigest()
    ns = hashlib.sha256(namespace.encode("utf-8")).hexdigest()[:12]
    return f"th1:{ns}:{digest}"


@functools.lru_cache(maxsize=4096)
def _key(fields: tuple[str, str, str, str, str, str, str]) -> str:
    """:func:`conversation_key` of an identity's fields (checked when it was made),
    computed once per identity: each decision asks for it."""
    return conversation_key(*fields)

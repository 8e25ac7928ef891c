"""What a fake server issued: signed opaque tokens and remembered item facts.

Real providers hand out opaque data (OpenAI ``encrypted_content``, Anthropic
thinking ``signature`` and ``redacted_thinking`` data, Gemini
``thoughtSignature``) and reject it when it comes back altered or was never
theirs. The fakes imitate that with an HMAC over the content each token
covers, keyed by a per-server secret.
"""

from __future__ import annotations

import hashlib
import hmac
import random
import secrets
import threading

__all__ = ["IssueLedger"]

_NONCE_BYTES = 12
_MAC_BYTES = 20


class IssueLedger:
    """Signs tokens and remembers facts (``remember``/``recall``) for one fake server.

    Thread-safe. ``sign(kind, payload)`` returns raw token bytes binding
    ``kind`` and ``payload``; ``verify`` accepts only tokens this ledger
    signed for exactly that kind and payload.
    """

    def __init__(self, secret: bytes | None = None, *, nonces: random.Random | None = None) -> None:
        self._secret = secret if secret is not None else secrets.token_bytes(32)
        self._lock = threading.Lock()
        self._facts: dict[tuple[str, str], str] = {}
        self._nonces = nonces  # deterministic tokens (a seeded fake server)

    def sign(self, kind: str, payload: str) -> bytes:
        """Return a fresh token covering ``payload`` under ``kind``."""
        if self._nonces is None:
            nonce = secrets.token_bytes(_NONCE_BYTES)
        else:
            with self._lock:
                nonce = self._nonces.randbytes(_NONCE_BYTES)
        return nonce + self._mac(kind, nonce, payload)

    def verify(self, kind: str, token: bytes, payload: str) -> bool:
        """Whether ``token`` was signed by this ledger for ``kind`` and ``payload``."""
        if len(token) != _NONCE_BYTES + _MAC_BYTES:
            return False
        nonce, mac = token[:_NONCE_BYTES], token[_NONCE_BYTES:]
        return hmac.compare_digest(mac, self._mac(kind, nonce, payload))

    def remember(self, kind: str, key: str, value: str = "") -> None:
        """Record a fact, e.g. ``remember("stored", item_id)``."""
        with self._lock:
            self._facts[(kind, key)] = value

    def recall(self, kind: str, key: str) -> str | None:
        """The value remembered for ``(kind, key)``, or None."""
        with self._lock:
            return self._facts.get((kind, key))

    def _mac(self, kind: str, nonce: bytes, payload: str) -> bytes:
        message = kind.encode() + b"\x00" + nonce + b"\x00" + payload.encode()
        return hmac.new(self._secret, message, hashlib.sha256).digest()[:_MAC_BYTES]

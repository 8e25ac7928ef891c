"""Encryption at rest: rows sealed with AES-GCM, bound to where they are stored.

``Encryption(keys={"k1": key}, current="k1")`` (a 16-, 24- or 32-byte key; 32 for
AES-256) or ``Encryption(keys=lookup, current="k1")`` with ``lookup(key_id)``
returning the key or None (a key provider: a KMS, a secrets manager). A store given
``encryption=`` seals each row it writes with the current key and opens each row it
reads with the key its token names, so keys rotate without a stop: rows sealed with
an older key stay readable while that key is given, until re-sealed.

A sealed value is text (it fits the stores' TEXT and string columns)::

    tbe1.<key id>.<base64url of nonce (12 bytes) + ciphertext + tag (16 bytes)>

The associated data (``context``) binds a row to its store, its key and its position:
a row copied to another conversation, another position or another store does not
open. Opening fails closed: a value that is not a token (plaintext in an encrypted
store), a token of an unknown key, a truncated or altered token all raise
:class:`~touba.errors.DecisionHistoryRecordInvalid`, whose message names the key id
at most, never a key, a plaintext or a ciphertext.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import re
from collections.abc import Callable, Mapping
from typing import Final

from touba.errors import ConfigurationError, DecisionHistoryRecordInvalid

__all__ = ["Encryption", "KeyProvider", "TOKEN_PREFIX"]

TOKEN_PREFIX: Final = "tbe1."  # noqa: S105 - a format marker, not a secret
KeyProvider = Callable[[str], bytes | None]
_KEY_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
_NONCE_BYTES: Final = 12
_TAG_BYTES: Final = 16
_KEY_SIZES: Final = (16, 24, 32)


def _aesgcm() -> tuple[type, type[Exception]]:
    try:
        from cryptography.exceptions import InvalidTag
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    except ImportError as e:  # pragma: no cover - the extra is part of `all`
        raise ConfigurationError(
            'encryption at rest needs the cryptography package: pip install "touba[crypto]"'
        ) from e
    return AESGCM, InvalidTag


class Encryption:
    """Keys to seal and open stored rows with AES-GCM (``touba[crypto]``).

    ``keys``: a mapping of key id to key bytes, or a callable that returns the key
    of a key id (None when it has none). ``current``: the key id new rows are
    sealed with. Key ids are 1 to 64 characters of ``A-Z a-z 0-9 _ -``.
    """

    def __init__(self, keys: Mapping[str, bytes] | KeyProvider, current: str) -> None:
        if not isinstance(current, str) or not _KEY_ID.fullmatch(current):
            raise ConfigurationError(
                "Encryption(current=...) must be a key id of 1 to 64 characters "
                "among A-Z a-z 0-9 _ -"
            )
        self._aesgcm, self._invalid_tag = _aesgcm()
        self._ciphers: dict[str, object] = {}
        if callable(keys):
            self._lookup: KeyProvider = keys
        else:
            given = dict(keys)
            for key_id, key in given.items():
                self._check(key_id, key)
            self._lookup = given.get
        self._current = current
        self._cipher(current, refuse=ConfigurationError)

    def __repr__(self) -> str:
        return f"Encryption(current={self._current!r})"

    @property
    def current(self) -> str:
        """The key id new rows are sealed with."""
        return self._current

    @staticmethod
    def context(*parts: str | int) -> bytes:
        """The associated data naming one row's place: its store, its key, its position."""
        return json.dumps(list(parts), separators=(",", ":"), ensure_ascii=True).encode()

    @staticmethod
    def is_sealed(value: object) -> bool:
        """Whether ``value`` has the form of a sealed token (not whether it opens)."""
        return isinstance(value, str) and value.startswith(TOKEN_PREFIX)

    @staticmethod
    def key_id_of(token: str) -> str:
        """The key id a token was sealed with (its rotation state); the token is not opened."""
        return _parse(token)[0]

    def seal(self, plaintext: bytes, *, context: bytes) -> str:
        """``plaintext`` sealed with the current key, bound to ``context``."""
        cipher = self._cipher(self._current, refuse=ConfigurationError)
        nonce = os.urandom(_NONCE_BYTES)
        sealed = cipher.encrypt(nonce, plaintext, context)  # type: ignore[attr-defined]
        body = base64.urlsafe_b64encode(nonce + sealed).decode("ascii")
        return f"{TOKEN_PREFIX}{self._current}.{body}"

    def open(self, token: object, *, context: bytes) -> bytes:
        """The plaintext of ``token`` if it was sealed for ``context`` with a known key.

        Raises :class:`~touba.errors.DecisionHistoryRecordInvalid` otherwise.
        """
        key_id, raw = _parse(token)
        cipher = self._cipher(key_id, refuse=DecisionHistoryRecordInvalid)
        try:
            opened: bytes = cipher.decrypt(  # type: ignore[attr-defined]
                raw[:_NONCE_BYTES], raw[_NONCE_BYTES:], context
            )
        except self._invalid_tag:
            raise DecisionHistoryRecordInvalid(
                f"an encrypted row does not open with key {key_id!r}: it was altered, "
                "truncated, or moved from another place"
            ) from None
        return opened

    def seal_text(self, text: str, *, context: bytes) -> str:
        """``seal`` of ``text`` encoded as UTF-8."""
        return self.seal(text.encode("utf-8"), context=context)

    def open_text(self, token: object, *, context: bytes) -> str:
        """``open`` decoded as UTF-8."""
        return self.open(token, context=context).decode("utf-8")

    def has_key(self, key_id: str) -> bool:
        """Whether a key of id ``key_id`` is given (the key provider asked, when there is
        one): a token of another key id cannot open here, whatever it holds."""
        try:
            self._cipher(key_id, refuse=LookupError)
        except LookupError:
            return False
        return True

    def needs_reseal(self, token: str) -> bool:
        """Whether ``token`` was sealed with a key other than the current one."""
        return _parse(token)[0] != self._current

    def _cipher(self, key_id: str, *, refuse: type[Exception]) -> object:
        cipher = self._ciphers.get(key_id)
        if cipher is None:
            key = self._lookup(key_id)
            if key is None:
                raise refuse(f"no key {key_id!r} among the encryption keys given")
            self._check(key_id, key)
            cipher = self._ciphers[key_id] = self._aesgcm(key)
        return cipher

    @staticmethod
    def _check(key_id: object, key: object) -> None:
        if not isinstance(key_id, str) or not _KEY_ID.fullmatch(key_id):
            raise ConfigurationError(
                "encryption key ids must be 1 to 64 characters among A-Z a-z 0-9 _ -"
            )
        if not isinstance(key, bytes) or len(key) not in _KEY_SIZES:
            raise ConfigurationError(
                f"encryption key {key_id!r} must be 16, 24 or 32 bytes (32 for AES-256)"
            )


def _parse(token: object) -> tuple[str, bytes]:
    if not isinstance(token, str) or not token.startswith(TOKEN_PREFIX):
        raise DecisionHistoryRecordInvalid(
            "a row of an encrypted store is not sealed (plaintext or another format); "
            "it is refused, never read as plaintext"
        )
    key_id, dot, body = token[len(TOKEN_PREFIX) :].partition(".")
    if not dot or not _KEY_ID.fullmatch(key_id):  # no dot: what stands there is no key id
        raise DecisionHistoryRecordInvalid("an encrypted row's key id is damaged")
    try:
        raw = base64.urlsafe_b64decode(body.encode("ascii"))
    except (binascii.Error, UnicodeEncodeError, ValueError):
        raise DecisionHistoryRecordInvalid(
            f"an encrypted row sealed with key {key_id!r} is damaged (not base64)"
        ) from None
    if len(raw) < _NONCE_BYTES + _TAG_BYTES:
        raise DecisionHistoryRecordInvalid(
            f"an encrypted row sealed with key {key_id!r} is truncated"
        )
    return key_id, raw

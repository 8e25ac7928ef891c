"""Where the real PostgreSQL and Redis servers of the tests are, if they are up.

``postgres_dsn()`` and ``redis_url()`` return the address from the environment
(``TOUBA_POSTGRES_DSN``, ``TOUBA_REDIS_URL``) or a loopback default, after a
short TCP probe. An unreachable server skips the test, except under
``CI=true`` where it fails it: CI must run against the real servers.
"""

from __future__ import annotations

import os
import re
import socket
from typing import NoReturn
from urllib.parse import urlsplit

import pytest

__all__ = ["in_ci", "postgres_address", "postgres_dsn", "redis_url", "unavailable"]

DEFAULT_POSTGRES_DSN = "postgresql://postgres@127.0.0.1:5432/test"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
PROBE_SECONDS = 0.5


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in {"true", "1"}


def unavailable(reason: str) -> NoReturn:
    """Skip the test, or fail it under ``CI=true``."""
    if in_ci():
        pytest.fail(f"{reason} (CI=true: the CI job must provide it)", pytrace=False)
    pytest.skip(reason)


def postgres_dsn() -> str:
    dsn = os.environ.get("TOUBA_POSTGRES_DSN", DEFAULT_POSTGRES_DSN)
    _probe("PostgreSQL", "TOUBA_POSTGRES_DSN", dsn, postgres_address(dsn))
    return dsn


def redis_url() -> str:
    url = os.environ.get("TOUBA_REDIS_URL", DEFAULT_REDIS_URL)
    parts = urlsplit(url)
    _probe("Redis", "TOUBA_REDIS_URL", url, (parts.hostname or "127.0.0.1", parts.port or 6379))
    return url


def postgres_address(dsn: str) -> tuple[str, int]:
    """The (host, port) a DSN names."""
    if "://" in dsn:
        parts = urlsplit(dsn)
        return parts.hostname or "127.0.0.1", parts.port or 5432
    fields = dict(item.split("=", 1) for item in dsn.split() if "=" in item)  # "host=... port=..."
    return fields.get("host", "127.0.0.1"), int(fields.get("port", "5432"))


def _probe(service: str, variable: str, address_text: str, address: tuple[str, int]) -> None:
    host, port = address
    if host.startswith("/"):  # a Unix socket directory (libpq style)
        path = os.path.join(host, f".s.PGSQL.{port}")
        if not os.path.exists(path):
            unavailable(f"{service} socket {path} not found (set {variable})")
        return
    try:
        with socket.create_connection((host, port), timeout=PROBE_SECONDS):
            pass
    except OSError as e:
        unavailable(
            f"{service} is not reachable at {host}:{port} ({e}); start it or set {variable} "
            f"(now {_redact(address_text)!r})"
        )


def _redact(url: str) -> str:
    """The address without its password, for messages."""
    if "://" not in url:
        return re.sub(r"password=\S+", "password=***", url)
    parts = urlsplit(url)
    if parts.password is None:
        return url
    return url.replace(f":{parts.password}@", ":***@", 1)

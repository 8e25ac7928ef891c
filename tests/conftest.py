"""Suite-wide guards: no test may reach beyond this machine; property tests have no deadline.

Also registers ``tests/_providers.py``: the fake provider servers and their clients.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings

# The fake provider servers and their SDK clients, as fixtures for every test.
pytest_plugins = ("tests._providers",)

# Property tests check behaviour, never speed: a loaded CI machine must not fail one
# on Hypothesis's per-example deadline.
settings.register_profile("touba", deadline=None)
settings.load_profile("touba")

_LOCAL_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost"}
_real_connect = socket.socket.connect
_real_connect_ex = socket.socket.connect_ex
_real_getaddrinfo = socket.getaddrinfo


class NetworkAccessDenied(RuntimeError):
    """Raised when a test tries to talk to anything but loopback."""


def _is_local(host: object) -> bool:
    if host is None:
        return True
    if isinstance(host, bytes):
        host = host.decode()
    if not isinstance(host, str):
        return False
    if host in _LOCAL_NAMES or host == "":
        return True
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False


def _check(address: Any) -> None:
    if isinstance(address, tuple) and address and not _is_local(address[0]):
        raise NetworkAccessDenied(f"tests may only connect to loopback, not {address[0]!r}")


def _guarded_connect(self: socket.socket, address: Any) -> None:
    if self.family in (socket.AF_INET, socket.AF_INET6):
        _check(address)
    _real_connect(self, address)


def _guarded_connect_ex(self: socket.socket, address: Any) -> int:
    if self.family in (socket.AF_INET, socket.AF_INET6):
        _check(address)
    return _real_connect_ex(self, address)


def _guarded_getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
    if not _is_local(host):
        raise NetworkAccessDenied(f"tests may not resolve {host!r}: no test reaches the internet")
    return _real_getaddrinfo(host, *args, **kwargs)


@pytest.fixture(autouse=True, scope="session")
def _no_internet() -> Iterator[None]:
    mp = pytest.MonkeyPatch()
    mp.setattr(socket.socket, "connect", _guarded_connect)
    mp.setattr(socket.socket, "connect_ex", _guarded_connect_ex)
    mp.setattr(socket, "getaddrinfo", _guarded_getaddrinfo)
    yield
    mp.undo()


@pytest.fixture
def private_dir(tmp_path: Path) -> Path:
    """A directory only its owner may enter (0o700), as the SQLite stores require of theirs."""
    directory = tmp_path / "private"
    directory.mkdir(mode=0o700)
    return directory

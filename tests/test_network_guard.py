import socket

import pytest

from tests.conftest import NetworkAccessDenied


def test_public_address_is_refused() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s, pytest.raises(NetworkAccessDenied):
        s.connect(("93.184.216.34", 80))


def test_name_resolution_of_public_host_is_refused() -> None:
    with pytest.raises(NetworkAccessDenied):
        socket.getaddrinfo("example.com", 443)


def test_loopback_is_allowed() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as client:
            client.connect(server.getsockname())

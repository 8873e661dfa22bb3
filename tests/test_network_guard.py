"""The suite's own guard: a test that reaches past loopback fails (conftest.no_network)."""
import socket
import threading

import pytest

from conftest import NetworkAccessError


def test_non_loopback_connect_is_refused_before_any_packet():
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        with pytest.raises(NetworkAccessError):
            s.connect(("192.0.2.1", 443))  # TEST-NET-1: documentation range, and blocked before connect()
        with pytest.raises(NetworkAccessError):
            s.connect_ex(("192.0.2.1", 443))
    finally:
        s.close()


def test_name_resolution_is_refused():
    with pytest.raises(NetworkAccessError):
        socket.getaddrinfo("huggingface.co", 443)
    with pytest.raises(NetworkAccessError):
        socket.create_connection(("huggingface.co", 443), timeout=1)


def test_loopback_still_works():
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    t = threading.Thread(target=lambda: server.accept()[0].close())
    t.start()
    with socket.create_connection(("127.0.0.1", port), timeout=5):
        pass
    t.join(5)
    server.close()

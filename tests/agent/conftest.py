import socket
import threading

import pytest

from tests.agent.fixture_repo import write_repo

API_KEY = "sk-test-7f3a9c1e5b2d4680-do-not-leak"


@pytest.fixture
def repo(tmp_path):
    return write_repo(tmp_path / "repo")


@pytest.fixture
def api_key(monkeypatch):
    monkeypatch.setenv("FLASHINFRA_AGENT_API_KEY", API_KEY)
    return API_KEY


@pytest.fixture
def listener():
    """A TCP listener on loopback in this (the parent's) network namespace; records accepted peers."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    sock.settimeout(0.2)
    accepted, stop = [], threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, peer = sock.accept()
            except OSError:
                continue
            accepted.append(peer)
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield sock.getsockname()[1], accepted
    stop.set()
    thread.join()
    sock.close()

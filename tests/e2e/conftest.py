"""Fixtures shared by the end-to-end tests."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest


@pytest.fixture
def hanging_endpoint(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """An HF_ENDPOINT whose TCP connect succeeds (listen backlog) but which never answers."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    monkeypatch.setenv("HF_ENDPOINT", url)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    try:
        yield url
    finally:
        sock.close()

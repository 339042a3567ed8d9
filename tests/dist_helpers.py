"""Shared by the tests that start gloo process groups."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for ``MASTER_PORT``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

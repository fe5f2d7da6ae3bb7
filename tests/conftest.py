"""Fixtures shared by the test modules."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from rollcage.policy import PolicyServer


@pytest.fixture
def serve_policy(request: pytest.FixtureRequest) -> Iterator[Callable[..., PolicyServer]]:
    """Start scripted policy servers on demand; every one is stopped at teardown, pass or fail.

    ``serve_policy(script, **options)`` takes a script (mapping, file or ``PolicyScript``);
    without one it plays the test module's ``SCRIPT``.
    """
    servers: list[PolicyServer] = []

    def start(script: Any = None, **options: Any) -> PolicyServer:
        server = PolicyServer(script if script is not None else request.module.SCRIPT, **options)
        servers.append(server)
        return server.start()

    try:
        yield start
    finally:
        for server in servers:
            server.stop()

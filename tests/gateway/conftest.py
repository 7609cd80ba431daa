"""Fixtures of the gateway tests (the pool itself: gateway_helpers.py)."""

from __future__ import annotations

import pytest

from gateway_helpers import ThreadedPool, make_pool, stop_pool


@pytest.fixture
async def pool(nats_server, tmp_path):
    """The pool on the test's own event loop (tests that drive NATS and the router directly)."""
    p = await make_pool(nats_server.url, tmp_path)
    yield p
    await stop_pool(p)


@pytest.fixture(scope="module")
def remote(tmp_path_factory):
    """One pool per test module on a background loop, reached over HTTP only."""
    tp = ThreadedPool(tmp_path_factory.mktemp("pool"))
    yield tp.pool
    tp.close()

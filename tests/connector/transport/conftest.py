import os

import pytest

from tests.connector.transport.helpers import KVTestbed

# UCX on loopback only, quiet NIXL (docs/facts.md §2); read when an agent is created.
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")


@pytest.fixture
def kv() -> KVTestbed:
    """This test's senders and receivers (a memory fabric of its own)."""
    return KVTestbed()

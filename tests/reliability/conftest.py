"""Fixtures of the reliability tests, from the suites they extend: the router rig (a real
router on a loopback socket in front of fake prefill/decode servers), the decode-server test
model directory and servers, and the KV transport testbed (in-memory fake or real NIXL on
loopback; importing its conftest also sets UCX to loopback)."""

from tests.connector.transport.conftest import kv  # noqa: F401  (fixtures)
from tests.decode_server.conftest import make_server, model_dir  # noqa: F401
from tests.router.conftest import make_rig  # noqa: F401

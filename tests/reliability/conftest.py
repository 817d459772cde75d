"""The reliability suite reuses the router rig (a real router on a loopback socket in
front of fake prefill/decode servers) and the decode-server tests' model directory."""

from tests.decode_server.conftest import model_dir  # noqa: F401  (fixtures)
from tests.router.conftest import make_rig  # noqa: F401

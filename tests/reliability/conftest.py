"""The reliability suite reuses the router rig (a real router on a loopback socket in
front of fake prefill/decode servers)."""

from tests.router.conftest import make_rig  # noqa: F401  (the fixture)

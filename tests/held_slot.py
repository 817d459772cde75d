"""A decode server's slot held by the test, as another router holds it (the lease protocol of
pd_wire.decode): while the block runs, routers see that slot taken."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx

from pd_wire.decode import LEASE_PATH, LEASE_RELEASE_PATH, LEASE_RENEW_PATH, LeaseGrant, LeaseIds, LeaseRequest


def _here(fn: Callable[[], Any]) -> Any:
    return fn()


@contextmanager
def held_slot(url: str, api_key: str | None = None, on: Callable[[Callable[[], Any]], Any] = _here,
              wait_s: float = 30.0) -> Iterator[LeaseGrant]:
    """A slot of the decode server at ``url`` leased (waiting up to ``wait_s`` for one), renewed
    at a third of its ttl until the block ends, then released. ``on``: where the calls run
    (e.g. ``Node.call``: from a node of tests/nodes.py)."""
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {api_key}"} if api_key else {})

    def post(path: str, body: LeaseRequest | LeaseIds) -> httpx.Response:
        return on(lambda: httpx.post(url + path, content=body.model_dump_json(), headers=headers,
                                     timeout=wait_s + 10))

    ids = LeaseIds(lease_ids=[f"test-holds-{uuid.uuid4().hex}"])
    resp = post(LEASE_PATH, LeaseRequest(lease_id=ids.lease_ids[0], wait_s=wait_s, holder="the test"))
    assert resp.status_code == 200, f"{url} granted no lease: {resp.status_code} {resp.text}"
    grant = LeaseGrant.model_validate_json(resp.content)
    done = threading.Event()

    def renew() -> None:
        while not done.wait(grant.ttl_s / 3):
            post(LEASE_RENEW_PATH, ids)

    renewer = threading.Thread(target=renew, name=f"lease-on-{url}", daemon=True)
    renewer.start()
    try:
        yield grant
    finally:
        done.set()
        renewer.join(15)
        post(LEASE_RELEASE_PATH, ids)

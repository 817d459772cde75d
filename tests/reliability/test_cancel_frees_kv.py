"""Finding 10 of issue 12: a router's cancel for a handoff whose KV had fully arrived but that
no generation claimed (the router gave up after prefill: client gone, decode busy) frees the
receive slot at once, not after the unclaimed-handoff reaper (30 s; on TileRT, with one slot,
30 s of refusals). Real decode-server app (fake engine), real KV receiver and sender over
loopback: the in-memory transport and real NIXL."""

from __future__ import annotations

import httpx
import pytest

from connector.kv_errors import AdmissionRefused
from pd_wire.decode import CANCEL_PATH
from tests.connector.transport.helpers import SMALL
from tests.connector.transport.synthetic import fill, layer_bytes

pytestmark = pytest.mark.timeout(90)


def _push(sender, endpoint: str, hid: str, tokens: int = 16) -> str:
    handoff = sender.begin(endpoint, hid, tokens, 5)
    for layer in range(SMALL.num_layers):
        fill(handoff.staging(layer), layer_bytes(SMALL, layer, tokens, 1))
        handoff.post_layer(layer)
    return handoff.wait(10)


@pytest.mark.parametrize("transport", ["memory", "nixl"])
def test_cancel_frees_a_completed_unclaimed_handoff_at_once(make_server, kv, transport):
    srv = make_server(slots=1, receiver_factory=lambda layout, slots, max_tokens: kv.receiver(
        layout, 64, transport, slots=slots, unclaimed_timeout_s=30.0))
    receiver = srv.receiver
    sender = kv.make_sender(transport=transport)
    try:
        assert _push(sender, receiver.endpoint, "r1-0") == "sent"
        assert receiver.busy_slots() == 1
        with pytest.raises(AdmissionRefused) as refused:  # the one slot is held
            sender.begin(receiver.endpoint, "r2-0", 16, 5)
        assert refused.value.reason == "busy"
        answer = httpx.post(srv.url + CANCEL_PATH, json={"request_id": "r1", "handoff_id": "r1-0"}, timeout=10)
        assert answer.json() == {"request_id": "r1", "cancelled": False}
        assert receiver.busy_slots() == 0, "the cancel left the completed handoff to the 30 s reaper"
        assert _push(sender, receiver.endpoint, "r2-1") == "sent"  # the next request gets the slot at once
        httpx.post(srv.url + CANCEL_PATH, json={"request_id": "r2", "handoff_id": "r2-1"}, timeout=10)
        assert receiver.busy_slots() == 0
    finally:
        sender.close()

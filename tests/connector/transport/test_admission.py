"""The scheduler side's admission client against a real KV receiver: admission in the
background, refusals, aborts, the sender group that writes an admitted slot, and a hung
decode server that delays only the requests bound to it."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest

from connector.admission import Admission, AdmissionClient
from connector.kv_errors import HandoffTimeout, TransferFailed
from connector.layout import layout_fingerprint
from pd_wire.handoff import HandoffResult
from tests.connector.transport.helpers import SMALL, assert_no_leaks
from tests.connector.transport.synthetic import fill, layer_bytes, mismatches
from tests.waits import eventually

pytestmark = pytest.mark.timeout(60)
GROUP = "prefill-group-a"


def _client(timeout_s: float = 5.0, group: str = GROUP) -> AdmissionClient:
    return AdmissionClient(agent_name=f"{group}-sched", group=group, fingerprint=layout_fingerprint(SMALL),
                           transport="memory", timeout_s=timeout_s)


async def _result(client: AdmissionClient, handoff_id: str, timeout: float = 10.0) -> Admission:
    await eventually(lambda: client.result(handoff_id) is not None, timeout)
    result = client.result(handoff_id)
    assert result is not None
    return result


async def _write_every_layer(sender, endpoint: str, admission: Admission, num_tokens: int, seed: int) -> None:
    """As the admitting group's worker does: open the admitted slot and WRITE every layer."""
    await asyncio.to_thread(sender.connect, endpoint, 5)
    handoff = sender.open(endpoint, admission.handoff_id, num_tokens, admission.offsets, time.monotonic() + 10)
    assert handoff is not None
    for layer in range(SMALL.num_layers):
        fill(handoff.staging(layer), layer_bytes(SMALL, layer, num_tokens, seed))
    handoff.post_layers(list(range(SMALL.num_layers)))


async def test_admitted_in_the_background_and_written_by_the_groups_worker(kv):
    async with kv.running_receiver(max_tokens=64) as receiver:
        client, sender = _client(), kv.make_sender(group=GROUP)
        try:
            waiter = asyncio.create_task(receiver.wait_for("h", 10))
            client.start("h", receiver.endpoint, 40)  # returns at once: the channel thread admits
            admission = await _result(client, "h")
            assert admission.ok and admission.slot == 0 and len(admission.offsets) == SMALL.num_layers
            assert receiver.busy_slots() == 1
            await _write_every_layer(sender, receiver.endpoint, admission, 40, seed=3)
            kv = await waiter
            assert mismatches(kv.layers, SMALL, 40, 3) == []
            receiver.release("h")
            assert_no_leaks(receiver, sender)
        finally:
            client.close()
            sender.close()


async def test_busy_refusal_and_abort_free_the_slot(kv):
    async with kv.running_receiver(max_tokens=64, slots=1) as receiver:
        client = _client()
        try:
            client.start("a", receiver.endpoint, 10)
            client.start("b", receiver.endpoint, 10)
            assert (await _result(client, "a")).ok
            refused = await _result(client, "b")
            assert not refused.ok and refused.reason == "busy" and "busy" in refused.error
            client.abort("a", receiver.endpoint, "the request went away")
            await eventually(lambda: receiver.busy_slots() == 0)
            client.start("c", receiver.endpoint, 10)  # the freed slot serves the next request
            assert (await _result(client, "c")).ok
            client.abort("c", receiver.endpoint, "done")
            await eventually(lambda: receiver.busy_slots() == 0)
        finally:
            client.close()


async def test_only_the_admitting_group_may_write_or_abort(kv):
    async with kv.running_receiver(max_tokens=64) as receiver:
        client, stranger = _client(), kv.make_sender(group="someone-else")
        try:
            client.start("h", receiver.endpoint, 8)
            admission = await _result(client, "h")
            await asyncio.to_thread(stranger.connect, receiver.endpoint, 5)
            handoff = stranger.open(receiver.endpoint, "h", 8, admission.offsets, time.monotonic() + 10)
            assert handoff is not None
            handoff.post_layers(list(range(SMALL.num_layers)))  # its notifications are ignored
            with pytest.raises(Exception, match="0/3 layers arrived"):
                await receiver.wait_for("h", 0.5)
            assert_no_leaks(receiver)
        finally:
            client.close()
            stranger.close()


async def test_a_hung_decode_server_delays_only_its_own_requests(kv):
    """A listener that accepts and never answers (a SIGSTOPped decode server looks the same
    from the network): its admission fails after the timeout, the healthy server's is answered
    meanwhile."""
    hung = socket.create_server(("127.0.0.1", 0))
    hung_endpoint = f"127.0.0.1:{hung.getsockname()[1]}"
    accepted: list[socket.socket] = []
    acceptor = threading.Thread(target=lambda: accepted.append(hung.accept()[0]), daemon=True)
    acceptor.start()
    async with kv.running_receiver(max_tokens=64) as receiver:
        client = _client(timeout_s=3)
        try:
            t0 = time.monotonic()
            client.start("stuck", hung_endpoint, 8)
            client.start("fine", receiver.endpoint, 8)
            assert (await _result(client, "fine")).ok
            assert client.result("stuck") is None  # the healthy one was not queued behind it
            stuck = await _result(client, "stuck")
            assert not stuck.ok and stuck.reason == "unreachable" and "within 3.0s" in stuck.error
            assert time.monotonic() - t0 >= 3  # it waited out its own timeout, no less
            client.abort("fine", receiver.endpoint, "done")
            await eventually(lambda: receiver.busy_slots() == 0)
        finally:
            client.close()
            hung.close()
            for conn in accepted:
                conn.close()


class _ThreadedReceiver:
    """A KVReceiver on an event loop of its own, which the test can freeze: a stopped decode
    server as the network sees it (connections accepted, frames queued, nothing answered)."""

    def __init__(self, slots: int) -> None:
        from connector.receiver import KVReceiver, ReceiverSettings
        from tests.fakes.memory_transport import MemoryFabric

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.receiver = KVReceiver(ReceiverSettings(layout=SMALL, max_tokens=64, slots=slots),
                                   MemoryFabric().transport)
        self._call(self.receiver.start())
        self._gate = threading.Event()

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    async def _busy(self) -> int:
        return self.receiver.busy_slots()

    def busy(self) -> int:
        return self._call(self._busy())

    def freeze(self) -> None:
        self._gate.clear()
        self.loop.call_soon_threadsafe(self._gate.wait)

    def thaw(self) -> None:
        self._gate.set()

    def close(self) -> None:
        self._gate.set()
        self._call(self.receiver.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


async def test_an_admit_given_up_on_is_cancelled_when_the_decode_server_resumes():
    """The Admit sits unread while the decode server is stopped; the client times out. On
    resume the server would admit it and hold a slot nobody uses: the Abort naming that try,
    sent first on the next connection, frees it (or cancels the Admit if read later)."""
    server = _ThreadedReceiver(slots=2)
    client = _client(timeout_s=1.0)
    try:
        client.start("warm", server.receiver.endpoint, 8)
        assert (await _result(client, "warm")).ok
        client.abort("warm", server.receiver.endpoint, "done")
        await eventually(lambda: server.busy() == 0)
        server.freeze()
        client.start("ghost", server.receiver.endpoint, 8)
        ghost = await _result(client, "ghost")
        assert not ghost.ok and ghost.reason == "unreachable"
        server.thaw()
        client.start("next", server.receiver.endpoint, 8)
        assert (await _result(client, "next")).ok
        await eventually(lambda: server.busy() == 1)  # "next" only: the ghost's slot is free
        client.abort("next", server.receiver.endpoint, "done")
        await eventually(lambda: server.busy() == 0)
    finally:
        client.close()
        server.close()


def _result_of(handoff_id: str, endpoint: str, num_tokens: int, status: str = "pending") -> HandoffResult:
    return HandoffResult(handoff_id=handoff_id, kv_endpoint=endpoint, num_prompt_tokens=num_tokens,
                         first_token_id=7, last_prompt_token_id=5, status=status,  # type: ignore[arg-type]
                         reason="transfer" if status == "failed" else None)


async def test_the_first_token_travels_with_the_kv(kv):
    """A claim's decode waits for the KV *and* the scheduler's Prefilled (issue 34): the KV
    alone does not end the wait, and the result comes back with the KV."""
    async with kv.running_receiver(max_tokens=64) as receiver:
        client, sender = _client(), kv.make_sender(group=GROUP)
        try:
            waiter = asyncio.create_task(receiver.wait_for("h", 10, with_result=True))
            client.start("h", receiver.endpoint, 40)
            admission = await _result(client, "h")
            await _write_every_layer(sender, receiver.endpoint, admission, 40, seed=3)
            await eventually(lambda: receiver.stats.completed == 1)
            # an absence, so bounded: the completion woke the waiter, which kept waiting for the result
            done, _ = await asyncio.wait({waiter}, timeout=0.2)
            assert not done
            client.prefilled(_result_of("h", receiver.endpoint, 40))
            got = await waiter
            assert got.result is not None and got.result.first_token_id == 7
            assert mismatches(got.layers, SMALL, 40, 3) == []
            receiver.release("h")
            assert_no_leaks(receiver, sender)
        finally:
            client.close()
            sender.close()


async def test_a_result_is_taken_only_from_the_admitting_group_and_a_failed_one_fails_the_handoff(kv):
    async with kv.running_receiver(max_tokens=64, slots=2) as receiver:
        ours, theirs = _client(), _client(group="prefill-group-b")
        try:
            ours.start("h", receiver.endpoint, 10)
            assert (await _result(ours, "h")).ok
            theirs.start("x", receiver.endpoint, 10)  # its channel, handshaken
            assert (await _result(theirs, "x")).ok
            theirs.prefilled(_result_of("h", receiver.endpoint, 10))  # not its handoff: dropped
            theirs.prefilled(_result_of("x", receiver.endpoint, 10, status="failed"))
            with pytest.raises(TransferFailed, match="the prefill failed"):
                await receiver.wait_for("x", 10, with_result=True)
            assert receiver.busy_slots() == 1  # x's slot is free again, h holds its own
            with pytest.raises(HandoffTimeout, match=r"0/\d+ layers and the prefill's result"):
                await receiver.wait_for("h", 0.2, with_result=True)
            assert receiver.busy_slots() == 0
        finally:
            ours.close()
            theirs.close()

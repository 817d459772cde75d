"""Factories and leak checks shared by the transport tests."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from connector.layout import KVLayout, cpu_mla_layout
from connector.receiver import KVReceiver, ReceiverSettings
from connector.sender import KVSender
from connector.transport import TransportFactory, nixl_transport
from tests.fakes.memory_transport import MemoryFabric

SMALL = cpu_mla_layout(2, 1)  # the tiny model's layout: 2 main layers + 1 MTP, bf16 576 per token


class KVTestbed:
    """Senders and receivers of one test: the in-memory fake transport on a fabric of this
    test's own (the ``kv`` fixture), or real NIXL (``transport="nixl"``)."""

    def __init__(self) -> None:
        self.fabric = MemoryFabric()

    def transport(self, kind: str) -> TransportFactory:
        if kind not in ("memory", "nixl"):
            raise ValueError(f"transport={kind!r}: 'memory' or 'nixl'")
        return self.fabric.transport if kind == "memory" else nixl_transport

    def make_sender(self, layout: KVLayout = SMALL, max_tokens: int = 64, transport: str = "memory",
                    **kw) -> KVSender:
        return KVSender(f"prefill-{uuid.uuid4().hex[:8]}", layout, max_tokens, transport=self.transport(transport),
                        **kw)

    def receiver(self, layout: KVLayout = SMALL, max_tokens: int = 64, transport: str = "memory",
                 **kw) -> KVReceiver:
        return KVReceiver(ReceiverSettings(layout=layout, max_tokens=max_tokens, **kw), self.transport(transport))

    @asynccontextmanager
    async def running_receiver(self, layout: KVLayout = SMALL, max_tokens: int = 64, transport: str = "memory",
                               **kw) -> AsyncIterator[KVReceiver]:
        receiver = self.receiver(layout, max_tokens, transport, **kw)
        await receiver.start()
        try:
            yield receiver
        finally:
            await receiver.stop()


def assert_no_leaks(receiver: KVReceiver, *senders: KVSender) -> None:
    assert receiver.busy_slots() == 0, "a receive slot leaked"
    for sender in senders:
        assert len(sender._free_staging) == len(sender.staging_buffer) // sender.slot_bytes, "staging leaked"



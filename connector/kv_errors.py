"""One exception hierarchy for the KV handoff path (sender, receiver, control channel).

Every message names what went wrong in words a prefill or decode operator can act on:
a handshake mismatch names the field, the expected value (the decode side's) and the
received value (the prefill side's).
"""

from __future__ import annotations


class ConnectorError(RuntimeError):
    """Base of every error raised by the KV transport half of the connector."""


class ControlChannelError(ConnectorError):
    """The control channel could not be opened, broke, timed out or carried garbage."""


class TransportError(ConnectorError):
    """The data transport (NIXL or the in-memory fake) failed."""


class HandshakeRejected(ConnectorError):
    """The decode server and this prefill disagree on the protocol or the KV layout."""

    def __init__(self, field: str, expected: str, received: str, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.expected = expected
        self.received = received


class AdmissionRefused(ConnectorError):
    """The decode server did not admit a handoff (``reason``: "busy", "too_long", ...)."""

    def __init__(self, handoff_id: str, reason: str, message: str) -> None:
        super().__init__(message)
        self.handoff_id = handoff_id
        self.reason = reason


class ReceiverError(ConnectorError):
    """Base of the errors raised by :class:`connector.receiver.KVReceiver`."""


class HandoffTimeout(ReceiverError):
    """The handoff's KV did not (fully) arrive in time; it has been freed."""


class TransferFailed(ReceiverError):
    """The sender reported failure or abort, or vanished; the handoff has been freed."""

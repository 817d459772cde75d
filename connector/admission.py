"""Admission of handoffs at the decode servers, off vLLM's forward path (scheduler side).

The scheduler side of the connector (vLLM's engine-core process) asks the decode server
for a receive slot as soon as vLLM adds a handed-off request (``on_new_request``), long
before the request's prompt is computed. :class:`AdmissionClient` runs one thread and one
control connection per decode endpoint: ``start`` only queues the request, the thread
handshakes (control only: Hello without transport metadata, in the prefill's sender
group) and sends ``Admit``, and ``result`` returns what is already there, never waiting.
While a request's admission is under way, vLLM's scheduler keeps the request waiting
(:meth:`connector.scheduler.ConnectorScheduler.get_num_new_matched_tokens` answers
"not yet") and schedules the others: a slow, hung or unreachable decode server delays
only the requests bound to it, each by at most ``timeout_s``.

The admitted slot's offsets go to the workers with the step that computes the prompt's
last token (:class:`connector.metadata.RequestWork`); the workers write the layers into
the slot over NIXL. No torch and no NIXL here.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from connector.control import ABORT_TIMEOUT_S, ControlClient
from connector.kv_errors import ControlChannelError
from connector.prefix import NO_PREFIX, Prefix
from connector.protocol import (
    Abort,
    Admit,
    Admitted,
    Hello,
    LayoutFingerprint,
    Noted,
    Prefilled,
    Refused,
    Reject,
    Welcome,
    handshake_mismatch,
)
from pd_wire.handoff import PROTOCOL_VERSION, FailureReason, HandoffResult

log = logging.getLogger(__name__)

_REFUSALS: tuple[FailureReason, ...] = ("busy", "too_long", "cancelled", "duplicate", "unknown_peer")


@dataclass(frozen=True)
class Admission:
    """The decode server's answer for one handoff: a slot (``error`` None) or a refusal."""

    handoff_id: str
    slot: int | None = None
    offsets: tuple[tuple[int, ...], ...] | None = None
    reason: FailureReason | None = None
    error: str | None = None
    reused: int = 0  # the prompt's leading tokens the decode server keeps: not written

    @property
    def ok(self) -> bool:
        return self.error is None


class Admissions(Protocol):
    """What :class:`connector.scheduler.ConnectorScheduler` uses (a fake in unit tests)."""

    def start(self, handoff_id: str, endpoint: str, num_tokens: int, prefix: Prefix = NO_PREFIX) -> None: ...

    def result(self, handoff_id: str) -> Admission | None: ...

    def abort(self, handoff_id: str, endpoint: str, reason: str) -> None: ...

    def prefilled(self, result: HandoffResult) -> None: ...

    def forget(self, handoff_id: str) -> None: ...

    def close(self) -> None: ...


Connect = Callable[[str, float], ControlClient]


class AdmissionClient:
    def __init__(self, *, agent_name: str, group: str, fingerprint: LayoutFingerprint, transport: str,
                 timeout_s: float, connect: Connect = ControlClient) -> None:
        self.agent_name = agent_name
        self.group = group
        self.fingerprint = fingerprint
        self.transport = transport
        self.timeout_s = timeout_s
        self._connect = connect
        self._lock = threading.Lock()
        self._results: dict[str, Admission | None] = {}  # None: under way
        self._attempts: dict[str, str] = {}
        self._channels: dict[str, _Channel] = {}
        self._closed = False

    def start(self, handoff_id: str, endpoint: str, num_tokens: int, prefix: Prefix = NO_PREFIX) -> None:
        """Ask ``endpoint`` for a slot for this handoff, offering the prompt's ``prefix``
        (:func:`connector.prefix.split_prompt`: its block hashes and the ids past them) for the
        decode server to match with the KV it keeps."""
        attempt = uuid.uuid4().hex  # names this try in its Admit and Abort
        with self._lock:
            self._results[handoff_id] = None
            self._attempts[handoff_id] = attempt
        self._channel(endpoint).put(("admit", handoff_id, ((num_tokens, prefix), attempt),
                                     time.monotonic() + self.timeout_s))

    def result(self, handoff_id: str) -> Admission | None:
        with self._lock:
            return self._results.get(handoff_id)

    def abort(self, handoff_id: str, endpoint: str, reason: str) -> None:
        """Tell the decode server to free the slot (after a pending Admit on the same channel)."""
        with self._lock:
            attempt = self._attempts.get(handoff_id, "")
        self._channel(endpoint).put(("abort", handoff_id, (reason, attempt), time.monotonic() + ABORT_TIMEOUT_S))

    def prefilled(self, result: HandoffResult) -> None:
        """Send the handoff's result to its decode server (after its Admit, on the same channel)."""
        with self._lock:
            attempt = self._attempts.get(result.handoff_id, "")
        self._channel(result.kv_endpoint).put(("prefilled", result.handoff_id, (result, attempt),
                                               time.monotonic() + self.timeout_s))

    def forget(self, handoff_id: str) -> None:
        with self._lock:
            self._results.pop(handoff_id, None)
            self._attempts.pop(handoff_id, None)

    def pending(self) -> int:
        with self._lock:
            return sum(r is None for r in self._results.values())

    def close(self) -> None:
        with self._lock:
            self._closed = True
            channels = list(self._channels.values())
        for channel in channels:
            channel.stop()

    # -- internals ---------------------------------------------------------------------

    def _channel(self, endpoint: str) -> _Channel:
        with self._lock:
            channel = self._channels.get(endpoint)
            if channel is None:
                channel = self._channels[endpoint] = _Channel(self, endpoint)
                if not self._closed:
                    channel.start()
            return channel

    def _settle(self, admission: Admission) -> None:
        with self._lock:
            if admission.handoff_id in self._results:  # forgotten meanwhile: dropped
                self._results[admission.handoff_id] = admission

    def _hello(self) -> Hello:
        return Hello(protocol_version=PROTOCOL_VERSION, agent_name=self.agent_name, fingerprint=self.fingerprint,
                     transport=self.transport, group=self.group)


class _Channel:
    """One decode endpoint: a FIFO of admits and aborts, served by one thread."""

    def __init__(self, owner: AdmissionClient, endpoint: str) -> None:
        self.owner = owner
        self.endpoint = endpoint
        self._queue: queue.Queue[tuple[str, str, tuple[Any, str], float] | None] = queue.Queue()
        self._client: ControlClient | None = None
        # Admits sent without an answer (timed out, connection broke): the decode server may
        # still read them (a stopped process resumes). An Abort naming the try goes out on
        # every new connection until one is answered.
        self._unsettled: dict[str, tuple[str, str]] = {}  # handoff id -> (reason, attempt)
        self._thread = threading.Thread(target=self._run, name=f"tilert-kv-admit-{endpoint}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def put(self, item: tuple[str, str, tuple[Any, str], float]) -> None:
        self._queue.put(item)

    def stop(self) -> None:
        self._queue.put(None)
        if self._thread.is_alive():
            self._thread.join(self.owner.timeout_s + 1)
        if self._client is not None:
            self._client.close()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            kind, handoff_id, (arg, attempt), deadline = item
            try:
                if kind == "admit":
                    num_tokens, prefix = arg
                    self.owner._settle(self._admit(handoff_id, num_tokens, prefix, attempt, deadline))
                elif kind == "prefilled":
                    self._prefilled(arg, attempt, deadline)
                else:
                    self._abort(handoff_id, str(arg), attempt, deadline)
            except Exception as exc:  # noqa: BLE001 - a bug must not leave admissions hanging
                log.exception("KV admission %s at %s failed", handoff_id, self.endpoint)
                if kind == "admit":
                    self.owner._settle(Admission(handoff_id, reason="internal",
                                                 error=f"{type(exc).__name__}: {exc}"))

    def _admit(self, handoff_id: str, num_tokens: int, prefix: Prefix, attempt: str, deadline: float) -> Admission:
        hashes, tail = prefix
        admit = Admit(handoff_id=handoff_id, num_tokens=num_tokens, attempt=attempt, prefix=list(hashes),
                      tail=list(tail))
        for retry in (False, True):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return Admission(handoff_id, reason="unreachable", error=(
                    f"decode server {self.endpoint} did not admit handoff {handoff_id} within "
                    f"{self.owner.timeout_s:g}s (admission_timeout_s)"))
            sent = False
            try:
                fresh = self._client is None or self._client.broken
                client = self._connected(remaining)
                sent = True
                reply = client.request(admit, max(0.01, deadline - time.monotonic()))
            except _Rejected as exc:
                return Admission(handoff_id, reason="rejected", error=str(exc))
            except (ControlChannelError, ValueError) as exc:
                if sent:
                    self._unsettled[handoff_id] = ("the prefill gave up waiting for the answer to its Admit", attempt)
                self._drop()
                if not retry and not fresh:  # a cached connection went stale: handshake again once
                    continue
                return Admission(handoff_id, reason="unreachable", error=f"decode server {self.endpoint}: {exc}")
            if isinstance(reply, Refused):
                reason = reply.reason if reply.reason in _REFUSALS else "internal"
                return Admission(handoff_id, reason=reason, error=f"decode server {self.endpoint}: {reply.message}")
            if not isinstance(reply, Admitted) or reply.handoff_id != handoff_id:
                self._drop()
                return Admission(handoff_id, reason="internal",
                                 error=f"{self.endpoint} answered Admit with {reply!r:.200}")
            if reply.reused and (not hashes or reply.reused >= num_tokens):
                self._drop()
                return Admission(handoff_id, reason="internal", error=(
                    f"{self.endpoint} admitted handoff {handoff_id} reusing {reply.reused} of its {num_tokens} tokens, "
                    f"{'none offered' if not hashes else 'not below the prompt length'}"))
            return Admission(handoff_id, slot=reply.slot, offsets=tuple(tuple(o) for o in reply.offsets),
                             reused=reply.reused)
        raise AssertionError("unreachable")

    def _abort(self, handoff_id: str, reason: str, attempt: str, deadline: float) -> None:
        self._unsettled.pop(handoff_id, None)
        if self._client is None or self._client.broken:
            # no connection: the receiver frees what this group held when it went away, and
            # an Admit it may still read is cancelled by the Abort the next connection sends
            self._unsettled[handoff_id] = (reason, attempt)
            return
        try:
            self._send_abort(self._client, handoff_id, reason, attempt, deadline)
        except ControlChannelError as exc:
            self._unsettled[handoff_id] = (reason, attempt)
            self._drop()
            log.warning("KV admission: could not abort %s at %s: %s", handoff_id, self.endpoint, exc)

    def _prefilled(self, result: HandoffResult, attempt: str, deadline: float) -> None:
        """The first token to the decode server. Not sent again on a new connection: a
        decode server that misses it fails that request at its KV timeout."""
        if self._client is None or self._client.broken:
            log.warning("KV admission: no control connection to %s for the result of %s", self.endpoint,
                        result.handoff_id)
            return
        try:
            reply = self._client.request(Prefilled(result=result, attempt=attempt),
                                         max(0.01, deadline - time.monotonic()))
        except ControlChannelError as exc:
            self._drop()
            log.warning("KV admission: could not send the result of %s to %s: %s", result.handoff_id,
                        self.endpoint, exc)
            return
        if not isinstance(reply, Noted) or not reply.known:
            log.info("KV admission: %s dropped the result of %s (%r)", self.endpoint, result.handoff_id, reply)

    @staticmethod
    def _send_abort(client: ControlClient, handoff_id: str, reason: str, attempt: str, deadline: float) -> None:
        abort = Abort(handoff_id=handoff_id, reason=reason, attempt=attempt)
        client.request(abort, max(0.01, deadline - time.monotonic()))

    def _connected(self, timeout: float) -> ControlClient:
        if self._client is not None and not self._client.broken:
            return self._client
        self._drop()
        client = self.owner._connect(self.endpoint, timeout)
        try:
            reply = client.request(self.owner._hello(), timeout)
            if isinstance(reply, Reject):
                raise _Rejected(f"decode server {self.endpoint} rejected the KV handshake: {reply.message}")
            if not isinstance(reply, Welcome):
                raise ControlChannelError(f"{self.endpoint} answered Hello with {type(reply).__name__}")
            bad = handshake_mismatch(decode_version=reply.protocol_version, decode_transport=reply.transport,
                                     decode_fingerprint=reply.fingerprint, prefill_version=PROTOCOL_VERSION,
                                     prefill_transport=self.owner.transport,
                                     prefill_fingerprint=self.owner.fingerprint)
            if bad is not None:
                raise _Rejected(f"decode server {self.endpoint}: {bad[0]} mismatch: decode expects {bad[1]}, "
                                f"this prefill has {bad[2]}")
            for handoff_id, (reason, attempt) in list(self._unsettled.items()):  # tries given up on, first
                self._send_abort(client, handoff_id, reason, attempt, time.monotonic() + timeout)
                del self._unsettled[handoff_id]
        except BaseException:
            client.close()
            raise
        self._client = client
        return client

    def _drop(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


class _Rejected(Exception):
    pass

"""The router's one error hierarchy.

Every error the router produces is a :class:`RouterError`. Its ``type`` string is
both the OpenAI error ``type`` in the JSON body and the ``error_type`` label of the
``pd_router_requests_total`` metric; ``status`` is its one HTTP status. Lower-layer
exceptions (transport, httpx, pydantic) are mapped to these at the boundary where
they happen (:mod:`pd_router.upstream.calls`, :mod:`pd_router.apis.completions`).
"""

from __future__ import annotations

from typing import ClassVar

from pd_wire.errors import ErrorBody, ErrorDetail


class RouterError(Exception):
    status: ClassVar[int] = 500
    type: ClassVar[str] = "internal_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def payload(self) -> ErrorBody:
        code = self.code if self.code is not None else self.status
        return ErrorBody(error=ErrorDetail(message=_unicode(self.message), type=self.type,
                                           param=None if self.param is None else _unicode(self.param), code=code))

    def body(self) -> bytes:
        return self.payload().model_dump_json().encode()

    def headers(self) -> list[tuple[bytes, bytes]]:
        return []

    def sse_event(self) -> bytes:
        """The error as the last events of an SSE stream that already began."""
        return b"data: " + self.body() + b"\n\ndata: [DONE]\n\n"


def _unicode(text: str) -> str:
    """``text`` as valid Unicode: a message may quote the client's text, and a lone surrogate
    there (JSON allows one as an escape) becomes ``?`` (no JSON encoder or strict parser takes one)."""
    return text.encode("utf-8", "replace").decode("utf-8")


class InvalidRequest(RouterError):
    status = 400
    type = "invalid_request_error"


class Unauthorized(RouterError):
    status = 401
    type = "authentication_error"


class Forbidden(RouterError):
    status = 403
    type = "permission_error"


class Conflict(RouterError):
    status = 409
    type = "conflict_error"


class ModelNotFound(RouterError):
    status = 404
    type = "model_not_found"


class NotFound(RouterError):
    status = 404
    type = "not_found_error"


class UnknownResponse(RouterError):
    """A ``previous_response_id`` no store here holds (vLLM's answer without its store)."""

    status = 404
    type = "invalid_request_error"


class MethodNotAllowed(RouterError):
    status = 405
    type = "method_not_allowed"


class BodyTooLarge(RouterError):
    status = 413
    type = "request_too_large"


class PromptTooLong(RouterError):
    """The prompt's KV does not fit the decode server (prefill's handoff ``too_long``)."""

    status = 413
    type = "request_too_large"


class RetryLater(RouterError):
    """An error the client should retry after ``retry_after`` seconds (every 429 and 503
    the router produces: the ``Retry-After`` header)."""

    def __init__(
        self, message: str, *, retry_after: int = 1, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message, param=param, code=code)
        self.retry_after = max(1, retry_after)

    def headers(self) -> list[tuple[bytes, bytes]]:
        return [(b"retry-after", str(self.retry_after).encode())]


class Overloaded(RetryLater):
    status = 429
    type = "overloaded_error"


class RequestTimeout(RouterError):
    """The client took longer than ``--body-timeout`` to send its request body."""

    status = 408
    type = "request_timeout"


class BadUpstream(RouterError):
    status = 502
    type = "bad_upstream_response"


class NoHealthyBackend(RetryLater):
    status = 503
    type = "no_healthy_backend"

    @classmethod
    def for_decode(cls, model: str) -> NoHealthyBackend:
        """No usable decode server serves ``model``."""
        return cls(f"no healthy, compatible decode server for model {model!r}")


class ShuttingDown(RetryLater):
    """The router is draining (SIGTERM): no new requests; in-flight ones past
    ``--drain-timeout`` end with this error."""

    status = 503
    type = "service_unavailable"


class UpstreamTimeout(RouterError):
    status = 504
    type = "upstream_timeout"


class UpstreamRejected(RouterError):
    """An upstream 4xx answer, relayed to the client as it is (status and body)."""

    type = "upstream_rejected"

    def __init__(self, status: int, raw_body: bytes, content_type: bytes = b"application/json") -> None:
        super().__init__(raw_body[:200].decode(errors="replace"))
        self.status = status  # type: ignore[misc]  # per instance: the upstream's status
        self.raw_body = raw_body
        self.content_type = content_type

    def body(self) -> bytes:
        return self.raw_body


# the transport's failures, as the upstream calls (pd_router.upstream.calls) raise them
class Unreachable(BadUpstream):
    """The connection failed before the upstream answered anything."""


class ConnectionLost(BadUpstream):
    """The connection broke after the request was sent (the upstream process died or reset it)."""


class Hung(BadUpstream):
    """The upstream took a call a live server answers at once and answered nothing in time (a
    stopped process, a cut link): the server is lost, not slow."""


class Unavailable(BadUpstream):
    """The upstream answered 503: not ready, or draining."""


class KVNotDelivered(BadUpstream):
    """Prefill ran but its KV did not reach the decode server (unreachable, rejected,
    transfer failed): a failure of the decode leg, before anything reached the client."""


# what ends an attempt and sends the request to another one (pd_router.request.attempts)
class AttemptEnded(Exception):
    """An attempt ended, not the request: it runs again (another slot, another decode server),
    or, out of attempts, ends with :attr:`error`, whose ``status`` and ``type`` it answers with.
    ``reason``: its label in ``pd_router_retries_total`` or ``pd_router_migrations_total``."""

    def __init__(self, error: RouterError, reason: str) -> None:
        super().__init__(error.message)
        self.error = error
        self.reason = reason
        self.message = error.message

    @property
    def status(self) -> int:
        return self.error.status

    @property
    def type(self) -> str:
        return self.error.type


class Requeue(AttemptEnded):
    """The attempt on this slot cannot go on, but it is not a client error: the request waits
    for a slot again and runs prefill again. ``busy``: the decode server had no free slot or KV
    receive slot for it (a server counted here: held back, :meth:`SlotPool.hold`; a 429 when the
    request runs out of retries); otherwise the handoff id was stale on the decode server (a
    client reusing an ``X-Request-Id``) and the next attempt's new id is enough (a 409 when it
    was stale again)."""

    def __init__(self, reason: str, message: str, busy: bool = True) -> None:
        super().__init__(Overloaded(message) if busy else Conflict(message, param="X-Request-Id"), reason)
        self.busy = busy


class DecodeLegFailed(AttemptEnded):
    """The decode server failed before any byte reached the client (connection refused, 5xx,
    KV handoff failed, the connection lost before its first chunk): the request may run
    again on another decode server (once)."""

    def __init__(self, error: RouterError) -> None:
        super().__init__(error, "failover")


class DecodeLost(AttemptEnded):
    """The decode server failed after its answer began (its connection lost or reset, no token
    for ``--stall-timeout``, an error event of its own failure): the request may go on on
    another decode server from the tokens its client has (:mod:`pd_router.request.migration`).
    ``server``: the lost server's URL."""

    def __init__(self, error: RouterError, reason: str, server: str) -> None:
        super().__init__(error, reason)
        self.server = server

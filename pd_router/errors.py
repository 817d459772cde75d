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

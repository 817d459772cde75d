"""One error hierarchy for the decode server's HTTP layer.

Every failure a client can see is an :class:`ApiError`; its ``type`` is both
the ``error.type`` of the OpenAI-shaped body and the ``error_type`` label of the
``decode_server_errors_total`` metric. Lower-layer errors (receiver, engine) are
mapped to these at one boundary, :mod:`decode_server.server.generation`.
"""

from __future__ import annotations

from typing import ClassVar

from pd_wire.errors import ErrorBody, ErrorDetail
from pd_wire.requests import validation_message as validation_message


class ApiError(Exception):
    status: ClassVar[int] = 500
    type: ClassVar[str] = "internal_error"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def payload(self) -> ErrorBody:
        return ErrorBody(error=ErrorDetail(message=self.message, type=self.type, param=self.param,
                                           code=self.status))

    def body(self) -> bytes:
        return self.payload().model_dump_json().encode()


class InvalidRequest(ApiError):
    status = 400
    type = "invalid_request_error"


class NotFound(ApiError):
    status = 404
    type = "not_found_error"


class Busy(ApiError):
    status = 429
    type = "rate_limit_error"


class Cancelled(ApiError):
    """The request was cancelled (cancel endpoint) or its client went away."""

    status = 499
    type = "cancelled"


class EngineFailure(ApiError):
    status = 500
    type = "engine_error"


class NotReady(ApiError):
    status = 503
    type = "service_unavailable"


class KVHandoffFailed(ApiError):
    """Prefill reported the KV handoff as failed, or the sender aborted it."""

    status = 502
    type = "kv_handoff_failed"


class KVTimeout(ApiError):
    status = 504
    type = "kv_timeout"


class Conflict(ApiError):
    status = 409
    type = "conflict_error"


class Unauthorized(ApiError):
    status = 401
    type = "authentication_error"

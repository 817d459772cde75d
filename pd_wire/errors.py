"""The one OpenAI error body every server of the product answers with (router and decode
server alike), and every client of ours parses."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ErrorDetail(BaseModel):
    model_config = ConfigDict(frozen=True)

    message: str
    type: str  # also the error_type label of the server's error metric
    param: str | None = None
    code: str | int | None = None


class ErrorBody(BaseModel):
    """``{"error": {"message", "type", "param", "code"}}``, as OpenAI answers errors."""

    model_config = ConfigDict(frozen=True)

    error: ErrorDetail

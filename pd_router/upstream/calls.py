"""A request's calls to the prefill and decode servers, on the app's one connection pool
(:class:`~pd_router.upstream.connections.ConnectionPool`, ``state.connections``).

This is the boundary where transport exceptions become :mod:`pd_router.errors`:
a connection that fails before any answer -> :class:`Unreachable` (a
:class:`BadUpstream`, retryable for prefill), timeouts -> :class:`UpstreamTimeout`,
upstream 4xx -> :class:`UpstreamRejected` (relayed as is), anything else ->
:class:`BadUpstream`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from typing import Any, NamedTuple
from urllib.parse import urlsplit

from pd_router.errors import (
    BadUpstream,
    ConnectionLost,
    RouterError,
    Unavailable,
    Unreachable,
    UpstreamRejected,
    UpstreamTimeout,
)
from pd_router.upstream.connections import ConnectionPool
from pd_router.upstream.rawhttp import ConnectFailed, Origin, ReadTimeout, Response, UpstreamError
from pd_wire.decode import REFUSAL_EVENT, REQUEST_ID_HEADER, DecodeRefusal


class Target(NamedTuple):
    """A backend base URL, parsed once."""

    origin: Origin
    prefix: str  # path before /v1/..., usually ""
    auth: tuple[tuple[str, str], ...] = ()  # headers sent on every call (a decode server's API key)

    @classmethod
    def parse(cls, url: str, api_key: str | None = None) -> Target:
        parts = urlsplit(url)
        tls = parts.scheme == "https"
        return cls(
            Origin(parts.hostname or "", parts.port or (443 if tls else 80), tls),
            parts.path.rstrip("/"),
            (("Authorization", f"Bearer {api_key}"),) if api_key else (),
        )

    def __repr__(self) -> str:  # never the key
        return f"Target({self.origin!r}, {self.prefix!r})"


def _short(data: bytes) -> str:
    return data[:300].decode(errors="replace").strip()


def map_error(role: str, target: Target, exc: UpstreamError | TimeoutError, timeout_name: str) -> RouterError:
    """The router error for a transport failure on one leg."""
    if isinstance(exc, (ReadTimeout, TimeoutError)):
        return UpstreamTimeout(f"{role} server {target.origin} did not answer within {timeout_name}")
    if isinstance(exc, ConnectFailed):
        return Unreachable(f"{role} server {target.origin} unreachable: {exc}")
    return ConnectionLost(f"{role} server {target.origin} failed: {exc}")


async def _check_status(resp: Response, role: str, target: Target) -> None:
    """Raise for a non-200 answer: 4xx relayed as is, anything else a 502."""
    if resp.status == 200:
        return
    try:
        data = await resp.read()
    finally:
        resp.release()
    raise status_error(role, target, resp.status, data, resp.headers.get(b"content-type", b"application/json"))


def status_error(role: str, target: Target, status: int, data: bytes, content_type: bytes) -> RouterError:
    """The error of an answer with a status other than 200: 4xx relayed as is; a decode server's
    504 (the request's KV did not come in time: a failure of that request's handoff, not of the
    server) an :class:`UpstreamTimeout`; anything else a 502."""
    if 400 <= status < 500:
        return UpstreamRejected(status, data, content_type)
    if role == "decode" and status == 504:
        return UpstreamTimeout(f"{role} server {target.origin} answered 504: {_short(data)}")
    if status == 503:
        return Unavailable(f"{role} server {target.origin} answered 503: {_short(data)}")
    return BadUpstream(f"{role} server {target.origin} answered {status}: {_short(data)}")


async def call(pool: ConnectionPool, target: Target, path: str, body: bytes, timeout_s: float,
               headers: Mapping[str, str] | None = None) -> tuple[int, bytes]:
    """One small exchange with a decode server's control endpoint (a posted
    result): ``body`` POSTed to ``path`` with the target's auth, the whole answer read within
    ``timeout_s`` (else :class:`TimeoutError`); its status and body, the connection given back."""
    async with asyncio.timeout(timeout_s):
        resp = await pool.post(target.origin, target.prefix + path, body, {**dict(target.auth), **(headers or {})})
        try:
            return resp.status, await resp.read()
        finally:
            resp.release()


async def post_json(
    pool: ConnectionPool, target: Target, path: str, body: bytes, request_id: str, timeout_s: float,
    trace: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """POST the rewritten request to a prefill server; its JSON answer. ``trace``: the
    ``traceparent`` header when tracing is on."""
    headers = {REQUEST_ID_HEADER: request_id}
    if trace:
        headers.update(trace)
    try:
        async with asyncio.timeout(timeout_s):
            resp = await pool.post(target.origin, target.prefix + path, body, headers)
            await _check_status(resp, "prefill", target)
            try:
                data = await resp.read()
            finally:
                resp.release()
    except (UpstreamError, TimeoutError) as exc:
        raise map_error("prefill", target, exc, f"--prefill-timeout {timeout_s:g}s") from None
    try:
        answer = json.loads(data)
    except ValueError:
        raise BadUpstream(f"prefill server {target.origin} answered invalid JSON: {_short(data)}") from None
    if not isinstance(answer, dict):
        raise BadUpstream(
            f"prefill server {target.origin} answered a JSON {type(answer).__name__}, not an object"
        )
    return answer


async def open_decode(
    pool: ConnectionPool, target: Target, path: str, body: bytes, request_id: str, timeout_s: float,
    trace: Mapping[str, str] | None = None, granted_within: float | None = None,
) -> Response:
    """POST to the decode server holding the slot; the open response (status 200 checked).
    ``timeout_s`` bounds the wait for the answer and for each later chunk. ``trace``: the
    ``traceparent`` header when tracing is on. ``granted_within``: the request holds its
    slot itself (every claim does): its 200 must come within this many seconds
    (else :class:`Unreachable`: connected and silent, hung); it says the slot is taken, and
    :func:`first_event` waits for the rest."""
    headers = {REQUEST_ID_HEADER: request_id, **dict(target.auth), **(trace or {})}
    try:
        if granted_within is None:
            resp = await pool.post(target.origin, target.prefix + path, body, headers, read_timeout=timeout_s)
        else:
            try:
                async with asyncio.timeout(granted_within):
                    resp = await pool.post(target.origin, target.prefix + path, body, headers,
                                           read_timeout=timeout_s)
            except TimeoutError:
                raise Unreachable(f"decode server {target.origin} did not answer a request holding its slot within "
                           f"{granted_within:g}s (a live server answers at once)") from None
        await _check_status(resp, "decode", target)
    except UpstreamError as exc:
        raise map_error("decode", target, exc, f"--decode-timeout {timeout_s:g}s") from None
    return resp


async def read_first_event(resp: Response, target: Target, timeout_s: float) -> Response:
    """A granted decode answer (see :func:`open_decode`) once its first event came: raises for
    a body that is a refusal (:class:`pd_wire.decode.DecodeRefusal`) as :func:`_check_status`
    does for that status, and for a failure to read it as :func:`open_decode`; else the
    response, its first chunk left to the reader. The response is closed or given back
    whenever this raises."""
    try:
        await _check_refusal(resp, target)
    except UpstreamError as exc:
        raise map_error("decode", target, exc, f"--decode-timeout {timeout_s:g}s") from None
    return resp


async def _check_refusal(resp: Response, target: Target) -> None:
    try:
        first = await anext(resp, b"")
        if REFUSAL_EVENT.startswith(first[:len(REFUSAL_EVENT)]):  # a refusal, or an empty body
            data = first + await resp.read()
        else:
            resp.unread(first)
            return
    except BaseException:
        resp.close()
        raise
    resp.release()
    try:
        refusal = DecodeRefusal.of_event(data)
    except ValueError:
        refusal = None
    if refusal is None:
        raise BadUpstream(f"decode server {target.origin} answered 200 and then {_short(data) or 'nothing'}")
    raise status_error("decode", target, refusal.status, refusal.error_body(), b"application/json")

"""The two upstream legs of a request, on one shared aiohttp session.

This is the boundary where aiohttp's exceptions become :mod:`pd_router.errors`:
connection failures before an answer -> :class:`Unreachable` (a
:class:`BadUpstream`, retryable for prefill), timeouts -> :class:`UpstreamTimeout`,
upstream 4xx -> :class:`UpstreamRejected` (relayed as is), other failures ->
:class:`BadUpstream`.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp

from pd_router.contract import REQUEST_ID_HEADER
from pd_router.errors import BadUpstream, UpstreamRejected, UpstreamTimeout

_JSON_HEADERS = {"Content-Type": "application/json"}


class Unreachable(BadUpstream):
    """The connection failed before the upstream answered anything."""


def make_session() -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60, enable_cleanup_closed=False)
    return aiohttp.ClientSession(connector=connector, auto_decompress=False, skip_auto_headers=("User-Agent",))


def _short(data: bytes) -> str:
    return data[:300].decode(errors="replace").strip()


async def _post(session: aiohttp.ClientSession, role: str, url: str, body: bytes, request_id: str,
                timeout: aiohttp.ClientTimeout, timeout_name: str) -> aiohttp.ClientResponse:
    try:
        return await session.post(url, data=body, headers={**_JSON_HEADERS, REQUEST_ID_HEADER: request_id},
                                  timeout=timeout)
    except asyncio.TimeoutError:
        raise UpstreamTimeout(f"{role} server {url} did not answer within {timeout_name}") from None
    except (aiohttp.ClientConnectionError, OSError) as exc:
        raise Unreachable(f"{role} server {url} unreachable: {type(exc).__name__}: {exc}") from None


async def check_status(resp: aiohttp.ClientResponse, role: str) -> None:
    """Raise for a non-200 answer: 4xx relayed as is, anything else a 502."""
    if resp.status == 200:
        return
    data = await resp.read()
    resp.release()
    if 400 <= resp.status < 500:
        raise UpstreamRejected(resp.status, data, resp.headers.get("Content-Type", "application/json").encode())
    raise BadUpstream(f"{role} server {resp.url} answered {resp.status}: {_short(data)}")


async def prefill(session: aiohttp.ClientSession, url: str, body: bytes, request_id: str,
                  timeout_s: float) -> dict[str, Any]:
    """POST the rewritten request to a prefill server; its JSON answer."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    resp = await _post(session, "prefill", url, body, request_id, timeout, f"--prefill-timeout {timeout_s:g}s")
    try:
        await check_status(resp, "prefill")
        data = await resp.read()
    except asyncio.TimeoutError:
        raise UpstreamTimeout(f"prefill server {url} did not answer within --prefill-timeout {timeout_s:g}s") \
            from None
    except aiohttp.ClientError as exc:
        raise BadUpstream(f"prefill server {url} failed mid-answer: {type(exc).__name__}: {exc}") from None
    finally:
        resp.release()
    try:
        answer = json.loads(data)
    except ValueError:
        raise BadUpstream(f"prefill server {url} answered invalid JSON: {_short(data)}") from None
    if not isinstance(answer, dict):
        raise BadUpstream(f"prefill server {url} answered a JSON {type(answer).__name__}, not an object")
    return answer


async def open_decode(session: aiohttp.ClientSession, url: str, body: bytes, request_id: str,
                      timeout_s: float) -> aiohttp.ClientResponse:
    """POST to the leased decode server; the open response (status 200 checked)."""
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=timeout_s, sock_read=timeout_s)
    resp = await _post(session, "decode", url, body, request_id, timeout, f"--decode-timeout {timeout_s:g}s")
    try:
        await check_status(resp, "decode")
    except asyncio.TimeoutError:
        resp.close()
        raise UpstreamTimeout(f"decode server {url} did not answer within --decode-timeout {timeout_s:g}s") \
            from None
    except aiohttp.ClientError as exc:
        resp.close()
        raise BadUpstream(f"decode server {url} failed: {type(exc).__name__}: {exc}") from None
    return resp

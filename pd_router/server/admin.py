"""``/admin/backends``: add, remove (drain) and list prefill and decode servers at runtime.

Guarded by the router's ``--api-key`` (``Authorization: Bearer KEY``, compared in constant
time). Without a key the API answers only on a loopback-only bind (``--host 127.0.0.1``);
on any other bind it answers 403. Answers and errors are JSON (errors OpenAI-shaped):

* ``GET /admin/backends`` -> :class:`~pd_router.answers.BackendList`
* ``POST /admin/backends`` ``{"role": "decode", "url": "http://h:8200"}`` -> 201 and the
  :class:`~pd_router.answers.BackendEntry` (200 when the router had it already)
* ``DELETE /admin/backends`` with the same body -> 202 and the entry, ``draining`` until
  its in-flight requests finish (200 and ``null`` when it had none and is gone); 404 if no
  source lists it; 409 if the servers file, a DNS name or ``--prefill``/``--decode`` lists
  it (remove it there).
"""

from __future__ import annotations

import hmac

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response

from pd_router.answers import BackendChange, BackendEntry, BackendList
from pd_router.errors import Conflict, Forbidden, NotFound, Unauthorized
from pd_router.fleet.discovery import Discovery, NotAdminOwned
from pd_router.settings import RouterSettings

PATH = "/admin/backends"


def add_admin_routes(app: FastAPI, settings: RouterSettings, discovery: Discovery) -> None:
    expected = f"Bearer {settings.api_key}" if settings.api_key else None

    def check(request: Request) -> None:
        if not settings.admin_enabled():
            raise Forbidden(f"the admin API needs --api-key when the router listens on {settings.host} "
                            "(not a loopback address)")
        if expected is not None and not hmac.compare_digest(request.headers.get("authorization", ""), expected):
            raise Unauthorized("invalid or missing API key (Authorization: Bearer KEY)")

    def answer(entry: BackendEntry | None, status: int) -> Response:
        body = entry.model_dump_json() if entry is not None else "null"
        return Response(body, status_code=status, media_type="application/json")

    guarded = [Depends(check)]  # before the body is validated: a caller without the key learns nothing

    @app.get(PATH, dependencies=guarded)
    async def list_backends() -> BackendList:
        return discovery.listing()

    @app.post(PATH, dependencies=guarded)
    async def add_backend(change: BackendChange) -> Response:
        new = discovery.add_admin(change.role, change.url)
        return answer(discovery.entry(change.role, change.url), 201 if new else 200)

    @app.delete(PATH, dependencies=guarded)
    async def remove_backend(change: BackendChange) -> Response:
        try:
            listed = discovery.remove_admin(change.role, change.url)
        except NotAdminOwned as exc:
            raise Conflict(f"{change.role} server {change.url} comes from {', '.join(exc.sources)}; "
                           "remove it there", param="url") from None
        if not listed:
            raise NotFound(f"no {change.role} server {change.url} was added through the admin API", param="url")
        entry = discovery.entry(change.role, change.url)
        return answer(entry, 202 if entry is not None else 200)

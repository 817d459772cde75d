"""``GET /version``: the router's build info and its backends', each read from the
backend's own ``/metrics`` (``*_build_info``: vLLM's ``vllm:tilert_build_info`` through the
connector's stats, the decode server's ``decode_server_build_info``) when asked."""

from __future__ import annotations

import asyncio

import httpx

from pd_build.prometheus import parse
from pd_router.answers import BackendBuild, VersionReport
from pd_router.state import RouterState


async def _backend(client: httpx.AsyncClient, role: str, url: str) -> BackendBuild:
    try:
        resp = await client.get(f"{url}/metrics")
        resp.raise_for_status()
    except httpx.HTTPError as exc:
        return BackendBuild.model_validate(
            {"role": role, "url": url, "build": [], "error": f"GET /metrics: {exc!r}"}
        )
    found = [info for infos in parse(resp.text).values() for info in infos]
    error = None if found else "its /metrics has no *_build_info"
    return BackendBuild.model_validate({"role": role, "url": url, "build": found, "error": error})


async def version_report(state: RouterState) -> VersionReport:
    asks = [("prefill", p.url) for p in state.backends.prefill] + [("decode", d.url) for d in state.backends.decode]
    found = await asyncio.gather(*(_backend(state.client, role, url) for role, url in asks))
    return VersionReport(router=state.build, backends=list(found))

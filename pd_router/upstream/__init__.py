"""HTTP to the prefill and decode servers, on the hot path.

Reading order: :mod:`~pd_router.upstream.calls` (the calls a request makes, and where
transport failures become :mod:`pd_router.errors`), :mod:`~pd_router.upstream.connections`
(keep-alive connections per origin), :mod:`~pd_router.upstream.rawhttp` (HTTP/1.1 as asyncio
protocols, parsed by httptools).
"""

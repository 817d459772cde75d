"""The router's ASGI application around the request path.

Reading order: :mod:`~pd_router.server.app` (the routes: the completion routes go to
:class:`pd_router.request.accept.CompletionHandler`; probes, ``/metrics``, ``/v1/models``),
:mod:`~pd_router.server.serve` (uvicorn, HTTP limits, the drain on SIGTERM),
:mod:`~pd_router.server.admin` (``/admin/backends``), :mod:`~pd_router.server.tokens`
(``/tokenize``, ``/detokenize``, ``/v1/messages/count_tokens``), :mod:`~pd_router.server.versions`
(``/version``).
"""

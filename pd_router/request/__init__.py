"""One request's path through the router, stage by stage (docs/architecture.md).

Reading order, the order a request runs them: :mod:`~pd_router.request.stages` (the stage
list), :mod:`~pd_router.request.accept` (validating: the edge), :mod:`~pd_router.request.checks`
(the :class:`~pd_router.request.checks.ValidRequest` made there), :mod:`~pd_router.request.fanout`
(``n > 1``), :mod:`~pd_router.request.attempts` (queued, then one attempt after another),
:mod:`~pd_router.request.legs` (the decode request that holds the slot, the prefill on its 200),
:mod:`~pd_router.request.prefill` (prefill), :mod:`~pd_router.request.relay` (decode),
:mod:`~pd_router.request.migration` (migrating). Below them: :mod:`~pd_router.request.context`
(the request's context and one attempt), :mod:`~pd_router.request.observe` (trace, access log,
metrics), :mod:`~pd_router.request.logprobs` (what the router merges into an answer),
:mod:`~pd_router.request.trail` (the tokens an answer gave so far), :mod:`~pd_router.request.keys`
(a request's conversation keys: the KV a decode server may keep for its next turn).
"""

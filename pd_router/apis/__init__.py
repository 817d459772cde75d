"""The client APIs' bodies: OpenAI's completions, and the APIs served as a chat completion.

Reading order: :mod:`~pd_router.apis.completions` (the chat and text completion bodies the
router accepts, and its two rewrites of them: the prefill's body and the decode's),
:mod:`~pd_router.apis.responses` and :mod:`~pd_router.apis.responses_out` (``/v1/responses``
in and out), :mod:`~pd_router.apis.messages` with :mod:`~pd_router.apis.messages_blocks` and
:mod:`~pd_router.apis.messages_out` (Anthropic's ``/v1/messages`` in and out). They import
nothing of the request path.
"""

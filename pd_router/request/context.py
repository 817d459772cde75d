"""One request's context in the router (:class:`RequestContext`: the request's values, set
once, and what each stage sets), one attempt of it on a decode slot (:class:`Attempt`), and the
ids of its KV handoffs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pd_http.chunk_writer import ChunkWriter
from pd_http.tracing import Span
from pd_router.asgi import Send, respond
from pd_router.errors import RouterError
from pd_router.request.checks import ValidRequest
from pd_router.request.keys import ConversationKeys
from pd_router.request.stages import Stage
from pd_router.request.trail import Trail
from pd_router.slots.fair import Place
from pd_router.slots.pool import Slot
from pd_router.tenants import DEFAULT_TENANT, Tenant
from pd_wire.handoff import ResumeFrom
from pd_wire.requests import Endpoint

if TYPE_CHECKING:
    from opentelemetry.context import Context


DEFAULT = Tenant(DEFAULT_TENANT, DEFAULT_TENANT)


def attempt_handoff_id(request_id: str, attempt: int) -> str:
    """The KV handoff id of a request's ``attempt``-th prefill: the request id, then a new
    id per retry, so that a retry's handoff is never confused with (or cancelled as) an
    earlier one's on the decode server."""
    return request_id if attempt == 0 else f"{request_id[:240]}#{attempt}"


@dataclass(eq=False)
class RequestContext:
    """One request on its way through the router: what each stage sets, what the access
    log, the metrics and the trace read at its end."""

    endpoint: Endpoint
    request_id: str
    start: float
    send: Send
    stage: Stage = Stage.VALIDATING
    valid: ValidRequest | None = None  # the request as validated (:attr:`request`), once its stage passed
    model: str = ""  # the model_name label: set once the model is known to be served
    prompt_tokens: int = 0  # as prefill counted them (our connector's handoff)
    ttft: float | None = None  # seconds from ``start`` to the first token relayed (the whole answer unstreamed)
    slot_wait: float | None = None  # seconds from ``start`` to its first decode slot (the end of its queue wait)
    status: int = 0
    error_type: str = ""
    started: bool = False  # response headers sent
    finished: bool = False  # last byte sent (or being sent)
    disconnected: bool = False
    cut_off: bool = False  # ended by the router's drain (--drain-timeout passed)
    raw: bytes = b""  # the client's body as received
    writer: ChunkWriter | None = None  # writes the streamed answer's chunks to the client (None: ``send`` does)
    prompt_logprobs: Any = None  # prefill's, for a client that asked (merged into the decode answer)
    echo_logprobs: Any = None  # a completion's echoed prompt's logprobs (before the generated tokens')
    span: Span | None = None  # the request's root span (tracing on)
    trace: Context | None = None  # its context: the parent of the stage spans
    created: int = 0  # the answer's ``created`` (the same on every decode server it runs on)
    trail: Trail | None = None  # the output tokens the client's answer holds (a decode server of ours)
    prompt_ids: list[int] | None = None  # the prompt's token ids, once a migration needed them
    resume: ResumeFrom | None = None  # the attempt continues a sequence cut on another decode server
    migrations: int = 0  # decode servers this answer moved from
    lost_at: float | None = None  # perf_counter() when its decode server was found lost, until the move's output
    lost_from: str = ""  # that server
    lost_error: RouterError | None = None  # what was seen of it
    resume_reason: str = ""  # the loss's reason (pd_router_migrations_total)
    tenant: Tenant = DEFAULT  # whose request it is (pd_router.tenants)
    priority: int = 0  # the client's (vLLM's field: lower is served sooner)
    place: Place | None = None  # its place in the decode queues, from its first wait on (pd_router.slots.fair)
    keeps: bool = True  # its KV may be kept for a next turn (not a choice of a list of prompts)
    keys: ConversationKeys | None = None  # its conversation keys (pd_router.request.keys), set before its first attempt
    continues: str | None = None  # the kept key its attempt's decode request continues (HandoffClaim.keep)

    @property
    def request(self) -> ValidRequest:
        """The request as validated: read by every stage after :attr:`Stage.VALIDATING`."""
        assert self.valid is not None  # set by the validation (pd_router.request.accept)
        return self.valid

    async def fail(self, err: RouterError) -> None:
        self.status, self.error_type = err.status, err.type
        if self.started:  # the stream began: end it with an error event
            self.finished = True
            await self.send({"type": "http.response.body", "body": err.sse_event(), "more_body": False})
            return
        self.finished = True
        ctype = getattr(err, "content_type", b"application/json")
        await respond(
            self.send,
            err.status,
            err.body(),
            ctype,
            [(b"x-request-id", self.request_id.encode()), *err.headers()],
        )


@dataclass(eq=False)
class Attempt:
    """One try of a request on the decode slot its decode request took
    (:mod:`pd_router.request.attempts`): what changes from one attempt to the next. The stages
    after the queue take ``(state, ctx, attempt)``."""

    number: int  # 0 for the first; each retry and each move of the answer counts one
    handoff_id: str  # the KV handoff's id (:func:`attempt_handoff_id`)
    slot: Slot
    body: dict[str, Any]  # the request's body as this attempt's servers get it (what its decode server needs added)
    with_kv: bool  # the first token travels with the KV (``HandoffClaim.result == "with_kv"``)

"""A request's stages in the router, in the order it runs them (docs/architecture.md).

``RequestContext.stage`` is the one the request is in: the access log's ``stage``, the label
under which a failure or a client leaving is counted. Each member names the module that runs
it; :mod:`pd_router.request.accept` runs the first and hands the rest to
:mod:`pd_router.request.attempts`, which runs them once per attempt.
"""

from __future__ import annotations

from enum import StrEnum


class Stage(StrEnum):
    VALIDATING = "validating"  # accept: key, tenant, id, body (apis/), priority, checks; fanout for n > 1
    QUEUED = "queued"  # attempts -> slots/: the attempt's decode request takes a decode slot
    PREFILL = "prefill"  # prefill (legs runs it beside the open decode answer): the KV handed off
    DECODE = "decode"  # legs -> relay: the decode server's answer relayed to the client
    MIGRATING = "migrating"  # migration: an answer whose decode server was lost moves to another

"""The router's calls to the decode servers' lease endpoints (contract:
:mod:`pd_wire.decode`), on the hot path's raw connection pool."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from time import perf_counter

from pydantic import BaseModel, ValidationError

from pd_router.errors import UpstreamRejected
from pd_router.http_pool import ConnectionPool
from pd_router.rawhttp import ConnectFailed, Response, UpstreamError
from pd_router.upstream import Target, call
from pd_wire.decode import (
    LEASE_PATH,
    LEASE_RELEASE_PATH,
    LEASE_RENEW_PATH,
    LeaseGrant,
    LeaseIds,
    LeaseRenewed,
    LeaseRequest,
)

CALL_TIMEOUT_S = 5.0  # a renew or release, or the answer of a lease request past its wait
# a lease asked without waiting is answered at once by a live server (a round trip): one
# that says nothing for this long is hung (SIGSTOPped, its loop stuck) and is marked down
IMMEDIATE_ANSWER_S = 2.0


@dataclass(frozen=True)
class Answer:
    status: int  # 0: no answer (unreachable, timed out, invalid)
    grant: LeaseGrant | None = None
    rtt: float = 0.0
    immediate: bool = False  # asked without waiting (wait_s 0)
    unreachable: str | None = None  # the connection failed before any answer: why
    opened: Response | None = None  # a decode request holding its slot, granted: its answer, open
    # a decode request refused for what it asks (a 4xx other than 409 and 429): the request's answer
    rejected: UpstreamRejected | None = None
    free: int = 0  # with ``opened``: the server's free slots after that grant (as ``LeaseGrant.free``)

    @property
    def granted(self) -> bool:
        return self.grant is not None or self.opened is not None


class LeaseClient:
    def __init__(self, connections: Callable[[], ConnectionPool], holder: str) -> None:
        self._connections = connections
        self.holder = holder

    async def _post(self, target: Target, path: str, body: BaseModel, timeout: float) -> tuple[int, bytes]:
        return await call(self._connections(), target, path, body.model_dump_json().encode(), timeout)

    async def acquire(self, target: Target, lease_id: str, wait_s: float, arrived: float,
                      replaces: str | None = None) -> Answer:
        """A lease, or the status that refused it (429 busy or queue timeout, 409 the id is in
        use there, 503 draining; 0 no answer). ``arrived``: when the request came to this
        router (``perf_counter``); ``replaces``: a lease of ours there, given back as this
        request queues (a swap). Cancelling it closes the connection, which takes the request
        out of the server's queue."""
        t0 = perf_counter()
        body = LeaseRequest(lease_id=lease_id, wait_s=wait_s, holder=self.holder, arrived_at=arrived, sent_at=t0,
                            replaces=replaces)
        limit = IMMEDIATE_ANSWER_S if wait_s == 0 else wait_s + CALL_TIMEOUT_S
        try:
            status, data = await self._post(target, LEASE_PATH, body, limit)
        except ConnectFailed as exc:
            return Answer(0, rtt=perf_counter() - t0, unreachable=str(exc))
        except TimeoutError:  # connected, and nothing answered: hung
            return Answer(0, rtt=perf_counter() - t0, unreachable=f"no answer to a lease request within {limit:g}s")
        except UpstreamError:
            return Answer(0, rtt=perf_counter() - t0)
        if status != 200:
            return Answer(status, rtt=perf_counter() - t0)
        try:
            return Answer(200, LeaseGrant.model_validate_json(data), perf_counter() - t0, wait_s == 0)
        except ValidationError:
            return Answer(0, rtt=perf_counter() - t0)

    async def renew(self, target: Target, lease_ids: list[str]) -> list[str] | None:
        """The ids the server no longer holds; None: no answer."""
        try:
            status, data = await self._post(target, LEASE_RENEW_PATH, LeaseIds(lease_ids=lease_ids), CALL_TIMEOUT_S)
            return LeaseRenewed.model_validate_json(data).unknown if status == 200 else None
        except (UpstreamError, TimeoutError, ValidationError):
            return None

    async def release(self, target: Target, lease_ids: list[str]) -> bool:
        try:
            status, _ = await self._post(target, LEASE_RELEASE_PATH, LeaseIds(lease_ids=lease_ids), CALL_TIMEOUT_S)
        except (UpstreamError, TimeoutError):
            return False
        return status == 200

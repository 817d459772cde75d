"""A miniature of vLLM 0.32's engine loop around a KV connector, for unit tests of the
connector's scheduler and worker sides with fakes vLLM cannot take: a sender and
admissions that fail on cue, several worker ranks, steps under the test's control.

Scheduling is not what it is for: chunked prefill, prefix-cache hits, preemption, aborts
and async scheduling run under vLLM's own ``Scheduler`` / ``AsyncScheduler`` in
``tests/connector/vllm/test_real_scheduler.py`` (``real_engine.py``). Where the two
differed, this one was made to follow vLLM: a waiting request is admitted only when its
whole prompt fits in the free blocks (vLLM 0.32's ``scheduler_reserve_full_isl``). What it
still leaves out: prefix caching, preemption, the batch queue of async scheduling.

It keeps the orders that matter (read from vllm/v1/core/sched/scheduler.py and
vllm/v1/worker/gpu_model_runner.py with a speculative config):

* scheduling: ``on_new_request`` when a request arrives; a waiting request is skipped
  while ``get_num_new_matched_tokens`` answers None, or while its whole prompt does not
  fit; ``update_state_after_alloc`` when it gets its blocks, then ``build_connector_meta``
  once per step; chunked prefill under a token budget;
* execution: bind metadata, per main layer the KV write then ``save_kv_layer``, then
  ``get_finished(finished_req_ids)`` (built before the drafter), then the MTP layer's
  write + ``save_kv_layer``, then ``wait_for_save``. ``saves_layer(i)`` False models
  vLLM's CUDA attention for GLM-5.1, which never calls ``save_kv_layer``;
* output: for each request whose prompt is done, append the sampled token; finished
  requests go through ``request_finished`` (blocks freed unless it says True) *before*
  ``update_connector_output`` gets the step's ``finished_sending``.

KV content is synthetic and position-coded: token ``t`` of request seed ``s`` in layer
``l`` holds ``kv_value(l, s, t)`` in every element, so a mix-up of blocks, layers or
positions is visible in what the fake sender received.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

BLOCK = 16


def kv_value(layer: int, seed: int, pos: int) -> float:
    return float(layer * 1000 + seed * 100 + pos % 97)


@dataclass
class FakeRequest:
    request_id: str
    prompt_token_ids: list[int]
    kv_transfer_params: dict[str, Any] | None
    max_tokens: int = 1
    seed: int = 1
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    scheduled_before: bool = False

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


class MiniEngine:
    def __init__(
        self,
        scheduler: Any,
        workers: list[Any],
        *,
        num_layers: int,
        num_blocks: int = 64,
        token_budget: int = 64,
        dtype: torch.dtype = torch.bfloat16,
        width: int = 576,
        saves_layer: Any = lambda layer: True,
    ) -> None:
        self.scheduler = scheduler
        self.saves_layer = saves_layer
        self.workers = workers
        self.token_budget = token_budget
        self.free_blocks = list(range(num_blocks))
        self.num_blocks = num_blocks
        self.layer_names = [f"model.layers.{i}.self_attn.attn" for i in range(num_layers)]
        # one cache per worker rank (TP ranks hold the same MLA KV); vLLM's CPU MLA shape
        self.caches = [
            {n: torch.zeros(num_blocks, 1, BLOCK, width, dtype=dtype) for n in self.layer_names}
            for _ in workers
        ]
        self.waiting: list[FakeRequest] = []
        self.running: list[FakeRequest] = []
        self.held: dict[str, FakeRequest] = {}
        self.finished_req_ids: set[str] = set()
        self.results: dict[str, tuple[bool, dict | None]] = {}
        self.steps = 0

    def register(self) -> None:
        for worker, caches in zip(self.workers, self.caches):
            worker.register_kv_caches(caches)

    def add(self, request: FakeRequest) -> None:
        self.waiting.append(request)
        self.scheduler.on_new_request(request)

    def abort(self, req_id: str) -> None:
        for queue in (self.waiting, self.running):
            for req in list(queue):
                if req.request_id == req_id:
                    queue.remove(req)
                    self._finish(req)

    # -- one engine step ----------------------------------------------------------------

    def step(self) -> None:
        self.steps += 1
        budget = self.token_budget
        new_reqs, cached_ids, cached_new_blocks, cached_computed, scheduled = [], [], [], [], {}
        for req in self.running:
            remaining = max(0, req.num_prompt_tokens - req.num_computed_tokens)
            n = min(remaining, budget) if remaining else min(1, budget)  # prefill chunk or one decode token
            if n <= 0:
                continue
            added = self._alloc(req, req.num_computed_tokens + n)
            cached_ids.append(req.request_id)
            cached_new_blocks.append((added,) if added else None)
            cached_computed.append(req.num_computed_tokens)
            scheduled[req.request_id] = n
            budget -= n
        skipped = []
        while self.waiting and budget > 0:
            req = self.waiting.pop(0)
            matched, _ = self.scheduler.get_num_new_matched_tokens(req, 0)
            if matched is None or -(-req.num_prompt_tokens // BLOCK) > len(self.free_blocks):
                skipped.append(req)  # the connector cannot tell yet, or the prompt does not fit: later
                continue
            n = min(req.num_prompt_tokens, budget)
            self._alloc(req, n)
            self.scheduler.update_state_after_alloc(req, list(req.block_ids), 0)
            new_reqs.append(
                SimpleNamespace(
                    req_id=req.request_id, block_ids=(list(req.block_ids),), num_computed_tokens=0
                )
            )
            scheduled[req.request_id] = n
            self.running.append(req)
            budget -= n
        self.waiting[:0] = skipped
        out = SimpleNamespace(
            scheduled_new_reqs=new_reqs,
            num_scheduled_tokens=scheduled,
            scheduled_cached_reqs=SimpleNamespace(
                req_ids=cached_ids,
                resumed_req_ids=set(),
                new_block_ids=cached_new_blocks,
                num_computed_tokens=cached_computed,
            ),
            finished_req_ids=self.finished_req_ids,
        )
        self.finished_req_ids = set()
        plan = self.scheduler.build_step(out)
        finished_sending = self._execute(plan, out)
        self._update_from_output(scheduled, finished_sending)

    def _execute(self, plan: Any, out: Any) -> set[str]:
        counts: dict[str, int] = {}
        by_id = {r.request_id: r for r in self.running}
        for worker, caches in zip(self.workers, self.caches):
            worker.bind(plan)
            for i, name in enumerate(self.layer_names[:-1]):
                self._write(caches[name], i, by_id, out.num_scheduled_tokens)
                if self.saves_layer(i):
                    worker.save_kv_layer(name, caches[name])
            done, _ = worker.get_finished(out.finished_req_ids)
            mtp = self.layer_names[-1]
            self._write(caches[mtp], len(self.layer_names) - 1, by_id, out.num_scheduled_tokens)
            if self.saves_layer(len(self.layer_names) - 1):
                worker.save_kv_layer(mtp, caches[mtp])
            worker.wait_for_save()
            for req_id in done or ():
                counts[req_id] = counts.get(req_id, 0) + 1
        return {r for r, c in counts.items() if c == len(self.workers)}

    def _write(self, cache: torch.Tensor, layer: int, by_id: dict, scheduled: dict[str, int]) -> None:
        for req_id, n in scheduled.items():
            req = by_id[req_id]
            for t in range(req.num_computed_tokens, req.num_computed_tokens + n):
                cache[req.block_ids[t // BLOCK], 0, t % BLOCK] = kv_value(layer, req.seed, t)

    def _update_from_output(self, scheduled: dict[str, int], finished_sending: set[str]) -> None:
        for req in list(self.running):
            n = scheduled.get(req.request_id, 0)
            if not n:
                continue
            if req.num_computed_tokens >= req.num_prompt_tokens:
                req.output_token_ids.append(7 + len(req.output_token_ids))
                req.num_computed_tokens += n
            else:
                req.num_computed_tokens += n
                if req.num_computed_tokens >= req.num_prompt_tokens:
                    req.output_token_ids.append(100 + req.seed)
            if len(req.output_token_ids) >= req.max_tokens:
                self.running.remove(req)
                self._finish(req)
        self.scheduler.update_connector_output(finished_sending)
        for req_id in finished_sending:
            req = self.held.pop(req_id)
            self._free(req)

    def _finish(self, req: FakeRequest) -> None:
        delay, params = self.scheduler.request_finished(req, list(req.block_ids))
        self.results[req.request_id] = (delay, params)
        self.finished_req_ids.add(req.request_id)
        if delay:
            self.held[req.request_id] = req
        else:
            self._free(req)

    def _alloc(self, req: FakeRequest, num_tokens: int) -> list[int]:
        need = -(-num_tokens // BLOCK) - len(req.block_ids)
        if need > len(self.free_blocks):
            raise RuntimeError("fake engine out of blocks")
        added = [self.free_blocks.pop(0) for _ in range(max(need, 0))]
        req.block_ids.extend(added)
        return added

    def _free(self, req: FakeRequest) -> None:
        self.free_blocks.extend(req.block_ids)
        req.block_ids = []

    def run_until_idle(self, max_steps: int = 100) -> None:
        for _ in range(max_steps):
            if not (self.waiting or self.running or self.held or self.finished_req_ids):
                return
            self.step()
        raise AssertionError(f"engine not idle after {max_steps} steps: held={sorted(self.held)}")

    def free_block_count(self) -> int:
        return len(self.free_blocks)

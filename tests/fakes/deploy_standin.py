"""Stand-in for the PD stack's servers in deploy tests: ``deploy_standin.py -m MODULE ARGS``.

The deploy tests point a recipe's ``python`` at a wrapper running this file, so the exact
argv built by ``pd_deploy.commands`` reaches it. It records that argv, its
environment and when it started and became ready into ``$STANDIN_DIR/<role>.json``, then
serves on ``--host``/``--port``:

* vLLM prefill: ``/health`` 200 at once;
* decode server: ``/health`` 200, ``/ready`` 200 only after ``$STANDIN_DECODE_DELAY`` s;
* router: ``/ready`` 200 only while its ``--prefill`` /health and ``--decode`` /ready
  (and those of the servers in its ``--servers-file``) answer 200 (like the real router's
  readiness), ``/v1/chat/completions`` answers an OpenAI-shaped completion naming the
  request's model.

SIGTERM ends it and records ``stopped``. A module that is not one of the servers (the weight
conversion's ``decode_server.model_dir``) runs for real.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from pd_settings.servers import read_servers_file

ROLES = {"vllm.entrypoints.openai.api_server": "prefill", "decode_server": "decode", "pd_router": "router"}


def _arg(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == flag]


def _ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


class StandIn:
    def __init__(self, argv: list[str]) -> None:
        self.argv = argv
        self.role = ROLES[argv[argv.index("-m") + 1]]
        self.started = time.time()
        self.delay = float(os.environ.get("STANDIN_DECODE_DELAY", "0")) if self.role == "decode" else 0.0
        self.record_path = Path(os.environ["STANDIN_DIR"]) / f"{self.role}.json"
        self.record = {"argv": argv, "started": self.started, "ready": None, "stopped": None, "pid": os.getpid(),
                       "env": {k: v for k, v in os.environ.items() if k.startswith(("HF_", "VLLM_", "UCX_", "NIXL_"))}}
        self.lock = threading.Lock()
        self.save()

    def save(self) -> None:
        with self.lock:
            tmp = self.record_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.record))
            tmp.replace(self.record_path)

    def ready(self) -> bool:
        if self.role == "router":
            prefill, decode = _arg(self.argv, "--prefill"), _arg(self.argv, "--decode")
            for path in _arg(self.argv, "--servers-file"):
                listed = read_servers_file(path)
                prefill, decode = prefill + list(listed.prefill), decode + [d.url for d in listed.decode]
            up = all(_ok(u + "/health") for u in prefill) and all(_ok(u + "/ready") for u in decode)
        else:
            up = time.time() - self.started >= self.delay
        if up and self.record["ready"] is None:
            self.record["ready"] = time.time()
            self.save()
        return up


def _handler(app: StandIn) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def _send(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802
            if self.path == "/health":  # vLLM's only gate: healthy means ready
                if app.role == "prefill":
                    app.ready()
                self._send(200, {"status": "ok"})
            elif self.path == "/ready":
                ok = app.ready()
                self._send(200 if ok else 503, {"ready": ok})
            else:
                self._send(404, {"error": {"message": "not found", "type": "not_found", "param": None, "code": 404}})

        def do_POST(self) -> None:  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))) or b"{}")
            if app.role == "router" and self.path == "/v1/chat/completions" and app.ready():
                self._send(200, {"id": "chatcmpl-standin", "object": "chat.completion", "model": body.get("model"),
                                 "choices": [{"index": 0, "finish_reason": "stop",
                                              "message": {"role": "assistant", "content": "stand-in"}}],
                                 "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})
            else:
                self._send(503, {"error": {"message": "not ready", "type": "unavailable", "param": None,
                                           "code": 503}})

    return Handler


def main() -> None:
    module = sys.argv[sys.argv.index("-m") + 1] if "-m" in sys.argv else None
    if module not in ROLES:  # not a server (e.g. the conversion's model-dir check): the real module
        import runpy

        sys.argv = [module or "", *sys.argv[sys.argv.index("-m") + 2:]] if module else sys.argv[:1]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return
    app = StandIn(sys.argv[1:])
    host = _arg(app.argv, "--host")[0]
    port = int(_arg(app.argv, "--port")[0])
    server = ThreadingHTTPServer((host, port), _handler(app))

    def stop(*_: object) -> None:
        app.record["stopped"] = time.time()
        app.save()
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    server.serve_forever(poll_interval=0.2)


if __name__ == "__main__":
    main()

"""``python -m pd_deploy.stack`` (console script ``pd-stack``): run the whole PD stack locally.

With no ``--model-dir`` it generates the embedded default, the tiny GLM-family model
(MLA + MoE + 1 MTP layer), once, under ``--cache-dir``.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import time
from pathlib import Path
from types import FrameType

from pd_deploy.stack.launcher import Stack, StackConfig, usage_text
from pd_deploy.stack.ports import PortInUse, check_free

REPO = Path(__file__).resolve().parents[2]
TINY_MODEL_NAME = "tiny-glm"  # the served name of the generated default model


def _env_default(name: str, default: str) -> str:
    import os

    return os.environ.get(f"PD_STACK_{name.upper()}", default)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pd-stack", description=__doc__,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    model_env = _env_default("model_dir", "")
    p.add_argument("--model-dir", type=Path, default=Path(model_env) if model_env else None,
                   help="HF checkpoint to serve (default: the generated tiny model). Env PD_STACK_MODEL_DIR")
    p.add_argument("--served-model-name", default=_env_default("served_model_name", "") or None,
                   help=f"model name clients use (default: {TINY_MODEL_NAME!r} for the tiny model, else the directory name)")
    p.add_argument("--cache-dir", type=Path, default=Path(_env_default("cache_dir", str(REPO / ".cache" / "tiny-model"))),
                   help="where the tiny model is generated and cached")
    p.add_argument("--seed", type=int, default=0, help="tiny model seed")
    p.add_argument("--layers", type=int, default=2, help="tiny model main layers (+1 MTP)")
    p.add_argument("--log-dir", type=Path, default=Path(_env_default("log_dir", str(REPO / "run" / "logs"))))
    p.add_argument("--host", default=_env_default("host", "127.0.0.1"), help="bind address of every server")
    p.add_argument("--router-port", type=int, default=int(_env_default("router_port", "8000")))
    p.add_argument("--prefill-port", type=int, default=int(_env_default("prefill_port", "8100")))
    p.add_argument("--decode-port", type=int, default=int(_env_default("decode_port", "8200")),
                   help="HTTP port of the first decode server (+i for the i-th)")
    p.add_argument("--kv-port", type=int, default=int(_env_default("kv_port", "9100")),
                   help="KV control port of the first decode server (+i for the i-th)")
    p.add_argument("--num-decode", type=int, default=int(_env_default("num_decode", "1")))
    p.add_argument("--engine", choices=["reference", "tilert"], default=_env_default("engine", "reference"))
    p.add_argument("--decode-slots", type=int, default=int(_env_default("decode_slots", "1")))
    p.add_argument("--max-seq-len", type=int, default=int(_env_default("max_seq_len", "4096")))
    p.add_argument("--no-prefill-mtp", dest="prefill_mtp", action="store_false",
                   help="start vLLM without MTP (to see the handshake reject it)")
    p.add_argument("--start-timeout", type=float, default=300.0, help="seconds per readiness gate")
    return p


def validate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    for name in ("router_port", "prefill_port", "decode_port", "kv_port"):
        value = getattr(args, name)
        if not 1 <= value <= 65535:
            parser.error(f"--{name.replace('_', '-')}={value}: must be a TCP port (1..65535)")
    for name in ("num_decode", "decode_slots", "max_seq_len", "layers"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)}: must be >= 1")
    if args.engine == "tilert" and args.decode_slots != 1:
        parser.error(f"--decode-slots={args.decode_slots}: the tilert engine serves batch size 1")
    if args.model_dir is not None and not (args.model_dir / "config.json").is_file():
        parser.error(f"--model-dir={args.model_dir}: no config.json there")


def _config(args: argparse.Namespace, model_dir: Path, served: str | None) -> StackConfig:
    return StackConfig(model_dir=model_dir.resolve(), log_dir=args.log_dir.resolve(), host=args.host,
                       router_port=args.router_port, prefill_port=args.prefill_port, decode_port=args.decode_port,
                       kv_port=args.kv_port, num_decode=args.num_decode, engine=args.engine,
                       decode_slots=args.decode_slots, max_seq_len=args.max_seq_len, prefill_mtp=args.prefill_mtp,
                       start_timeout_s=args.start_timeout, served_model_name=served)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    validate(args, parser)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s pd-stack %(message)s", datefmt="%H:%M:%S")
    log = logging.getLogger("pd_stack")
    model_dir, served = args.model_dir, args.served_model_name
    try:  # before the model is generated: a busy port fails at once
        check_free(_config(args, model_dir or args.cache_dir, served).port_needs())
    except PortInUse as exc:
        log.error("start-up failed: %s", exc)
        return 1
    if model_dir is None:
        served = served or TINY_MODEL_NAME
        from decode_server.tiny_model import ensure_tiny_model

        log.info("tiny model: generating or reusing under %s", args.cache_dir)
        model_dir = ensure_tiny_model(args.cache_dir, seed=args.seed, layers=args.layers)
        log.info("tiny model: %s", model_dir)
    cfg = _config(args, model_dir, served)
    stack = Stack(cfg)

    def _terminate(signum: int, _frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _terminate)
    # Ctrl-C stops the stack even when started from a shell that ignores SIGINT for
    # background jobs (the children inherit an ignored SIGINT; Python then installs no handler)
    signal.signal(signal.SIGINT, _terminate)
    try:
        stack.start()
        print(usage_text(cfg), flush=True)
        while True:
            dead = stack.dead()
            if dead:
                log.error("%s exited with %s; stopping the stack. Log tail:\n%s", dead[0].name,
                          dead[0].proc.returncode, dead[0].log_tail())
                return 1
            time.sleep(0.5)
    except KeyboardInterrupt:
        log.info("stopping")
        return 0
    except Exception as exc:  # a failed gate: say why, stop everything
        log.error("start-up failed: %s", exc)
        return 1
    finally:
        stack.stop()
        log.info("all processes stopped")


if __name__ == "__main__":
    sys.exit(main())

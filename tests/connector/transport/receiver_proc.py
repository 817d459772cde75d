"""A KV receiver in its own process, for two-process tests and the benchmark.

Writes its endpoint to ``--endpoint-file``; then for each ``--handoff`` waits for it and
appends one JSON line to ``--result-file``: byte comparison against the synthetic KV of
``--seed`` (or just the arrival time with ``--no-check``), then releases it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

from connector.layout import cpu_mla_layout, glm5_fp8_ds_mla_layout
from connector.receiver import KVReceiver, ReceiverError, ReceiverSettings
from tests.connector.transport.synthetic import mismatches


async def main(args: argparse.Namespace) -> None:
    layout = (glm5_fp8_ds_mla_layout(args.layers, args.mtp) if args.profile == "glm5"
              else cpu_mla_layout(args.layers, args.mtp))
    secret = args.secret_file.read_bytes().strip() if args.secret_file else None
    receiver = KVReceiver(ReceiverSettings(layout=layout, max_tokens=args.max_tokens, slots=args.slots,
                                           agent_name=args.agent_name, host=args.host, secret=secret))
    await receiver.start()
    tmp = Path(str(args.endpoint_file) + ".tmp")
    tmp.write_text(receiver.endpoint)  # noqa: ASYNC240 - once, before serving
    tmp.rename(args.endpoint_file)  # noqa: ASYNC240
    try:
        for hid in args.handoff:
            result: dict = {"handoff_id": hid}
            try:
                kv = await receiver.wait_for(hid, args.timeout)
                result["arrived"] = time.time()
                result["num_tokens"] = kv.num_tokens
                result["layers"] = len(kv.layers)
                if not args.no_check:
                    result["mismatches"] = mismatches(kv.layers, layout, kv.num_tokens, args.seed)
                receiver.release(hid)
            except ReceiverError as exc:
                result["error"] = f"{type(exc).__name__}: {exc}"
            result["busy_slots"] = receiver.busy_slots()
            result["peers"] = [p.model_dump() for p in receiver.peers()]
            with open(args.result_file, "a") as f:  # noqa: ASYNC230 - one short line
                f.write(json.dumps(result) + "\n")
        await asyncio.sleep(args.linger)
    finally:
        await receiver.stop()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", choices=["glm5", "cpu-mla"], default="glm5")
    ap.add_argument("--layers", type=int, default=78)
    ap.add_argument("--mtp", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=2048)
    ap.add_argument("--slots", type=int, default=1)
    ap.add_argument("--agent-name", default=None)
    ap.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    ap.add_argument("--secret-file", type=Path, default=None, help="the KV channel's secret (off loopback)")
    ap.add_argument("--endpoint-file", type=Path, required=True)
    ap.add_argument("--result-file", type=Path, required=True)
    ap.add_argument("--handoff", action="append", default=[])
    ap.add_argument("--timeout", type=float, default=30.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--linger", type=float, default=0.0)
    asyncio.run(main(ap.parse_args()))

"""A real KVReceiver in its own process for the vLLM connector tests.

Writes its endpoint to ``--endpoint-file``; mirrors ``peers()`` to ``OUT/peers.json``;
writes ``OUT/admitted`` when a handoff first holds a slot (and with ``--die-on-admit``
SIGKILLs itself right then: a receiver dying mid-transfer) and ``OUT/released`` when no
slot is held any more after that, ``OUT/complete`` when a handoff's KV first landed whole.
With ``--admit-delay S`` it answers each Admit S seconds
late (a slow decode server), writing ``OUT/admit-seen`` when the Admit comes in. The
receiver logs (WARNING, to the log file) every handoff it frees because nobody claimed it. For each ``--handoff`` in
order it waits (``--timeout``), dumps every layer's ``kv`` plane to
``OUT/<handoff>/layer<i>.npy`` (float32), releases it, and appends one JSON line to
``OUT/results.jsonl`` (error, busy slots after release).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
from pathlib import Path

import numpy as np
from pydantic import BaseModel

from connector.layout import cpu_mla_layout
from connector.protocol import Admit, Admitted
from connector.receiver import KVReceiver, ReceiverError, ReceiverSettings


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.rename(path)


async def watch(receiver: KVReceiver, out: Path, die_on_admit: bool, admitted_late: asyncio.Event) -> None:
    admitted, released, complete, peers = False, False, False, None
    while True:
        current = [p.model_dump() for p in receiver.peers()]
        if current != peers:
            peers = current
            _write(out / "peers.json", json.dumps(peers))
        if (receiver.busy_slots() or admitted_late.is_set()) and not admitted:
            admitted = True
            _write(out / "admitted", "1")
            if die_on_admit:
                os.kill(os.getpid(), signal.SIGKILL)
        if receiver.stats.completed and not complete:
            complete = True
            _write(out / "complete", "1")
        if admitted and not released and not receiver.busy_slots():
            released = True
            _write(out / "released", "1")
        await asyncio.sleep(0.002)


async def main(args: argparse.Namespace) -> None:
    layout = cpu_mla_layout(args.layers, args.mtp, args.dtype)
    receiver = KVReceiver(
        ReceiverSettings(
            layout=layout,
            max_tokens=args.max_tokens,
            slots=args.slots,
            unclaimed_timeout_s=args.unclaimed_timeout,
        )
    )
    out: Path = args.out
    admitted_late = asyncio.Event()
    out.mkdir(parents=True, exist_ok=True)  # noqa: ASYNC240 - once, before serving
    if args.admit_delay:
        on_admit = receiver._on_admit

        async def late_admit(peer: str, admit: Admit) -> BaseModel:
            _write(out / "admit-seen", admit.handoff_id)
            await asyncio.sleep(args.admit_delay)  # the decode server is slow to answer
            answer = await on_admit(peer, admit)
            if isinstance(answer, Admitted):  # said here: an Abort queued behind the Admit may free
                admitted_late.set()  # the slot before the 2 ms watcher sees it taken
            return answer

        receiver._on_admit = late_admit  # type: ignore[method-assign]
    await receiver.start()
    watcher = asyncio.create_task(watch(receiver, out, args.die_on_admit, admitted_late))
    _write(args.endpoint_file, receiver.endpoint)
    try:
        for hid in args.handoff:
            result: dict = {"handoff_id": hid}
            try:
                kv = await receiver.wait_for(hid, args.timeout)
                result["num_tokens"] = kv.num_tokens
                if args.dump:
                    (out / hid).mkdir()
                    for i, layer in enumerate(kv.layers):
                        np.save(out / hid / f"layer{i}.npy", layer["kv"].float().numpy())
                receiver.release(hid)
            except ReceiverError as exc:
                result["error"] = f"{type(exc).__name__}: {exc}"
            result["busy_slots"] = receiver.busy_slots()
            with open(out / "results.jsonl", "a") as f:  # noqa: ASYNC230 - one short line
                f.write(json.dumps(result) + "\n")
        await asyncio.sleep(args.linger)
    finally:
        watcher.cancel()
        await receiver.stop()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, required=True, help="main layers")
    ap.add_argument("--mtp", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16", help="vLLM's cache dtype (the model dtype)")
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--slots", type=int, default=1)
    ap.add_argument("--endpoint-file", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--handoff", action="append", default=[])
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--die-on-admit", action="store_true")
    ap.add_argument("--admit-delay", type=float, default=0.0, help="answer each Admit this many seconds late")
    ap.add_argument("--no-dump", dest="dump", action="store_false", help="only wait and release")
    ap.add_argument("--unclaimed-timeout", type=float, default=30.0)
    ap.add_argument("--linger", type=float, default=3600.0)
    asyncio.run(main(ap.parse_args()))

"""KV push throughput over NIXL against a memcpy of the same bytes, in the same run.

A receiver (tests/connector/transport/receiver_proc.py, a second process, real NIXL over
UCX on loopback) takes 79-layer GLM-5.1 fp8_ds_mla handoffs; this process is the sender.
For each size:

* ``push``: all 79 layers posted back to back (staging already filled); time from the
  first ``post_layer`` to ``Handoff.wait() == "sent"`` on the sender, and to the
  receiver's ``wait_for`` returning (complete at decode);
* ``memcpy``: ``memcpy`` (libc, one thread) of the same number of bytes between two
  huge-page host buffers in this process, one right after each push, so both see the
  same machine load (the machine may be shared);
* ``tail``: layers posted every ``--layer-ms`` ms (a simulated prefill of 79 x that);
  time from the last post to KV complete at decode, and that as a share of the
  simulated prefill time.

``done/memcpy`` is the median over reps of (memcpy time / push-to-complete time) of
each push and the memcpy right after it; bandwidths are medians of ``--reps``. Usage:
``.venv/bin/python bench/kv_transfer.py [--tokens 1024 8192] [--reps 5] [--layer-ms 5]``
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")


from connector.layout import glm5_fp8_ds_mla_layout  # noqa: E402
from connector.sender import KVSender  # noqa: E402
from connector.transport import HostBuffer  # noqa: E402
from tests.connector.transport.remote import remote_receiver  # noqa: E402

LAYOUT = glm5_fp8_ds_mla_layout(78, 1)
DEADLINE_S = 300.0


class Memcpy:
    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._src, self._dst = HostBuffer(nbytes), HostBuffer(nbytes)
        self._src.tensor.random_(0, 256)

    def seconds(self) -> float:
        start = time.perf_counter()
        ctypes.memmove(self._dst.tensor.data_ptr(), self._src.tensor.data_ptr(), self.nbytes)
        return time.perf_counter() - start


def run_size(tokens: int, reps: int, layer_ms: float, tmp: Path) -> dict[str, float]:
    nbytes = LAYOUT.num_layers * LAYOUT.bytes_per_layer(tokens)
    ids = [f"push-{i}" for i in range(reps)] + [f"paced-{i}" for i in range(reps)]
    args = ["--max-tokens", str(tokens), "--slots", "2", "--no-check", "--timeout", "60"]
    for hid in ids:
        args += ["--handoff", hid]
    sent, complete, tails, copies = [], [], [], []
    memcpy = Memcpy(nbytes)
    with remote_receiver(tmp, *args) as rr:
        sender = KVSender(f"bench-{tokens}", LAYOUT, tokens, transport="nixl", staging_slots=1)
        try:
            sender.connect(rr.endpoint, timeout=10)
            sender.staging_buffer.random_(0, 256)
            for i, hid in enumerate(ids):
                paced = hid.startswith("paced")
                handoff = sender.begin(rr.endpoint, hid, tokens, timeout=10)
                start_wall, start = time.time(), time.perf_counter()
                for layer in range(LAYOUT.num_layers):
                    if paced:
                        time.sleep(layer_ms / 1000)
                    handoff.post_layer(layer)
                last_post_wall = time.time()
                if handoff.wait(timeout=60) != "sent":
                    raise RuntimeError(f"{hid}: {handoff.error}")
                elapsed = time.perf_counter() - start
                arrived = rr.results(i + 1, timeout=60)[i]
                if "error" in arrived:
                    raise RuntimeError(f"{hid}: receiver: {arrived['error']}")
                if paced:
                    tails.append(arrived["arrived"] - last_post_wall)
                else:
                    sent.append(elapsed)
                    complete.append(arrived["arrived"] - start_wall)
                    copies.append(memcpy.seconds())
        finally:
            sender.close()
    mem = nbytes / statistics.median(copies) / 1e9
    # ratio of each push to the memcpy right after it (same load), then the median
    ratio = statistics.median(c / d for c, d in zip(copies, complete))
    push_sent = nbytes / statistics.median(sent) / 1e9
    push_done = nbytes / statistics.median(complete) / 1e9
    tail = statistics.median(tails)
    prefill = LAYOUT.num_layers * layer_ms / 1000
    return {"tokens": tokens, "MiB": nbytes / 2**20, "memcpy": mem, "sent": push_sent, "done": push_done,
            "ratio": ratio, "tail_ms": tail * 1000, "tail_share": tail / prefill}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 8192])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--layer-ms", type=float, default=5.0, help="simulated compute per layer for the tail")
    args = ap.parse_args()
    began = time.monotonic()
    print(f"GLM-5.1 fp8_ds_mla, {LAYOUT.num_layers} layers, NIXL/UCX loopback, 2 processes; "
          f"medians of {args.reps}; GB/s = 1e9 B/s")
    print(f"{'tokens':>6} {'MiB':>7} {'memcpy':>7} {'sent':>7} {'done':>7} {'done/memcpy':>11} "
          f"{'tail ms':>8} {'tail/prefill':>12}")
    for tokens in args.tokens:
        if time.monotonic() - began > DEADLINE_S:
            print(f"stopping: over {DEADLINE_S:.0f}s")
            break
        with tempfile.TemporaryDirectory() as tmp:
            r = run_size(tokens, args.reps, args.layer_ms, Path(tmp))
        print(f"{r['tokens']:>6} {r['MiB']:>7.1f} {r['memcpy']:>7.2f} {r['sent']:>7.2f} {r['done']:>7.2f} "
              f"{r['ratio']:>11.2f} {r['tail_ms']:>8.2f} {r['tail_share']:>12.3f}")
    prefill_ms = LAYOUT.num_layers * args.layer_ms
    print(f"tail: layers posted every {args.layer_ms} ms (simulated prefill {prefill_ms:.0f} ms)")


if __name__ == "__main__":
    main()

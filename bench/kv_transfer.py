"""KV push throughput over NIXL against a memcpy of the same bytes, in the same run.

A receiver (tests/connector/transport/receiver_proc.py, a second process, real NIXL over
UCX on loopback) takes 79-layer GLM-5.1 fp8_ds_mla handoffs; this process is the sender.
For each size:

* ``push``: all 79 layers posted at once (``post_layers``, staging already filled), which
  the sender's idle lanes split into one WRITE each; time from the post to
  ``Handoff.wait() == "sent"`` on the sender, and to the receiver's ``wait_for``
  returning (complete at decode);
* ``memcpy``: ``memcpy`` (libc, one thread) of the same number of bytes between two
  huge-page host buffers in this process, one right after each push, so both see the
  same machine load (the machine may be shared); ``memcpy2``: the same bytes split over
  two threads, for comparison with a push by two lanes (on a small machine both are
  bounded by the memory bandwidth, not by the copying cores);
* ``tail``: layers posted every ``--layer-ms`` ms (a simulated prefill of 79 x that);
  time from the last post to KV complete at decode, and that as a share of the
  simulated prefill time.

``done/memcpy`` is the median over reps of (memcpy time / push-to-complete time) of
each push and the memcpy right after it; bandwidths are medians of ``--reps``. Usage:
``.venv/bin/python bench/kv_transfer.py [--tokens 1024 8192] [--reps 5] [--layer-ms 5] [--lanes 2]``
(``--lanes 1``: one posting thread, as before the sender had lanes). The rows go to
bench/results/kv_transfer.json and docs/img/kv_transfer.png is drawn from them
(``python -m bench.plots`` redraws it).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import tempfile
import threading
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
    """libc memcpy between two huge-page buffers, by one thread or split over two
    (ctypes releases the GIL during the call)."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._src, self._dst = HostBuffer(nbytes), HostBuffer(nbytes)
        self._src.tensor.random_(0, 256)

    def _copy(self, offset: int, size: int) -> None:
        ctypes.memmove(self._dst.tensor.data_ptr() + offset, self._src.tensor.data_ptr() + offset, size)

    def seconds(self, threads: int = 1) -> float:
        part = -(-self.nbytes // threads)
        spans = [(i * part, min(part, self.nbytes - i * part)) for i in range(threads)]
        start = time.perf_counter()
        if threads == 1:
            self._copy(0, self.nbytes)
        else:
            workers = [threading.Thread(target=self._copy, args=span) for span in spans]
            for w in workers:
                w.start()
            for w in workers:
                w.join()
        return time.perf_counter() - start


def run_size(tokens: int, reps: int, layer_ms: float, tmp: Path, lanes: int = 2) -> dict[str, float]:
    nbytes = LAYOUT.num_layers * LAYOUT.bytes_per_layer(tokens)
    ids = [f"push-{i}" for i in range(reps)] + [f"paced-{i}" for i in range(reps)]
    args = ["--max-tokens", str(tokens), "--slots", "2", "--no-check", "--timeout", "60"]
    for hid in ids:
        args += ["--handoff", hid]
    sent, complete, tails, copies, copies2 = [], [], [], [], []
    memcpy = Memcpy(nbytes)
    with remote_receiver(tmp, *args) as rr:
        sender = KVSender(f"bench-{tokens}", LAYOUT, tokens, staging_slots=1, lanes=lanes)
        try:
            sender.connect(rr.endpoint, timeout=10)
            sender.staging_buffer.random_(0, 256)
            for i, hid in enumerate(ids):
                paced = hid.startswith("paced")
                handoff = sender.begin(rr.endpoint, hid, tokens, timeout=10)
                start_wall, start = time.time(), time.perf_counter()
                if paced:
                    for layer in range(LAYOUT.num_layers):
                        time.sleep(layer_ms / 1000)
                        handoff.post_layer(layer)
                else:
                    handoff.post_layers(list(range(LAYOUT.num_layers)))
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
                    copies2.append(memcpy.seconds(threads=2))
        finally:
            sender.close()
    mem = nbytes / statistics.median(copies) / 1e9
    # ratio of each push to the memcpy right after it (same load), then the median
    ratio = statistics.median(c / d for c, d in zip(copies, complete))
    ratio2 = statistics.median(c / d for c, d in zip(copies2, complete))
    push_sent = nbytes / statistics.median(sent) / 1e9
    push_done = nbytes / statistics.median(complete) / 1e9
    tail = statistics.median(tails)
    prefill = LAYOUT.num_layers * layer_ms / 1000
    return {"tokens": tokens, "MiB": nbytes / 2**20, "memcpy": mem, "sent": push_sent, "done": push_done,
            "ratio": ratio, "memcpy2": nbytes / statistics.median(copies2) / 1e9, "ratio2": ratio2,
            "tail_ms": tail * 1000, "tail_share": tail / prefill}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 8192])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--layer-ms", type=float, default=5.0, help="simulated compute per layer for the tail")
    ap.add_argument("--lanes", type=int, nargs="+", default=[2],
                    help="sender lanes (posting threads) to compare")
    ap.add_argument("--results", type=Path, default=REPO / "bench" / "results",
                    help="where kv_transfer.json goes (python -m bench.plots draws from it)")
    ap.add_argument("--img", type=Path, default=REPO / "docs" / "img", help="where kv_transfer.png goes")
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args()
    began = time.monotonic()
    started, load_start = time.strftime("%Y-%m-%d %H:%M"), os.getloadavg()[0]
    rows: list[dict[str, float]] = []
    print(f"GLM-5.1 fp8_ds_mla, {LAYOUT.num_layers} layers, NIXL/UCX loopback, 2 processes; "
          f"medians of {args.reps}; GB/s = 1e9 B/s")
    print(f"{'tokens':>6} {'MiB':>7} {'lanes':>5} {'memcpy':>7} {'sent':>7} {'done':>7} {'done/memcpy':>11} "
          f"{'memcpy2':>7} {'done/memcpy2':>12} {'tail ms':>8} {'tail/prefill':>12}")
    for tokens in args.tokens:
        for lanes in args.lanes:
            if time.monotonic() - began > DEADLINE_S:
                print(f"stopping: over {DEADLINE_S:.0f}s")
                break
            with tempfile.TemporaryDirectory() as tmp:
                r = run_size(tokens, args.reps, args.layer_ms, Path(tmp), lanes)
            rows.append({**r, "lanes": lanes})
            print(f"{r['tokens']:>6} {r['MiB']:>7.1f} {lanes:>5} {r['memcpy']:>7.2f} {r['sent']:>7.2f} "
                  f"{r['done']:>7.2f} {r['ratio']:>11.2f} {r['memcpy2']:>7.2f} {r['ratio2']:>12.2f} "
                  f"{r['tail_ms']:>8.2f} {r['tail_share']:>12.3f}")
    prefill_ms = LAYOUT.num_layers * args.layer_ms
    print(f"tail: layers posted every {args.layer_ms} ms (simulated prefill {prefill_ms:.0f} ms)")
    from bench.plots import render, write_result

    run = (f"{started}, {os.cpu_count()} CPUs, load {load_start:.1f} -> {os.getloadavg()[0]:.1f}; "
           f"{LAYOUT.num_layers}-layer GLM-5.1 fp8_ds_mla, NIXL/UCX loopback, medians of {args.reps}")
    print(f"data: {write_result('kv_transfer', run, rows, args.results)}")
    if not args.no_plot and rows:
        print(f"figure: {render('kv_transfer', args.results, args.img)}")


if __name__ == "__main__":
    main()

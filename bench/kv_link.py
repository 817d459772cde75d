"""A KV handoff's time across a link between nodes, clean against 1% loss + 2 ms delay.

Two nodes of tests/nodes.py; node 1's cable is the link emulator's (tests/link_emulator.py:
this kernel has no netem). A receiver (tests/connector/transport/receiver_proc.py, real
NIXL, KV secret on) listens on node 1's address; this process sends from node 0 (a thread
inside its network namespace), UCX choosing its transport as on the multi-node stack
(shared memory off). Each rep pushes one 79-layer GLM-5.1 fp8_ds_mla handoff of
``--tokens`` with the link clean, then one with it impaired; the time is from the post of
all layers to the receiver's ``wait_for`` returning (KV complete at decode). ``lossy/clean``
is the median over reps of each pair's ratio (the same machine load for both).

``--cc``: the nodes' TCP congestion control (this machine's default is ``bbr``, which
hardly slows down for random loss; ``reno`` halves its window at each loss, as the loss-based
controls do; ``cubic``, Linux's usual default, is not allowed in a namespace here).

Usage (as root): ``.venv/bin/python bench/kv_link.py [--tokens 256 1024] [--reps 5] [--cc bbr reno]``;
``--results DIR`` also writes the rows to DIR/kv_link.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

from connector.layout import glm5_fp8_ds_mla_layout  # noqa: E402
from connector.sender import KVSender  # noqa: E402
from tests.connector.transport.remote import remote_receiver  # noqa: E402
from tests.link_emulator import EmulatedCable  # noqa: E402
from tests.multinode.stack import ENV  # noqa: E402
from tests.nodes import Nodes  # noqa: E402

LAYOUT = glm5_fp8_ds_mla_layout(78, 1)
SECRET = b"kv-secret-for-the-kv-link-bench"
LOSS, DELAY_S = 0.01, 0.002


def run_size(nodes: Nodes, tokens: int, reps: int, tmp: Path) -> dict[str, float]:
    link: EmulatedCable = nodes.link(1)
    secret_file = tmp / "kv-secret"
    secret_file.write_bytes(SECRET)
    ids = [f"{kind}-{i}" for i in range(reps) for kind in ("clean", "lossy")]
    args = ["--max-tokens", str(tokens), "--no-check", "--timeout", "300", "--host", nodes[1].address,
            "--secret-file", str(secret_file)]
    for hid in ids:
        args += ["--handoff", hid]
    env = {k: v for k, v in ENV.items() if k.startswith(("UCX_", "NIXL_"))}
    took: dict[str, list[float]] = {"clean": [], "lossy": []}
    frames = [0, 0]  # passed, dropped by the link during the lossy pushes
    with remote_receiver(tmp, *args, env=env, on=nodes[1].argv) as rr:

        def push_all() -> None:  # on node 0
            sender = KVSender(f"kv-link-{tokens}", LAYOUT, tokens, staging_slots=1, secret=SECRET)
            try:
                sender.connect(rr.endpoint, timeout=30)
                sender.staging_buffer.random_(0, 256)
                for i, hid in enumerate(ids):
                    kind = hid.split("-")[0]
                    link.impair(LOSS, DELAY_S) if kind == "lossy" else link.impair()
                    before = link.stats()
                    handoff = sender.begin(rr.endpoint, hid, tokens, timeout=30)
                    start = time.time()
                    handoff.post_layers(list(range(LAYOUT.num_layers)))
                    if handoff.wait(timeout=300) != "sent":
                        raise RuntimeError(f"{hid}: {handoff.error}")
                    arrived = rr.results(i + 1, timeout=300)[i]
                    if "error" in arrived:
                        raise RuntimeError(f"{hid}: receiver: {arrived['error']}")
                    took[kind].append(arrived["arrived"] - start)
                    if kind == "lossy":
                        frames[:] = [n + b - a for n, a, b in zip(frames, before, link.stats())]
            finally:
                link.impair()
                sender.close()

        nodes[0].call(push_all)
    nbytes = LAYOUT.num_layers * LAYOUT.bytes_per_layer(tokens)
    clean, lossy = statistics.median(took["clean"]), statistics.median(took["lossy"])
    return {"tokens": tokens, "MiB": nbytes / 2**20, "clean_ms": clean * 1e3, "lossy_ms": lossy * 1e3,
            "clean_MBps": nbytes / clean / 1e6, "lossy_MBps": nbytes / lossy / 1e6,
            "ratio": statistics.median(b / a for a, b in zip(took["clean"], took["lossy"])),
            "frames": frames[0] / reps, "dropped": frames[1] / frames[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--cc", nargs="+", default=["bbr", "reno"], help="TCP congestion control on the nodes")
    ap.add_argument("--results", type=Path, default=None, help="a directory for kv_link.json (the numbers are "
                    "in docs/benchmarks.md; the data files in bench/results are those bench.plots draws)")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as d, Nodes(2, name="kvlink", emulated=frozenset({1})) as nodes:
        for cc, tokens in [(cc, tokens) for cc in args.cc for tokens in args.tokens]:
            for node in nodes.nodes:
                subprocess.run(["ip", "netns", "exec", node.netns, "sysctl", "-qw",
                                f"net.ipv4.tcp_congestion_control={cc}"], check=True, timeout=10)
            tmp = Path(d) / f"{cc}-{tokens}"
            tmp.mkdir()
            rows.append({"cc": cc, **run_size(nodes, tokens, args.reps, tmp)})
            r = rows[-1]
            print(f"{cc:>5} {tokens:>6} tokens {r['MiB']:7.1f} MiB: clean {r['clean_ms']:8.1f} ms "
                  f"({r['clean_MBps']:6.1f} MB/s)  1% loss + 2 ms {r['lossy_ms']:8.1f} ms "
                  f"({r['lossy_MBps']:6.1f} MB/s)  lossy/clean {r['ratio']:.2f}  "
                  f"({r['frames']:.0f} frames a handoff, {r['dropped']:.2%} dropped)", flush=True)
    if args.results is not None:
        args.results.mkdir(parents=True, exist_ok=True)
        (args.results / "kv_link.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()

"""Which UCX transport carries an agent's KV WRITEs, as UCX itself states it.

NIXL names only its backend ("UCX"); UCX picks the transport (``rc_mlx5/mlx5_0:1`` over
InfiniBand, ``tcp/eth0``, ``cma/memory`` between processes of one host, ...) per endpoint
configuration, operation, memory type and size range. With ``UCX_PROTO_INFO`` selecting
the ``put`` operations (a NIXL WRITE is a UCX put) and ``UCX_PROTO_INFO_DIR`` naming a
directory, UCX writes one Graphviz file per choice there, when it makes it:

    <worker>_<self|intra_node|inter_node>_cfg_<i>_put_from_<mem>_memory_to_<mem>_<lo>_<hi>.dot

whose first box reads ``<protocol>\\n<transport>/<device>[ <share>% + ...]`` (``<worker>``
is the agent's name cut to 31 characters, with its other characters than letters and digits
made ``_``: in a directory of its own an agent reads every file, in a shared one those of
its name, which agents whose names begin alike share). The glob
``put*`` makes UCX write these files and print nothing (``y`` would also print every
table to the process's stdout). Measured with NIXL 1.5.1's UCX (docs/facts.md §2).

:func:`proto_info_env` is what an agent's process sets before UCX reads its
configuration; :func:`put_carrier` reads the choice back.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

PROTO_INFO = "UCX_PROTO_INFO"
PROTO_INFO_DIR = "UCX_PROTO_INFO_DIR"
PUT_GLOB = "put*"
UNKNOWN = "unknown"

_FILE = re.compile(r"^(?P<worker>.+)_(?P<scope>self|intra_node|inter_node)_cfg_(?P<cfg>\d+)_put_from_"
                   r"(?P<src>[a-z]+)_memory_to_(?P<dst>[a-z]+)_(?P<lo>\d+)_(?P<hi>\d+|inf)\.dot$")
_FIRST_BOX = re.compile(r'node0 \[label="(?P<label>[^"]*)"')
_TRANSPORT = re.compile(r"\b([a-z][a-z0-9_]*/[A-Za-z0-9_.:-]+)")
_MEMORY = {"DRAM": "host", "VRAM": "cuda"}
_NOT_ALNUM = re.compile(r"[^A-Za-z0-9]")
WORKER_NAME_MAX = 31  # UCX keeps this much of a worker's name (measured: docs/facts.md §2)


@dataclass(frozen=True)
class PutChoice:
    """One of UCX's put protocol choices, read from its file."""

    worker: str
    scope: str  # "self", "intra_node" or "inter_node"
    cfg: int
    src: str  # UCX's memory type: "host", "cuda", ...
    lo: int
    hi: int | None  # None: no upper bound
    transports: tuple[str, ...]  # "tcp/eth0", "rc_mlx5/mlx5_0:1", ...

    def covers(self, nbytes: int) -> bool:
        return self.lo <= nbytes and (self.hi is None or nbytes <= self.hi)


def proto_info_env(directory: Path, environ: dict[str, str]) -> dict[str, str]:
    """The variables to set so that UCX writes its put choices into ``directory``; what the
    operator set stays (their ``UCX_PROTO_INFO_DIR`` is then the one to read; their
    ``UCX_PROTO_INFO=n`` leaves the transport unknown)."""
    env = {} if environ.get(PROTO_INFO) else {PROTO_INFO: PUT_GLOB}
    return env if environ.get(PROTO_INFO_DIR) else {**env, PROTO_INFO_DIR: str(directory)}


def read_choices(directory: Path, worker: str | None = None) -> list[PutChoice]:
    """The put choices UCX wrote into ``directory`` so far: all, or those of ``worker`` (an
    agent's name)."""
    choices = []
    wanted = None if worker is None else _NOT_ALNUM.sub("_", worker[:WORKER_NAME_MAX])
    try:
        names = [p.name for p in directory.iterdir()]
    except OSError:
        return []
    for name in names:
        m = _FILE.match(name)
        if m is None or (wanted is not None and _NOT_ALNUM.sub("_", m["worker"]) != wanted):
            continue
        try:
            text = (directory / name).read_text(errors="replace")
        except OSError:
            continue
        box = _FIRST_BOX.search(text)
        label = box["label"].split("\\n", 1)[-1] if box else ""
        choices.append(PutChoice(m["worker"], m["scope"], int(m["cfg"]), m["src"], int(m["lo"]),
                                 None if m["hi"] == "inf" else int(m["hi"]),
                                 tuple(dict.fromkeys(_TRANSPORT.findall(label)))))
    return choices


def put_carrier(choices: list[PutChoice], mem: str, nbytes: int) -> str:
    """The transport(s) UCX chose for a put of ``nbytes`` from ``mem`` ("DRAM"/"VRAM") to
    another agent (``self``, the agent's own endpoint, is not a peer), joined with "+"
    when its endpoint configurations differ; :data:`UNKNOWN` when UCX wrote none."""
    src = _MEMORY.get(mem, mem.lower())
    found = {t for c in choices if c.scope != "self" and c.src == src and c.covers(nbytes) for t in c.transports}
    return "+".join(sorted(found)) or UNKNOWN


def transport_class(carrier: str) -> str:
    """``rdma``, ``tcp``, ``shm`` (one host's memory), ``gpu`` (CUDA IPC / copies), ``mixed`` or
    ``unknown``: what a deployment's summary compares with what its recipe expects."""
    kinds = {_kind(t.split("/", 1)[0]) for t in carrier.split("+") if t and t != UNKNOWN}
    if not kinds:
        return UNKNOWN
    return kinds.pop() if len(kinds) == 1 else "mixed"


def _kind(tl: str) -> str:
    if tl == "tcp":
        return "tcp"
    if tl in ("cma", "posix", "sysv", "knem", "xpmem", "self"):
        return "shm"
    if tl.startswith(("cuda", "gdr", "rocm")):
        return "gpu"
    if tl.startswith(("rc", "dc", "ud", "srd", "gga")):
        return "rdma"
    return "other"

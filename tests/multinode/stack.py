"""The PD stack across nodes (tests/nodes.py), as deployed: router and vLLM prefill on node 0,
one decode server on each further node. Every role binds and advertises its node's name
(resolved to the node's address on every node; no 127.x between roles), the decode API key
and the KV channel's secret are on, and UCX chooses its network device and transport by
itself (only its shared-memory transports are off: see ``ENV``). The command lines are the
launcher's own (pd_deploy.commands, with the one-host stack's numerics from StackConfig);
only host, ports and secrets differ.

The test process reaches the servers from a thread inside node 0 (``Node.call``), by
address: the nodes' names resolve inside the nodes only."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from pd_deploy.commands import VLLM_CPU_ENV, RouterSpec, decode_server_argv, router_argv, vllm_prefill_argv
from pd_deploy.stack.launcher import StackConfig
from pd_deploy.stack.process import ManagedProcess
from pd_wire.decode import CAPABILITIES_PATH, DecodeCapabilities
from tests.held_slot import HeldSlot, held_slot
from tests.nodes import Node, Nodes

ROUTER_PORT, PREFILL_PORT, DECODE_PORT, KV_PORT = 8000, 8100, 8200, 9100  # each node has its own ports
API_KEY = "router-key-for-the-multinode-tests"
DECODE_KEY = "decode-key-for-the-multinode-tests"
KV_SECRET = "kv-secret-for-the-multinode-tests"
# vLLM and NIXL as on the one-host stack, less the loopback pin: UCX picks its devices and
# transports, except the ones between processes of one machine, which it would otherwise
# pick here (it sees one machine through the namespaces: the KV bytes would go by
# cross-memory attach, never over the nodes' link; docs/facts.md §5)
INTRA_NODE_TLS = "^cma,posix,sysv,knem,xpmem"
# "all" (UCX's own default) said explicitly: the test process's environment may carry the
# loopback pin of other tests (tests/connector/transport/conftest.py sets it), which the
# servers would inherit: UCX then finds no transport to a peer on another node
ENV = {**VLLM_CPU_ENV, "UCX_NET_DEVICES": "all", "UCX_TLS": INTRA_NODE_TLS}
ROUTER_ENV = {"PD_ROUTER_API_KEY": API_KEY}


@dataclass
class NodeStack:
    nodes: Nodes
    model_name: str
    processes: dict[str, ManagedProcess] = field(default_factory=dict)

    @property
    def head(self) -> Node:
        return self.nodes[0]

    @property
    def decode_nodes(self) -> list[Node]:
        return self.nodes.nodes[1:]

    @property
    def router_url(self) -> str:  # by address: for the test process
        return f"http://{self.head.address}:{ROUTER_PORT}"

    @property
    def prefill_url(self) -> str:
        return f"http://{self.head.address}:{PREFILL_PORT}"

    def decode_url(self, node: Node) -> str:
        return f"http://{node.address}:{DECODE_PORT}"

    def from_head(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return self.head.call(fn, *args, **kwargs)

    def post(self, path: str, body: dict[str, Any], timeout: float = 120) -> httpx.Response:
        """A request to the router, from node 0, with the router's API key."""
        return self.from_head(lambda: httpx.post(self.router_url + path, json=body, timeout=timeout,
                                                 headers={"Authorization": f"Bearer {API_KEY}"}))

    def get(self, url: str, node: Node | None = None, timeout: float = 5) -> httpx.Response:
        """GET ``url`` from ``node`` (node 0 by default) with the decode API key."""
        return (node or self.head).call(lambda: httpx.get(url, timeout=timeout,
                                                          headers={"Authorization": f"Bearer {DECODE_KEY}"}))

    def capabilities(self, node: Node, from_node: Node | None = None) -> DecodeCapabilities:
        """Decode server ``node``'s capabilities (asked from ``from_node``: itself reaches it
        with its cable pulled)."""
        return DecodeCapabilities.model_validate_json(
            self.get(self.decode_url(node) + CAPABILITIES_PATH, from_node).content)

    def metric(self, url: str, name: str, node: Node | None = None) -> float:
        """The sum of every sample of metric ``name`` at ``url``/metrics."""
        lines = self.get(url + "/metrics", node).text.splitlines()
        return sum(float(line.rsplit(" ", 1)[1]) for line in lines
                   if line.startswith(name) and line[len(name):len(name) + 1] in ("{", " "))

    @contextmanager
    def held_slot(self, node: Node) -> Iterator[HeldSlot]:
        """Decode ``node``'s slot held by the test from node 0, as another router's request would
        (tests/held_slot.py): the router sees it taken there."""
        with held_slot(self.decode_url(node), DECODE_KEY, on=self.head.call) as grant:
            yield grant

    def ready(self) -> int:
        return self.from_head(lambda: httpx.get(self.router_url + "/ready", timeout=5).status_code)

    def wait(self, proc: str, check: Callable[[], bool], timeout: float, what: str) -> None:
        def safe() -> bool:
            try:
                return check()
            except httpx.HTTPError:
                return False

        self.processes[proc].wait_until(safe, timeout, what)


def _secret(path: Path, value: str) -> str:
    path.write_text(value + "\n")
    path.chmod(0o600)
    return str(path)


@contextmanager
def node_stack(model_dir: Path, log_dir: Path, num_decode: int = 2, dead_peer_s: float = 4.0,
               router_args: tuple[str, ...] = (), start_timeout_s: float = 300.0,
               emulated: frozenset[int] = frozenset()) -> Iterator[NodeStack]:
    """The stack on ``1 + num_decode`` nodes, started in the launcher's order with its gates
    (decode servers ready, prefill healthy, every decode server handshook, router ready).
    ``emulated``: the nodes whose cable can be made lossy and slow (``stack.nodes.link(i)``)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    decode_key, secret = _secret(log_dir / "decode-key", DECODE_KEY), _secret(log_dir / "kv-secret", KV_SECRET)
    local = StackConfig(model_dir=model_dir, log_dir=log_dir, num_decode=num_decode,
                        served_model_name="tiny-glm")  # the one-host stack: its numerics and flags
    with Nodes(1 + num_decode, emulated=emulated) as nodes:
        stack = NodeStack(nodes, local.model_name)
        dead_peer = ("--dead-peer-timeout", str(dead_peer_s))

        def spawn(name: str, node: Node, argv: list[str], env: dict[str, str]) -> ManagedProcess:
            proc = ManagedProcess(name, node.argv(argv), log_dir / f"{name}.log", env=env)
            stack.processes[name] = proc
            return proc

        try:
            for node, spec in zip(stack.decode_nodes, local.decode_specs()):
                spec = dataclasses.replace(spec, host=node.name, port=DECODE_PORT, kv_port=KV_PORT,
                                           api_key_file=decode_key, kv_secret_file=secret,
                                           extra_args=spec.extra_args + ("--kv-host", node.name) + dead_peer)
                spawn(f"decode-{node.index}", node, decode_server_argv(spec), ENV)
            for node in stack.decode_nodes:
                stack.wait(f"decode-{node.index}", lambda n=node: stack.get(stack.decode_url(n) + "/ready")
                           .status_code == 200, start_timeout_s, "/ready")
            prefill = dataclasses.replace(
                local.prefill_spec(), host=nodes[0].name, port=PREFILL_PORT, kv_secret_file=secret,
                decode_endpoints=tuple(f"{n.name}:{KV_PORT}" for n in stack.decode_nodes))
            spawn("prefill", nodes[0], vllm_prefill_argv(prefill), ENV)
            stack.wait("prefill", lambda: stack.get(stack.prefill_url + "/health").status_code == 200,
                       start_timeout_s, "/health")
            for node in stack.decode_nodes:
                stack.wait(f"decode-{node.index}", lambda n=node: any(
                    p.state == "ok" for p in stack.capabilities(n).peers), 60, "the KV handshake with prefill")
            router = RouterSpec(prefill_urls=(f"http://{nodes[0].name}:{PREFILL_PORT}",),
                                decode_urls=tuple(f"http://{n.name}:{DECODE_PORT}" for n in stack.decode_nodes),
                                host=nodes[0].name, port=ROUTER_PORT, decode_api_key_file=decode_key,
                                # probes every 0.5 s: a node's loss found within seconds; 4 misses
                                # (~4 s), so that a prefill starved by a vLLM decoding beside it on
                                # this host's 2 cores (the tests' vLLM alone) is not marked down
                                extra_args=("--probe-interval", "0.5", "--probe-misses", "4") + dead_peer
                                + router_args)
            spawn("router", nodes[0], router_argv(router), {**ENV, **ROUTER_ENV})
            stack.wait("router", lambda: stack.ready() == 200, 60, "/ready")
            yield stack
        finally:
            for proc in reversed(list(stack.processes.values())):
                proc.stop()


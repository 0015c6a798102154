"""What every node of a Ray cluster is, and what would break a run on it, found before a run.

A mixed cluster fails late when its nodes disagree: a node with another tidal release
deserialises the trainer's messages differently, a node that advertises NPUs to Ray but
lacks the vendor's torch fails the first actor placed there, and a firewall between the
NPU and the GPU nodes stops the first weight update. `probe_cluster` places one small
probe actor on every alive node (pinned to it, no CPU asked) and asks each what it runs,
then has every probe connect to every other's listening port: the store server and the
weight transports listen on ports the OS picks, as these do. `cluster_problems` turns the
reports into one sentence per problem, naming the node. `tidal doctor --cluster` shows
the reports and problems; `tidal run` refuses a cluster with problems before it starts
an actor.
"""

from __future__ import annotations

import dataclasses
import socket
import threading
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from tidal.flow.placement import RAY_RESOURCES

CONNECT_TIMEOUT_S = 5.0
"""How long a probe waits for a TCP connection to another node's probe."""
PROBE_TIMEOUT_S = 120.0
"""How long the driver waits for every node's probe to start and answer."""


@dataclasses.dataclass(frozen=True)
class NodeReport:
    """One node of the cluster, as its probe saw it."""

    node_id: str
    name: str
    """Ray's node name (its IP address unless `ray start --node-name` gave one)."""
    address: str
    """The node's IP address, as Ray knows it."""
    devices: Mapping[str, int]
    """Devices the node advertises to Ray, by tidal kind (npu, cuda); empty: a CPU node."""
    resources: Mapping[str, float]
    """Every resource the node advertises (CPU, GPU, NPU, memory, tags)."""
    free: Mapping[str, float] | None
    """What of them no actor or task holds now (None: Ray did not say)."""
    versions: Mapping[str, str]
    """python, tidal-rl and the stacks tidal builds on (`hal.versions.package_versions`)."""
    missing: Mapping[str, str]
    """For each device kind the node advertises, what it lacks to run it (`hal.versions.missing_stack`)."""
    listens: str
    """host:port its probe listened on."""
    unreachable: Mapping[str, str]
    """Other nodes (by node id) whose probe this one could not connect to, and the error."""
    engines: Mapping[str, Mapping[str, str]] = dataclasses.field(default_factory=dict)
    """For each device kind the node holds roles on (its devices', else cpu), each role whose
    engine cannot run there, and why (the `check` given to `probe_cluster`; empty: none given)."""

    @property
    def kinds(self) -> str:
        return ", ".join(f"{n} {kind}" for kind, n in self.devices.items()) or "cpu only"


class NodeProbe:
    """Runs on one node: what it has, a listening socket, and connections to the others."""

    def __init__(self) -> None:
        self._server: socket.socket | None = None

    def describe(self, kinds: Sequence[str], check: EngineCheck | None = None) -> dict[str, Any]:
        from tidal.hal.versions import missing_stack, package_versions  # noqa: PLC0415

        engines = {k: dict(check(k, here="on that node")) for k in (kinds or ["cpu"])} if check is not None else {}
        return {"versions": package_versions(), "missing": {k: why for k in kinds if (why := missing_stack(k))}, "engines": engines}

    def listen(self, host: str) -> str:
        """Listen on `host` (this node's address) on a port the OS picks, accepting and
        closing every connection, as long as the probe lives."""
        server = socket.create_server((host, 0))
        self._server = server

        def accept() -> None:
            while True:
                try:
                    conn, _ = server.accept()
                except OSError:  # closed
                    return
                conn.close()

        threading.Thread(target=accept, daemon=True, name="tidal-probe-accept").start()
        return f"{host}:{server.getsockname()[1]}"

    def reach(self, addresses: Mapping[str, str]) -> dict[str, str]:
        """Connect to each `node id -> host:port`; the ones that failed, with the error."""
        failed = {}
        for node, address in addresses.items():
            host, _, port = address.rpartition(":")
            try:
                socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S).close()
            except OSError as e:
                failed[node] = f"{type(e).__name__}: {e}"
        return failed


def node_devices(resources: Mapping[str, float]) -> dict[str, int]:
    """The devices a node's Ray resources advertise, by tidal kind (as placement reads them)."""
    return {kind: int(resources[RAY_RESOURCES[kind]]) for kind in ("npu", "cuda") if resources.get(RAY_RESOURCES[kind], 0) >= 1}


class EngineCheck(Protocol):
    """Which roles' engines cannot run on a device kind, in the environment it is called in,
    and why (role -> reason; `tools.run.RecipeEngineCheck`). Picklable: each probe calls it."""

    def __call__(self, kind: str, *, here: str = ...) -> Mapping[str, str]: ...


def probe_cluster(*, timeout_s: float = PROBE_TIMEOUT_S, check: EngineCheck | None = None) -> list[NodeReport]:
    """Probe every alive node of the Ray cluster this process is connected to; with `check`,
    each probe also runs it on its node for the kinds the node holds roles on
    (`NodeReport.engines`): whether a recipe's engines are installed there.

    Raises:
        TimeoutError: naming the nodes whose probe did not answer in `timeout_s` (a node
            without room for one more worker process, or one that stopped answering).
    """
    import ray  # noqa: PLC0415
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: PLC0415

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    probe_cls: Any = ray.remote(num_cpus=0, max_restarts=0)(NodeProbe)
    probes: list[Any] = [probe_cls.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote() for n in nodes]
    try:
        described = _gather(ray, [p.describe.remote(list(node_devices(n["Resources"])), check) for p, n in zip(probes, nodes)], nodes, timeout_s, "answer")
        listening = _gather(ray, [p.listen.remote(n["NodeManagerAddress"]) for p, n in zip(probes, nodes)], nodes, timeout_s, "listen")
        addresses = {n["NodeID"]: a for n, a in zip(nodes, listening)}
        reached = _gather(ray, [p.reach.remote({k: a for k, a in addresses.items() if k != n["NodeID"]}) for p, n in zip(probes, nodes)], nodes, timeout_s, "connect")
    finally:
        for p in probes:
            ray.kill(p)
    free = _free_resources()
    return [
        NodeReport(
            node_id=n["NodeID"],
            name=n.get("NodeName") or n["NodeManagerAddress"],
            address=n["NodeManagerAddress"],
            devices=node_devices(n["Resources"]),
            resources=dict(n["Resources"]),
            free=free.get(n["NodeID"]) if free is not None else None,
            versions=d["versions"],
            missing=d["missing"],
            engines=d["engines"],
            listens=a,
            unreachable=r,
        )
        for n, d, a, r in zip(nodes, described, listening, reached)
    ]


def _free_resources() -> dict[str, dict[str, float]] | None:
    """Each node's resources that are free now, by node id. Ray's public API says this only
    for the whole cluster (or through its dashboard, which tidal's clusters may run
    without), so this reads its GCS client's per-node view; None where that moved."""
    try:
        from ray._private.state import available_resources_per_node  # noqa: PLC0415

        return {node: dict(res) for node, res in available_resources_per_node().items()}
    except (ImportError, AttributeError, TypeError):
        return None


def _gather(ray: Any, refs: list[Any], nodes: list[Mapping[str, Any]], timeout_s: float, what: str) -> list[Any]:
    _, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    if pending:
        late = [f"{nodes[refs.index(r)].get('NodeName') or nodes[refs.index(r)]['NodeManagerAddress']}" for r in pending]
        raise TimeoutError(f"the probe of node(s) {', '.join(late)} did not {what} within {timeout_s:.0f} s: is the node overloaded or out of memory for one more worker process?")
    return ray.get(refs)


VERSIONS_THAT_MUST_AGREE = ("tidal-rl", "python", "ray")
"""Versions every node runs alike: tidal's own messages (the store's wire format, the
transports' headers) and Ray's pickles assume it."""


def cluster_problems(reports: Sequence[NodeReport], *, driver_versions: Mapping[str, str], fake: bool = False) -> list[str]:
    """What would break a run on these nodes, one sentence each naming the node and the fix.

    `driver_versions`: the versions of the process that starts the run. `fake`: the run's
    actors use fake platforms (`cluster.fake`), which need no vendor stack.
    """
    problems = []
    by_id = {r.node_id: r for r in reports}
    for r in reports:
        for package in VERSIONS_THAT_MUST_AGREE:
            theirs, ours = r.versions.get(package), driver_versions.get(package)
            if theirs != ours:
                problems.append(f"node {r.name} ({r.kinds}) runs {package} {theirs}, the driver {ours}: install the same {package} on every node")
        if not fake:
            for kind, why in r.missing.items():
                problems.append(f"node {r.name} advertises {r.devices[kind]} {kind} device(s) to Ray but {why}: install it there, or start the node without them")
        for other, error in r.unreachable.items():
            o = by_id.get(other)
            target = f"node {o.name} ({o.kinds}) at {o.listens}" if o else f"node {other}"
            problems.append(f"node {r.name} ({r.kinds}) cannot connect to {target}: {error}; the store and the weight transports connect between nodes on ports the OS picks: allow TCP between the cluster's nodes")
    return problems

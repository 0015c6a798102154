"""`tidal run` under `runtime: ray`: the plan becomes placement groups and actors.

The driver (the `tidal run` process) connects to Ray (RAY_ADDRESS, else a local
instance it starts; with `cluster.fake: true` that instance declares the recipe's NPUs
and GPUs as resources so the plan runs on CPU), schedules the plan, creates one
placement group per role (failing within seconds, naming the role, when the cluster
cannot hold it) and starts one trainer actor per `placement.train` instance on its
bundle. Trainer rank 0 runs the same `train()` as the local runtime; its rollout stage
is the rollout actors, started on their bundles (a rollout instance that time-shares the
trainer's devices on the trainer's bundle, taking turns through that bundle's `Turns`
actor, which the driver starts: `flow.colocate`), which reach the trainer's store over
ZeroMQ and receive each version over the chosen weight transport. Several trainer ranks
(the `fsdp` and `deepspeed` backends: `MULTI_RANK`) form one process group through hal at
rank 0's address; rank 0's engines lead (`rank0_leads=True`), the others run their
backend's `follow()` on their share of each batch. A rank whose bundle hosts a rollout
guest has a `Turns` there; rank 0 takes every rank's turn, in rank order, before each
command the ranks run together, and the others compute in it. The driver shows progress from the run directory's metrics.jsonl (which
must be reachable from the trainer's node); Ctrl-C or SIGTERM there reaches rank 0
through `tools.ray_stop`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import secrets
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from tidal.flow.files import write_whole
from tidal.flow.protocols import SharesWeights
from tidal.flow.ray.faults import ActorLost, death_summary, rank_died, remote_cause
from tidal.flow.ray.liveness import Liveness
from tidal.flow.ray.placement import ray_address
from tidal.hal.transfer import PlacesWeights
from tidal.tools.config import ConfigError, RecipeConfig, stage_threads, to_yaml
from tidal.tools.metrics import finite, last_metrics
from tidal.tools.ray_stop import StopSignal, relay_stop
from tidal.tools.run import check_runnable
from tidal.tools.stopping import RunStopped, StopRequest, stop_on_signals

log = logging.getLogger(__name__)


def _config_from_yaml(text: str) -> Any:
    from omegaconf import OmegaConf  # noqa: PLC0415

    return OmegaConf.merge(OmegaConf.structured(RecipeConfig), OmegaConf.create(text))


def make_rollout_engine(cfg_yaml: str, *, rank: int) -> Any:
    """Runs inside rollout actor `rank`: the recipe's rollout engine on the actor's platform,
    its generators seeded from `seed` and `rank` (each instance its own stream; the actor's
    worker seeds each generate call afresh: `start_rollouts`). It starts from freshly
    initialised weights; the trainer's current version arrives over the weight transport
    before the first generate."""
    from tidal.engines.models import model_source  # noqa: PLC0415
    from tidal.hal import current_platform  # noqa: PLC0415
    from tidal.tools.rl import build_rollout_engine  # noqa: PLC0415

    cfg = _config_from_yaml(cfg_yaml)
    threads = stage_threads(cfg, "rollout")
    if threads:
        import torch  # noqa: PLC0415

        torch.set_num_threads(threads)
    platform = current_platform()
    policy = model_source(cfg.model).build(seed=cfg.seed)  # the tiny model: from `seed`, as every instance's
    tokenizer, model = policy.tokenizer, policy.module.to(platform.device(0))
    platform.seed_all(cfg.seed + 7_919 * (rank + 1))
    return build_rollout_engine(cfg, model, tokenizer, platform=platform, version=-1)


class RemoteRollouts:
    """What `train()` gets back from `start_rollouts`: the `RolloutGroup`, plus `close()`."""

    def __init__(self, rollouts: Any, server: Any, wiring: Any, actors: list[Any], info_path: str, seats: list[tuple[Any, str]]) -> None:
        self._rollouts, self._server, self._wiring, self._actors = rollouts, server, wiring, actors
        self._info_path = Path(info_path)
        self._seats = seats  # (Turns actor, seat name) of each actor that time-shares a trainer rank's devices
        self.timelines: list[dict[str, Any] | None] = []  # each actor's spans (`Tracer.export`), once closed

    def __getattr__(self, name: str) -> Any:
        return getattr(self._rollouts, name)

    def weights_wanted(self) -> Any:  # `ResendsWeights`: declared, for `isinstance` on any Python
        return self._rollouts.weights_wanted()

    def close(self) -> None:
        import ray  # noqa: PLC0415

        self._rollouts.stop()
        info = json.loads(self._info_path.read_text())
        self.timelines = [summary.pop("timeline", None) for summary in self._rollouts.summaries]  # for the run's timeline.json
        info["rollout_summaries"] = self._rollouts.summaries  # filled when the actors returned
        info["rollout_restarts"] = self._rollouts.restarts
        info["versions_replaced"] = self._rollouts.versions_replaced
        write_whole(self._info_path, json.dumps(info, indent=2) + "\n")
        for actor in self._actors:
            ray.kill(actor)
        # their state went with them: a trainer rank's next turn (a follower's, for the final
        # checkpoint and evaluation) must not wait for a seat that will never park
        ray.get([turns.leave.remote(seat) for turns, seat in self._seats])
        self._wiring.close()
        self._server.close()


def start_rollouts(
    cfg: Any, store: Any, settings: dict[str, int], *, groups: dict[str, Any], assignments: list[Any], spots: dict[Any, Any], turns: dict[int, Any], fake: bool, info_path: str, attempt: int = 0, ranks: list[dict[str, Any]] | None = None
) -> StartedRollouts:
    """Runs inside the trainer actor: serve the store and start the rollout actors, which
    build their engines in their own processes meanwhile; `.connect(trainer)` then wires
    the weights.

    A rollout instance that time-shares the trainer's devices goes on the trainer's bundle
    with its seat at that bundle's `Turns` actor (`turns`, by trainer rank), or at the
    `Turns` of every rank whose devices it spans.

    Each actor's worker seeds every generate call from the recipe's `seed`, the version and
    the rows it generates (`RolloutWorker.sample_seed`): with `max_staleness: 0` and one
    actor, a run resumed from a checkpoint, whose actors are new processes, samples what
    the uninterrupted run did (no generator state to save or restore).
    """
    import ray  # noqa: PLC0415

    from tidal.flow.ray.placement import actor_options  # noqa: PLC0415
    from tidal.flow.ray.runtime import RolloutActor  # noqa: PLC0415
    from tidal.flow.store.server import StoreServer  # noqa: PLC0415

    one_node = len([n for n in ray.nodes() if n.get("Alive")]) == 1
    host = "127.0.0.1" if one_node else ray.util.get_node_ip_address()
    token = secrets.token_hex(16)  # on loopback too: another user's process on a shared node reaches 127.0.0.1 as well
    server = StoreServer(store, address=f"tcp://{'127.0.0.1' if one_node else '0.0.0.0'}:0", token=token)
    address = server.address.replace("0.0.0.0", host)
    # Ray restarts a dead rollout actor (running __init__ again); a call in flight when it died fails.
    actor_cls = ray.remote(max_concurrency=4, max_restarts=cfg.fault.rollout_restarts, max_task_retries=0)(RolloutActor)
    actors = []
    for a in assignments:
        spot = spots[("rollout", a.rank)]
        env = {}
        if spot.turns and not spot.resources and ranks:  # a guest of a multi-device bundle, or of several: the trainers' devices
            env = _visible_devices([ranks[r] for r in spot.turns])
        options = actor_options(a, groups[spot.group], spot.bundle, fake=fake, env=env, resources=spot.resources)
        # a borrowed seat hands the groups the trainer's reclaim paused to the other instances
        seat = {"turns": [turns[r] for r in spot.turns], "seat": f"rollout-{a.rank}", "hand_off": a.mode == "borrowed"} if spot.turns else {}
        make_engine = functools.partial(make_rollout_engine, to_yaml(cfg), rank=a.rank)
        actors.append(actor_cls.options(**options).remote(make_engine, store_address=address, store_token=token, settings={**settings, "sample_seed": cfg.seed}, **seat))
    return StartedRollouts(cfg, server, address, actors, host, token, assignments, spots, turns, info_path, attempt, ranks)


@dataclasses.dataclass
class StartedRollouts:
    """Rollout actors started by `start_rollouts`, and the store server they reach at `address`."""

    cfg: Any
    server: Any
    address: str
    actors: list[Any]
    host: str
    token: str
    assignments: list[Any]
    spots: dict[Any, Any]
    turns: dict[int, Any]
    info_path: str
    attempt: int
    ranks: list[dict[str, Any]] | None

    def connect(self, trainer: Any) -> RemoteRollouts:
        """Wait for the actors, choose the weight transport, send them the trainer's weights."""
        import ray  # noqa: PLC0415

        from tidal.flow.ray.runtime import RayRollouts  # noqa: PLC0415
        from tidal.flow.ray.wiring import make_wiring  # noqa: PLC0415
        from tidal.hal import current_platform  # noqa: PLC0415
        from tidal.hal.platform import PlatformDescriptor  # noqa: PLC0415
        from tidal.hal.transfer import choose_transport  # noqa: PLC0415

        descriptions = ray.get([a.describe.remote() for a in self.actors])
        me = current_platform().descriptor
        my_node = ray.get_runtime_context().get_node_id()
        kinds = set()
        for a, d in zip(self.assignments, descriptions):
            theirs = PlatformDescriptor.from_dict(d["platform"])
            colocated = self.spots[("rollout", a.rank)].turns == (0,)  # on the sender's devices only: a guest of other ranks' is not
            kinds.add(choose_transport(me, theirs, same_node=d["node"] == my_node, colocated=colocated, override=self.cfg.transport.name if self.cfg.transport.name != "auto" else None))
        transport = "host" if len(kinds) > 1 else kinds.pop()  # one sender for every receiver
        bucket_bytes = self.cfg.transport.bucket_mb << 20
        wiring = make_wiring(transport, current_platform(), host=self.host, token=self.token, bucket_bytes=bucket_bytes)
        trainer_info = {"pid": os.getpid(), "attempt": self.attempt, "ranks": self.ranks or [], "node": my_node}
        seating = [{"rank": a.rank, "mode": a.mode, "bundle": [self.spots[("rollout", a.rank)].group, self.spots[("rollout", a.rank)].bundle], "resources": self.spots[("rollout", a.rank)].resources} for a in self.assignments]
        shared = any(self.spots[("rollout", a.rank)].turns for a in self.assignments)  # time-shares a trainer rank's devices
        overlap = self.cfg.transport.overlap and not shared
        if self.cfg.transport.overlap and shared:
            log.warning("transport.overlap is off: a rollout instance time-shares the trainer's devices, so each weight pass must end inside the trainer's turn")
        info = {"transport": transport, "overlap": overlap, "store": self.address, "trainer": trainer_info, "rollout_actors": descriptions, "rollout_seating": seating, "rollout_restarts": [0] * len(self.actors)}

        def write_info(descriptions: list[dict[str, Any]]) -> None:
            info.update(rollout_actors=descriptions, rollout_restarts=list(rollouts.restarts) if rollouts else info["rollout_restarts"])
            write_whole(Path(self.info_path), json.dumps(info, indent=2) + "\n")

        seats = [[(self.turns[r], f"rollout-{a.rank}") for r in self.spots[("rollout", a.rank)].turns] for a in self.assignments]  # each actor's, at each Turns it sits at

        def leave_seats(i: int) -> None:  # actor i died for good: a trainer turn must not wait for its state to park
            ray.get([turns.leave.remote(seat) for turns, seat in seats[i]])

        rollouts = None
        write_info(descriptions)
        fault = self.cfg.fault
        rollouts = RayRollouts(self.actors, wiring, max_restarts=fault.rollout_restarts, on_change=write_info, on_death=leave_seats, overlap=overlap, liveness_s=fault.liveness_s, grace_s=fault.liveness_grace_s)
        write_info(rollouts.descriptions)  # with Ray's count of restarts while the trainer warmed up
        if overlap and isinstance(wiring.sender, PlacesWeights):
            info["weights_in_place"] = _share_weights(trainer, wiring.sender, rollouts)
            write_info(rollouts.descriptions)
        rollouts.publish(trainer.version, trainer.named_weights())  # the actors start from the trainer's weights (a WeightSource: streamed per bucket)
        rollouts.flush()  # ... and have them before any prompt is admitted
        return RemoteRollouts(rollouts, self.server, wiring, self.actors, self.info_path, [seat for each in seats for seat in each])


def _share_weights(trainer: Any, sender: PlacesWeights, rollouts: Any) -> bool:
    """Keep the trainer's weights in the sender's buffer (`ipc`'s shared one), when its engine
    can (`share_weights`): a publish then copies nothing in the trainer's process (each
    rollout actor copies the version out of the trainer's own weights), and before its
    weights next change the engine waits for every actor to have taken the version
    (`rollouts.flush`; on this path it has, long before: a train step's forward and
    backward passes come first). False when the weights stay where they are."""
    if not isinstance(trainer, SharesWeights):
        return False
    try:
        trainer.share_weights(sender.place, before_change=rollouts.flush)
    except ValueError as e:  # raised before anything moved: each publish copies the weights instead
        log.info("the trainer's weights stay in its own memory (each publish copies them): %s", e)
        return False
    return True


def _visible_devices(ranks: list[dict[str, Any]]) -> dict[str, str]:
    """The visible-devices variables a guest of these trainer ranks' devices gets: theirs, joined."""
    out: dict[str, list[str]] = {}
    for rank in ranks:
        for var, value in rank.get("visible_devices", {}).items():
            if value is not None:
                joined = out.setdefault(var, [])
                joined += [v for v in value.split(",") if v and v not in joined]
    return {var: ",".join(values) for var, values in out.items()}


class TrainerActor:
    """Body of a trainer actor: one rank of the trainer. Rank 0 runs `train()` (rollout on
    actors); the other ranks, when there are several, follow rank 0's engines."""

    _group_store: Any = None  # rank 0's rendezvous store, made by `group_address`

    def ping(self) -> None:
        """Answers at once, beside `run` (the actor takes two calls at a time): the driver's liveness check."""

    def describe(self) -> dict[str, Any]:
        from tidal.hal import current_platform  # noqa: PLC0415

        return current_platform().descriptor.to_dict()

    def where(self) -> dict[str, Any]:
        """This rank's process, node and platform."""
        import ray  # noqa: PLC0415

        from tidal.hal import current_platform  # noqa: PLC0415

        var = current_platform().descriptor.visible_devices_var
        visible = {var: os.environ.get(var)} if var else {}
        context = ray.get_runtime_context()
        return {
            "pid": os.getpid(),
            "node": context.get_node_id(),
            "platform": self.describe(),
            "placement_group": context.get_placement_group_id(),
            "resources": context.get_assigned_resources(),
            "visible_devices": visible,
        }

    def group_address(self) -> str:
        """Rank 0: where the trainer ranks meet to form their process group (this node). The
        rendezvous store is made here, on a port the OS picks, and kept for `run`: a port
        probed free and bound later can be taken by another process in between."""
        import ray  # noqa: PLC0415
        import torch.distributed as dist  # noqa: PLC0415

        one_node = len([n for n in ray.nodes() if n.get("Alive")]) == 1
        host = "127.0.0.1" if one_node else ray.util.get_node_ip_address()
        self._group_store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=GROUP_TIMEOUT_S))
        return f"tcp://{host}:{self._group_store.port}"

    def run(
        self,
        cfg_yaml: str,
        run_dir: str,
        groups: dict[str, Any],
        rollout_assignments: list[Any],
        fake: bool,
        attempt: int = 0,
        *,
        rank: int = 0,
        ranks: list[dict[str, Any]] | None = None,
        group_address: str | None = None,
        spots: dict[Any, Any] | None = None,
        turns: dict[int, Any] | None = None,
        stopper: Any = None,
    ) -> dict[str, Any]:
        """Train (rank 0) or follow rank 0 (the others); after a restart (`attempt` > 0) resume from the run's last checkpoint.

        `groups` are the placement groups by role, `spots` every actor's bundle
        (`flow.colocate.spots`), `turns` the `Turns` actors of shared trainer bundles,
        `stopper` the `StopSignal` actor through which the driver asks rank 0 to stop early.
        """
        from tidal.hal import current_platform  # noqa: PLC0415

        cfg = _config_from_yaml(cfg_yaml)
        world_size = len(ranks or ()) or 1
        placed = {"groups": groups, "spots": spots or {}, "turns": turns or {}}
        if world_size == 1:
            return self._train(cfg, run_dir, placed, rollout_assignments, fake, attempt, ranks=ranks, stopper=stopper)
        import torch  # noqa: PLC0415
        import torch.distributed as dist  # noqa: PLC0415

        from tidal.engines.fsdp_lead import stop_followers  # noqa: PLC0415

        threads = stage_threads(cfg, "train")
        if threads and rank:  # followers only take RL steps; rank 0's `train()` sets them for its RL phase
            torch.set_num_threads(threads)
        store = self._group_store if rank == 0 else None
        current_platform().init_process_group(rank=rank, world_size=world_size, init_method=group_address, timeout_s=GROUP_TIMEOUT_S, store=store)
        try:
            if rank:
                return {"rank": rank, **self.where(), **self._follow(cfg.train.backend, placed["turns"].get(rank))}
            summary = self._train(cfg, run_dir, placed, rollout_assignments, fake, attempt, ranks=ranks, engine_options={"rank0_leads": True}, stopper=stopper)
            stop_followers()
            return summary
        finally:
            dist.destroy_process_group()

    def _follow(self, backend: str, turns: Any) -> dict[str, Any]:
        """A rank other than 0: follow rank 0; with `turns` (a `Turns` actor: a rollout guest
        time-shares this rank's devices) each engine it builds is seated there and computes
        in the turn rank 0 took for it (`Seat.held`), and the result says what happened on
        these devices (`timeshare`, as rank 0's summary does)."""
        from tidal.engines.registry import follower  # noqa: PLC0415

        follow = follower(backend)  # the train backend's (`MULTI_RANK`)
        if turns is None:
            return follow()
        from tidal.flow.colocate import Sharing, TurnsProxy  # noqa: PLC0415
        from tidal.hal import current_platform  # noqa: PLC0415

        last: dict[str, Any] = {}

        class Seated:
            """An engine's seat at this rank's `Turns`; closing it drops the seat (and its parked copy)."""

            def __init__(self, engine: Any) -> None:
                self.sharing = Sharing(TurnsProxy(turns), current_platform())
                self.turn = self.sharing.train(engine).seat.held  # rank 0 took this rank's turn before it sent the command

            def close(self) -> None:
                self.sharing.close()
                last["timeshare"] = self.sharing.summary()  # the last engine's: RL's (the warm start's runs before any guest)
                self.sharing = None

        return {**follow(Seated), "timeshare": last.get("timeshare")}

    def _train(self, cfg: Any, run_dir: str, placed: dict[str, Any], rollout_assignments: list[Any], fake: bool, attempt: int, *, ranks: Any, engine_options: dict[str, Any] | None = None, stopper: Any = None) -> dict[str, Any]:
        from tidal.flow.colocate import TurnsProxy  # noqa: PLC0415
        from tidal.flow.timeshare import TurnsSpan  # noqa: PLC0415
        from tidal.tools.train import train  # noqa: PLC0415

        if attempt:
            if (Path(run_dir) / "checkpoints" / "latest").exists():
                cfg.resume = run_dir
            else:  # died before its first checkpoint: start over
                (Path(run_dir) / "metrics.jsonl").unlink(missing_ok=True)
        info_path = str(Path(run_dir) / "runtime.json")
        starter = functools.partial(start_rollouts, assignments=rollout_assignments, fake=fake, info_path=info_path, attempt=attempt, ranks=ranks, **placed)
        turns = None  # this rank time-shares its devices with rollout seats: it takes every rank's turn, in rank order, and parks its own state
        if placed["turns"]:
            every = [TurnsProxy(placed["turns"][r]) for r in sorted(placed["turns"])]
            turns = every[0] if len(every) == 1 else TurnsSpan(every, parks_on=every[:1])
        stop = relay_stop(stopper) if stopper is not None else None
        try:
            summary = train(cfg, Path(run_dir), progress=False, start_rollouts=starter, engine_options=engine_options, turns=turns, stop=stop)
        finally:
            if stopper is not None:
                stopper.release.remote()  # the relay thread's wait returns
        summary["trainer_platform"] = self.describe()
        summary["trainer_restarts"] = attempt
        write_whole(Path(run_dir) / "summary.json", json.dumps(finite(summary), indent=2, allow_nan=False) + "\n")
        return summary


GROUP_TIMEOUT_S = 600.0
"""How long a trainer rank's collective waits for the others (a dead rank fails it at once on
CPU; this bounds a rank that hangs)."""
DEATH_NOTICE_S = 15.0
"""After a trainer rank fails, how long the driver waits to hear that another rank died (then
the failure is a restart, not an error)."""


def init_ray(cfg: Any) -> None:
    """Join the cluster at RAY_ADDRESS, else start a local Ray (`ray_address`: the rule `tidal
    plan` follows too); a fake cluster's devices become its resources (its cpu devices
    Ray's CPUs, when they outnumber the machine's cores)."""
    import ray  # noqa: PLC0415

    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if address := ray_address():
        ray.init(address=address, include_dashboard=False, logging_level="ERROR")
        return
    resources: dict[str, float] = {}
    if cfg.cluster.fake:
        from tidal.hal.platform import describe  # noqa: PLC0415

        for node in cfg.cluster.nodes:
            if node.kind != "cpu":
                descriptor = describe(node.kind, device_count=node.devices, fake=True)
                # The fake devices are not the machine's: a real visible-devices variable in
                # this environment would make Ray refuse the declared count.
                os.environ.pop(descriptor.visible_devices_var, None)
                key = descriptor.ray_resource
                resources[key] = resources.get(key, 0) + node.devices * node.count
            for tag in node.tags:  # as a Ray cluster's nodes would declare them (--resources)
                resources[tag] = resources.get(tag, 0) + node.devices * node.count
    num_gpus = resources.pop("GPU", None)  # None: Ray counts the machine's own GPUs
    num_cpus = os.cpu_count()
    if cfg.cluster.fake:  # its cpu devices are declared too (processes, not cores): more than the machine has oversubscribe it
        num_cpus = max(num_cpus or 1, sum(n.devices * n.count for n in cfg.cluster.nodes if n.kind == "cpu"))
    if resources.get("NPU"):
        # Ray looks up the NPU model (through CANN's `acl`) when a node declares NPUs and logs
        # a traceback when it cannot; a fake cluster has no NPU to look up.
        logging.getLogger("ray._private.accelerators.npu").setLevel(logging.CRITICAL)
    ray.init(address="local", num_cpus=num_cpus, num_gpus=num_gpus, resources=resources or None, include_dashboard=False, logging_level="ERROR")


def run_on_ray(cfg: Any, run_dir: Path, *, progress: bool = True) -> dict[str, Any]:
    """The driver: plan, placement groups, trainer actor; returns the run's summary."""
    import ray  # noqa: PLC0415

    from tidal.flow.colocate import spots, start_turns  # noqa: PLC0415
    from tidal.flow.placement import PlacementError  # noqa: PLC0415
    from tidal.flow.ray.placement import actor_options, placement_groups  # noqa: PLC0415
    from tidal.tools.plan import make_plan  # noqa: PLC0415

    if not cfg.cluster.nodes:
        init_ray(cfg)
    plan, _ = make_plan(cfg, ray_nodes=ray.nodes)  # with the recipe's nodes: checked before Ray starts
    init_ray(cfg)
    check_runnable(cfg)
    num_ranks = len(plan.of("train"))
    try:
        groups = placement_groups(plan)
    except PlacementError as e:
        raise ConfigError(f"placement: {e}") from None
    fake = bool(cfg.cluster.fake)
    trainer_cls = ray.remote(max_restarts=0, max_concurrency=2)(TrainerActor)
    stopper_cls = ray.remote(num_cpus=0)(StopSignal)
    placed = spots(plan)  # checked by placement_groups already
    stop = StopRequest()  # Ctrl-C / SIGTERM here: rank 0 stops after its current step, with a checkpoint
    stop.on_request(lambda reason: print(f"tidal: {reason}: the run stops after the trainer's current step, with a checkpoint (again to stop at once)", file=sys.stderr))
    try:
        for attempt in range(cfg.fault.trainer_restarts + 1):
            # fresh each attempt: no claim (or blocked call) of the last attempt's dead seats stays
            turns = start_turns(placed, groups)
            stopper = stopper_cls.remote()
            stop.on_request(lambda reason, stopper=stopper: stopper.request.remote(reason))
            watch: Liveness | None = None
            ranks = [trainer_cls.options(**actor_options(a, groups["train"], i, fake=fake, resources=placed[("train", a.rank)].resources)).remote() for i, a in enumerate(plan.of("train"))]
            try:
                where = ray.get([r.where.remote() for r in ranks])
                try:
                    check_guests_on_one_node(placed, where)
                except PlacementError as e:
                    raise ConfigError(f"placement: {e}") from None
                address = ray.get(ranks[0].group_address.remote()) if num_ranks > 1 else None
                refs = [
                    r.run.remote(to_yaml(cfg), str(run_dir), groups, plan.of("rollout"), fake, attempt, rank=i, ranks=where, group_address=address, spots=placed, turns=turns, stopper=stopper)
                    for i, r in enumerate(ranks)
                ]
                watch = Liveness(ranks, lambda i, where=where: f"trainer rank {i} (pid {where[i]['pid']})", silent_s=cfg.fault.liveness_s, grace_s=cfg.fault.liveness_grace_s)
                with stop_on_signals(stop):
                    summary, *followers = _wait_with_progress(refs, run_dir / "metrics.jsonl", total=cfg.algorithm.num_steps, progress=progress, watch=watch)
                if followers:
                    for follower in (f for f in followers if f.get("timeshare") is not None):  # labelled as rank 0's (tools/train.py): this attempt's
                        follower["timeshare"] = {"since_version": summary.get("resumed_at", 0), **follower["timeshare"]}
                    summary["trainer_ranks"] = [{"rank": 0, **where[0]}, *followers]
                    write_whole(run_dir / "summary.json", json.dumps(finite(summary), indent=2, allow_nan=False) + "\n")
                return summary
            except ray.exceptions.RayActorError as e:  # a trainer process died (rank 0's rollout actors with it)
                if not rank_died(e):  # a rank raised it (say, a rollout actor that cannot be built): an error, not a death
                    raise
                if stop.reason is not None:  # asked to stop: no restart
                    raise RunStopped(stop.reason) from None
                why = "killed after it stopped answering (fault.liveness_s)" if watch is not None and watch.killed else death_summary(e)
                if attempt == cfg.fault.trainer_restarts:
                    raise ActorLost(f"the trainer died {attempt + 1} times (fault.trainer_restarts={cfg.fault.trainer_restarts}): {why}") from None
                log.warning("the trainer died (%s); resuming from the last checkpoint (restart %d of %d)", why, attempt + 1, cfg.fault.trainer_restarts)
            finally:
                for r in ranks:
                    ray.kill(r)
                for actor in [*turns.values(), stopper]:
                    ray.kill(actor)
        raise AssertionError("unreachable")
    finally:
        for pg in groups.values():
            ray.util.remove_placement_group(pg)


def check_guests_on_one_node(placed: dict[Any, Any], where: list[dict[str, Any]]) -> None:
    """A rollout guest of several trainer ranks' devices gets all of them (`_visible_devices`):
    the ranks must be on one node, which the trainer's "PACK" placement group prefers but
    does not promise. `placed`: `flow.colocate.spots`; `where`: each rank's `TrainerActor.where`.

    Raises:
        PlacementError: naming the rollout instance, the ranks, their nodes and the fix.
    """
    from tidal.flow.placement import PlacementError  # noqa: PLC0415

    for (role, rank), spot in placed.items():
        nodes = sorted({where[r]["node"] for r in spot.turns})
        if role == "rollout" and len(nodes) > 1:
            raise PlacementError(
                f"rollout instance {rank} time-shares the devices of trainer ranks {list(spot.turns)}, which Ray placed on {len(nodes)} nodes ({', '.join(nodes)}): "
                "one process uses devices of one node; set placement.rollout.devices_each=1 (a guest per trainer rank), or give the trainer one node's devices"
            )


def _wait_with_progress(refs: list[Any], metrics_path: Path, *, total: int, progress: bool, watch: Liveness | None = None) -> list[Any]:
    """Wait for every trainer rank, showing the steps from metrics.jsonl (display only: checked once
    a second); return each rank's result. A rank silent too long for `watch` (its actors: the
    ranks) is killed, which is a death.

    Raises:
        RayActorError: a rank died (also when another rank's failure was caused by that death).
        RayTaskError: a rank failed and none died: rank 0's error when it failed too (see `_first_error`).
    """
    import ray  # noqa: PLC0415
    from rich.console import Console  # noqa: PLC0415
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn  # noqa: PLC0415

    bar = Progress(TextColumn("[bold]RL[/bold] step {task.completed}/{task.total}"), BarColumn(), TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=Console(stderr=True), disable=not progress)
    task = bar.add_task("rl", total=total, info="starting actors")
    results: dict[Any, Any] = {}
    pending = list(refs)
    with bar:
        while pending:
            done, pending = ray.wait(pending, timeout=1.0 if watch is None or not watch.on else min(1.0, watch.every_s))
            for i in [] if watch is None else watch.check():
                ray.kill(watch.actors[i])  # its call fails: a death, which the caller restarts
            if (m := last_metrics(metrics_path)) is not None:  # a resumed trainer rewrites the file: show its last step
                bar.update(task, completed=m["step"], info="reward " + ("-" if m["reward"] is None else f"{m['reward']:.2f}"))  # null: NaN
            for ref in done:
                try:
                    results[ref] = ray.get(ref)
                except Exception as e:  # a rank failed: was it because another one died?
                    if rank_died(e):
                        raise
                    raise _first_error(refs, {ref: e}) from None
    return [results[ref] for ref in refs]


def _first_error(refs: list[Any], failed: dict[Any, Exception]) -> Exception:
    """After a rank raised (`failed`), wait up to `DEATH_NOTICE_S` for the others (a death is
    raised at once: a restart). Report rank 0's error if it failed (a follower fails with
    "Connection closed by peer" once rank 0 gives up its group, and may be heard first),
    else the first heard; each other rank's error is added as a note."""
    import ray  # noqa: PLC0415

    deadline = time.monotonic() + DEATH_NOTICE_S
    rest = [r for r in refs if r not in failed]
    while rest and time.monotonic() < deadline:
        done, rest = ray.wait(rest, timeout=max(deadline - time.monotonic(), 0.0))
        for ref in done:
            try:
                ray.get(ref)
            except Exception as e:  # another consequence of the same failure, unless it is the death
                if rank_died(e):
                    raise
                failed[ref] = e
    first = failed.get(refs[0], next(iter(failed.values())))
    for rank, ref in enumerate(refs):
        other = failed.get(ref)
        if other is not None and other is not first:
            cause = remote_cause(other)
            first.add_note(f"trainer rank {rank} failed too: {cause}" if isinstance(cause, ActorLost) else f"trainer rank {rank} failed too: {type(cause).__name__}: {cause}")
    return first

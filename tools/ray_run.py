"""`tidal run` under `runtime: ray`: the glue between the recipe and `tidal.flow.ray`.

The driver (the `tidal run` process) connects to Ray (RAY_ADDRESS, else a local
instance it starts; with `cluster.fake: true` that instance declares the recipe's NPUs
and GPUs as resources so the plan runs on CPU: `init_ray`), schedules the plan, creates
one placement group per role (failing within seconds, naming the role, when the cluster
cannot hold it) and starts one `flow.ray.trainer.TrainerActor` per `placement.train`
instance on its bundle (`run_on_ray`), restarting them from the last checkpoint when one
dies (`fault.trainer_restarts`). What this module adds is what a trainer rank computes,
handed to the actor as picklable callables: rank 0 runs `train_rank0`, the same
`train()` as the local runtime, whose rollout stage is the rollout actors
(`flow.ray.rollouts.start_rollouts`, each building its engine with `make_rollout_engine`;
a rollout instance that time-shares the trainer's devices sits on the trainer's bundle,
taking turns through that bundle's `Turns` actor: `flow.colocate`). Several trainer ranks
(the `fsdp` and `deepspeed` backends: `MULTI_RANK`) form one process group at rank 0's
address (the actor does that); rank 0's engines lead (`rank0_leads=True`), and the
others run `follow_rank0`, their backend's `follow()` on their share of each batch. The
driver shows progress from the run directory's metrics.jsonl (which must be reachable
from the trainer's node); Ctrl-C or SIGTERM there reaches rank 0 through `tools.ray_stop`.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sys
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tidal.flow.files import write_whole
from tidal.flow.ray.faults import ActorLost, death_summary, rank_died
from tidal.flow.ray.liveness import Liveness, StepStall
from tidal.flow.ray.placement import check_guests_on_one_node, ray_address
from tidal.flow.ray.rollouts import RolloutSetup, StartedRollouts, start_rollouts
from tidal.flow.ray.trainer import TrainerActor, wait_ranks
from tidal.tools.config import ConfigError, RecipeConfig, config_from_yaml, stage_threads, to_yaml
from tidal.tools.metrics import finite, last_metrics
from tidal.tools.ray_stop import StopSignal, relay_stop
from tidal.tools.run import check_runnable
from tidal.tools.stopping import RunStopped, StopRequest, stop_on_signals

if TYPE_CHECKING:
    from tidal.flow.store import Store

log = logging.getLogger(__name__)


def make_rollout_engine(cfg_yaml: str, *, rank: int) -> Any:
    """Runs inside rollout actor `rank`: the recipe's rollout engine on the actor's platform,
    its generators seeded from `seed` and `rank` (each instance its own stream; the actor's
    worker seeds each generate call afresh: `start_rollouts`). It starts from freshly
    initialised weights (an engine that loads `model.path` itself, `BuildsFromCheckpoint`:
    from the checkpoint's, the model not built here); the trainer's current version arrives
    over the weight transport before the first generate."""
    from tidal.engines.models import model_source  # noqa: PLC0415
    from tidal.engines.registry import load  # noqa: PLC0415
    from tidal.flow.protocols import BuildsFromCheckpoint  # noqa: PLC0415
    from tidal.hal import current_platform  # noqa: PLC0415
    from tidal.tools.rl import build_rollout_engine  # noqa: PLC0415

    cfg = config_from_yaml(cfg_yaml)
    threads = stage_threads(cfg, "rollout")
    if threads:
        import torch  # noqa: PLC0415

        torch.set_num_threads(threads)
    platform = current_platform()
    source = model_source(cfg.model)
    if isinstance(load("rollout.backend", cfg.rollout.backend), BuildsFromCheckpoint):  # it loads model.path itself, on its own devices
        tokenizer, model = source.load_tokenizer(Path(cfg.model.path)), None
    else:
        policy = source.build(seed=cfg.seed)  # the tiny model: from `seed`, as every instance's
        tokenizer, model = policy.tokenizer, policy.module.to(platform.device(0))
    platform.seed_all(cfg.seed + 7_919 * (rank + 1))
    return build_rollout_engine(cfg, model, tokenizer, platform=platform, version=-1)


def rollout_setup(cfg: RecipeConfig) -> RolloutSetup:
    """What `flow.ray.rollouts` reads of the recipe."""
    return RolloutSetup(
        seed=cfg.seed,
        max_restarts=cfg.fault.rollout_restarts,
        liveness_s=cfg.fault.liveness_s,
        liveness_grace_s=cfg.fault.liveness_grace_s,
        transport=cfg.transport.name if cfg.transport.name != "auto" else None,
        bucket_bytes=cfg.transport.bucket_mb << 20,
        overlap=cfg.transport.overlap,
    )


def _start_rollouts(cfg: RecipeConfig, store: Store, settings: dict[str, int], **placed: Any) -> StartedRollouts:
    """`train()`'s `start_rollouts` on Ray: `flow.ray.rollouts.start_rollouts`, each actor
    building the recipe's engine (`make_rollout_engine`); `placed`: where they go."""
    make_engine = functools.partial(make_rollout_engine, to_yaml(cfg))
    return start_rollouts(store, settings, make_engine=make_engine, setup=rollout_setup(cfg), **placed)


def train_rank0(
    cfg_yaml: str, run_dir: str, placed: dict[str, Any], rollout_assignments: list[Any], fake: bool, attempt: int, stopper: Any, *, ranks: list[dict[str, Any]], turns: Any
) -> dict[str, Any]:
    """Trainer rank 0 (`TrainerActor`'s `lead`): `train()`, its rollout stage on actors; after a
    restart (`attempt` > 0) resumed from the run's last checkpoint.

    `placed`: the placement groups by role, every actor's bundle (`flow.colocate.spots`), and
    the `Turns` actors of shared trainer bundles, by rank, with the name they were started
    under; `stopper`: the `StopSignal` actor
    through which the driver asks it to stop early. `ranks` and `turns` come from the actor:
    with several ranks this rank's engines lead the others', and it ends their `follow()`
    when it is done (`stop_followers`).
    """
    from tidal.hal import current_platform  # noqa: PLC0415
    from tidal.tools.train import train  # noqa: PLC0415

    cfg = config_from_yaml(cfg_yaml)
    if attempt:
        if (Path(run_dir) / "checkpoints" / "latest").exists():
            cfg.resume = run_dir
        else:  # died before its first checkpoint: start over
            (Path(run_dir) / "metrics.jsonl").unlink(missing_ok=True)
    info_path = str(Path(run_dir) / "runtime.json")
    starter = functools.partial(_start_rollouts, assignments=rollout_assignments, fake=fake, info_path=info_path, attempt=attempt, ranks=ranks, **placed)
    leads = len(ranks) > 1
    stop = relay_stop(stopper) if stopper is not None else None
    try:
        summary = train(cfg, Path(run_dir), progress=False, start_rollouts=starter, engine_options={"rank0_leads": True} if leads else None, turns=turns, stop=stop)
    finally:
        if stopper is not None:
            stopper.release.remote()  # the relay thread's wait returns
    summary["trainer_platform"] = current_platform().descriptor.to_dict()
    summary["trainer_restarts"] = attempt
    write_whole(Path(run_dir) / "summary.json", json.dumps(finite(summary), indent=2, allow_nan=False) + "\n")
    if leads:
        from tidal.engines.fsdp_lead import stop_followers  # noqa: PLC0415

        stop_followers()
    return summary


def follow_rank0(backend: str, share: Any = None) -> dict[str, Any]:
    """Every trainer rank but 0 (`TrainerActor`'s `follow`): the train backend's follower
    (`MULTI_RANK`), until rank 0 ends it; `share` seats its engines (`TrainerActor`)."""
    from tidal.engines.registry import follower  # noqa: PLC0415

    return follower(backend)(share)


def init_ray(cfg: RecipeConfig) -> None:
    """Join the cluster at RAY_ADDRESS, else start a local Ray (`ray_address`: the rule `tidal
    plan` follows too); a fake cluster's devices become its resources (its cpu devices
    Ray's CPUs, when they outnumber the machine's cores)."""
    import ray  # noqa: PLC0415

    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if address := ray_address():
        ray.init(address=address, include_dashboard=False, logging_level=logging.ERROR)
        return
    resources: dict[str, float] = {}
    if cfg.cluster.fake:
        from tidal.hal.platform import describe  # noqa: PLC0415

        for node in cfg.cluster.nodes:
            if node.kind != "cpu":
                descriptor = describe(node.kind, device_count=node.devices, fake=True)
                # The fake devices are not the machine's: a real visible-devices variable in
                # this environment would make Ray refuse the declared count.
                if descriptor.visible_devices_var is not None:
                    os.environ.pop(descriptor.visible_devices_var, None)
                key = descriptor.ray_resource
                resources[key] = resources.get(key, 0) + node.devices * node.count
            for tag in node.tags:  # as a Ray cluster's nodes would declare them (--resources)
                resources[tag] = resources.get(tag, 0) + node.devices * node.count
    gpus = resources.pop("GPU", None)  # None: Ray counts the machine's own GPUs
    num_gpus = None if gpus is None else int(gpus)
    num_cpus = os.cpu_count()
    if cfg.cluster.fake:  # its cpu devices are declared too (processes, not cores): more than the machine has oversubscribe it
        num_cpus = max(num_cpus or 1, sum(n.devices * n.count for n in cfg.cluster.nodes if n.kind == "cpu"))
    if resources.get("NPU"):
        # Ray looks up the NPU model (through CANN's `acl`) when a node declares NPUs and logs
        # a traceback when it cannot; a fake cluster has no NPU to look up.
        logging.getLogger("ray._private.accelerators.npu").setLevel(logging.CRITICAL)
    ray.init(address="local", num_cpus=num_cpus, num_gpus=num_gpus, resources=resources or None, include_dashboard=False, logging_level=logging.ERROR)


def _request_stop(stopper: Any, reason: str) -> None:
    stopper.request.remote(reason)


def _trainer_rank(where: list[dict[str, Any]], i: int) -> str:
    return f"trainer rank {i} (pid {where[i]['pid']})"


def run_on_ray(cfg: RecipeConfig, run_dir: Path, *, progress: bool = True) -> dict[str, Any]:
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
    if ray_address() is not None:  # a cluster this run joined: every node is checked before any actor starts on one
        from tidal.tools.cluster import refuse_bad_cluster  # noqa: PLC0415

        refuse_bad_cluster(cfg)
    num_ranks = len(plan.of("train"))
    try:
        groups = placement_groups(plan)
    except PlacementError as e:
        raise ConfigError(f"placement: {e}") from None
    fake = bool(cfg.cluster.fake)
    follow = functools.partial(follow_rank0, cfg.train.backend) if num_ranks > 1 else None
    trainer_cls = ray.remote(max_restarts=0, max_concurrency=2)(TrainerActor)  # type: ignore[call-overload]  # Ray's stubs lack max_concurrency; ray.remote takes it
    stopper_cls = ray.remote(num_cpus=0)(StopSignal)
    placed = spots(plan)  # checked by placement_groups already
    stop = StopRequest()  # Ctrl-C / SIGTERM here: rank 0 stops after its current step, with a checkpoint
    stop.on_request(lambda reason: print(f"tidal: {reason}: the run stops after the trainer's current step, with a checkpoint (again to stop at once)", file=sys.stderr))
    try:
        for attempt in range(cfg.fault.trainer_restarts + 1):
            # fresh each attempt: no claim (or blocked call) of the last attempt's dead seats stays
            turns_name = f"tidal-turns-{uuid.uuid4().hex}"  # the rollout actors look them up by it
            turns = start_turns(placed, groups, name=turns_name)
            stopper = stopper_cls.remote()
            stop.on_request(functools.partial(_request_stop, stopper))
            watch: Liveness | None = None
            lead = functools.partial(train_rank0, to_yaml(cfg), str(run_dir), {"groups": groups, "spots": placed, "turns": turns, "turns_name": turns_name}, plan.of("rollout"), fake, attempt, stopper)
            options = [actor_options(a, groups["train"], i, fake=fake, resources=placed[("train", a.rank)].resources) for i, a in enumerate(plan.of("train"))]
            ranks = [trainer_cls.options(**o).remote(lead, follow, follower_threads=stage_threads(cfg, "train")) for o in options]
            try:
                where = ray.get([r.where.remote() for r in ranks])
                try:
                    check_guests_on_one_node(placed, where)
                except PlacementError as e:
                    raise ConfigError(f"placement: {e}") from None
                address = ray.get(ranks[0].group_address.remote()) if num_ranks > 1 else None
                refs = [r.run.remote(rank=i, ranks=where, group_address=address, turns=turns) for i, r in enumerate(ranks)]
                watch = Liveness(ranks, functools.partial(_trainer_rank, where), silent_s=cfg.fault.liveness_s, grace_s=cfg.fault.liveness_grace_s)
                with stop_on_signals(stop):
                    stall = StepStall(f"trainer ranks: {', '.join(str(w['pid']) for w in where)}; rollout actors: runtime.json's rollout_actors")
                    summary, *followers = _wait_with_progress(refs, run_dir / "metrics.jsonl", total=cfg.algorithm.num_steps, progress=progress, watch=watch, stall=stall)
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


def _wait_with_progress(refs: list[Any], metrics_path: Path, *, total: int, progress: bool, watch: Liveness | None = None, stall: StepStall | None = None) -> list[Any]:
    """`flow.ray.trainer.wait_ranks`, showing the steps from metrics.jsonl (display only:
    read about once a second): every rank's result, or its death or error raised. `stall`
    says so when the steps stop (`flow.ray.liveness.StepStall`), with or without the bar."""
    from rich.console import Console  # noqa: PLC0415
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn  # noqa: PLC0415

    bar = Progress(TextColumn("[bold]RL[/bold] step {task.completed}/{task.total}"), BarColumn(), TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=Console(stderr=True), disable=not progress)
    task = bar.add_task("rl", total=total, info="starting actors")

    def show() -> None:
        if (m := last_metrics(metrics_path)) is not None:  # a resumed trainer rewrites the file: show its last step
            bar.update(task, completed=m["step"], info="reward " + ("-" if m["reward"] is None else f"{m['reward']:.2f}"))  # null: NaN
        if stall is not None and (message := stall.check(None if m is None else m["step"])) is not None:
            bar.console.print(f"tidal: {message}", markup=False, highlight=False, soft_wrap=True)

    with bar:
        return wait_ranks(refs, watch=watch, tick=show)

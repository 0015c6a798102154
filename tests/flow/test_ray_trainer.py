"""`flow.ray.trainer.TrainerActor`: a trainer rank on Ray runs the body it was given as callables."""

from __future__ import annotations

import functools
import os


def lead_alone(label: str, *, ranks, turns) -> dict:
    """A lead of one rank: no process group is formed around it."""
    import torch.distributed as dist

    return {"label": label, "pid": os.getpid(), "num_ranks": len(ranks), "turns": turns, "group": dist.is_initialized()}


def lead_in_group(*, ranks, turns) -> dict:
    """Rank 0 of two: sends the follower one tensor and its end (as `stop_followers` would), over gloo."""
    import torch
    import torch.distributed as dist

    assert dist.get_world_size() == 2 and dist.get_rank() == 0
    dist.send(torch.tensor([41.0]), dst=1)
    got = torch.zeros(1)
    dist.recv(got, src=1)
    return {"world_size": dist.get_world_size(), "rank": dist.get_rank(), "backend": dist.get_backend(), "got": got.item(), "num_ranks": len(ranks)}


def follow_in_group(scale: float, share) -> dict:
    """Every other rank: answers rank 0's tensor, times `scale` (bound with `functools.partial`)."""
    import torch
    import torch.distributed as dist

    got = torch.zeros(1)
    dist.recv(got, src=0)
    dist.send(got * scale, dst=0)
    return {"world_size": dist.get_world_size(), "rank": dist.get_rank(), "got": got.item(), "share": share, "threads": torch.get_num_threads()}


def test_a_trainer_of_one_rank_runs_its_lead_and_returns_its_result(ray_session):
    import ray

    from tidal.flow.ray.trainer import TrainerActor

    actor = ray.remote(num_cpus=0, max_concurrency=2)(TrainerActor).remote(functools.partial(lead_alone, "rank 0"))
    try:
        where = ray.get(actor.where.remote())
        ray.get(actor.ping.remote())
        result = ray.get(actor.run.remote(ranks=[where]), timeout=60)
    finally:
        ray.kill(actor)
    assert result == {"label": "rank 0", "pid": where["pid"], "num_ranks": 1, "turns": None, "group": False}
    assert where["pid"] != os.getpid() and where["platform"]["kind"] == "cpu"


def test_two_ranks_form_one_process_group_and_rank_1_runs_the_follower(ray_session):
    import ray

    from tidal.flow.ray.trainer import TrainerActor

    cls = ray.remote(num_cpus=0, max_concurrency=2)(TrainerActor)
    ranks = [cls.remote(lead_in_group, functools.partial(follow_in_group, 2.0), follower_threads=3) for _ in range(2)]
    try:
        where = ray.get([r.where.remote() for r in ranks])
        address = ray.get(ranks[0].group_address.remote())
        lead, follower = ray.get([r.run.remote(rank=i, ranks=where, group_address=address) for i, r in enumerate(ranks)], timeout=120)
    finally:
        for r in ranks:
            ray.kill(r)
    assert address.startswith("tcp://127.0.0.1:")
    assert lead == {"world_size": 2, "rank": 0, "backend": "gloo", "got": 82.0, "num_ranks": 2}
    assert follower["world_size"] == 2 and follower["rank"] == 1 and follower["got"] == 41.0
    assert follower["share"] is None and follower["threads"] == 3  # no Turns for rank 1; `follower_threads` set
    assert follower["pid"] == where[1]["pid"] != where[0]["pid"]  # the result says where it ran
    assert "timeshare" not in follower

"""`runtime: ray`: the run's store and the stages around the trainer, in an actor of their own.

The stages actor holds the store (new, or the one a resumed run saved), serves it over
ZeroMQ to the trainer and the rollout actors, and runs the loader, reward and advantage
stages (`flow.stages.Stages`) as its threads. The trainer's process then only trains:
measured on the 2-vCPU quickstart, those stages and the store server took about 4 ms of
the GIL a step from the trainer's thread when they were threads of its process.

The trainer rank 0 starts it (`start_stages`) on its own node, with no CPU of its own
(it is a few threads that mostly wait), so it fits whatever placement the run has; the
actor is the trainer's, so it dies with the trainer and a restarted trainer starts a new
one from the last checkpoint. `RayStages` is the trainer's side: a `StageGroup`, with the
store client, and the few Ray calls the loop makes (start, watch, stop; metrics at most
every `METRICS_EVERY_S`; save at each checkpoint).
"""

from __future__ import annotations

import os
import secrets
import time
from pathlib import Path
from typing import Any

METRICS_EVERY_S = 0.5
"""How often the trainer asks the stages actor for its metrics (a Ray call costs the
trainer's step 2-3 ms): failed rewards and stage waits show up in the step that collected them."""
CLOSE_WAIT_S = 30.0
"""How long closing waits for the stages actor's timeline before it is killed anyway."""


class StagesActor:
    """Body of the stages actor: the store, its server, and (after `prepare`) the stages."""

    def __init__(self, cfg_yaml: str, store_path: str | None) -> None:
        import ray  # noqa: PLC0415
        import torch  # noqa: PLC0415

        from tidal.flow.store import Store, persist  # noqa: PLC0415
        from tidal.flow.store.server import StoreServer  # noqa: PLC0415
        from tidal.flow.trace import Tracer  # noqa: PLC0415
        from tidal.tools.ray_run import _config_from_yaml  # noqa: PLC0415

        torch.set_num_threads(1)  # small tensor ops: the reward and advantage stages
        self.cfg = _config_from_yaml(cfg_yaml)
        self.store = persist.load(store_path) if store_path else Store()
        one_node = len([n for n in ray.nodes() if n.get("Alive")]) == 1
        host = "127.0.0.1" if one_node else ray.util.get_node_ip_address()
        self.token = None if one_node else secrets.token_hex(16)
        self.server = StoreServer(self.store, address=f"tcp://{'127.0.0.1' if one_node else '0.0.0.0'}:0", token=self.token)
        self.address = self.server.address.replace("0.0.0.0", host)
        self.tracer = Tracer(process="stages")
        self.stages: Any = None

    def where(self) -> dict[str, Any]:
        """The store's address and token, and this process."""
        return {"address": self.address, "token": self.token, "pid": os.getpid()}

    def prepare(self, version: int, position: int) -> None:
        """Create the stages (and the store's partitions) at policy `version`, the prompt stream at `position`."""
        from tidal.engines.tiny import CharTokenizer  # noqa: PLC0415
        from tidal.flow.stages import Stages  # noqa: PLC0415
        from tidal.tools.train import Prompts, held_out_prompts, make_score, workflow_config  # noqa: PLC0415

        tokenizer = CharTokenizer()
        prompts = Prompts(self.cfg, tokenizer, held_out_prompts(self.cfg)[1], position=position)
        self.stages = Stages(store=self.store, prompts=prompts, score=make_score(self.cfg, tokenizer), config=workflow_config(self.cfg), version=version, tracer=self.tracer)

    def start(self) -> None:
        self.stages.start()

    def wait(self) -> None:
        self.stages.wait()

    def stop(self) -> None:
        if self.stages is not None:
            self.stages.stop()

    def metrics(self) -> dict[str, Any]:
        return self.stages.metrics()

    def save(self, path: str) -> int | None:
        return self.stages.save(path)

    def close(self) -> dict[str, Any]:
        """Stop the stages and the server; return this process's spans (`Tracer.export`)."""
        self.stop()
        self.server.close()
        return self.tracer.export()


def start_stages(cfg: Any, store_path: Path | None) -> RayStages:
    """Runs in the trainer rank 0 actor: start the stages actor on this node (see the module docstring)."""
    import ray  # noqa: PLC0415
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: PLC0415

    from tidal.tools.config import to_yaml  # noqa: PLC0415

    here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
    actor_cls = ray.remote(num_cpus=0, max_concurrency=8, max_restarts=0)(StagesActor)
    actor = actor_cls.options(scheduling_strategy=here).remote(to_yaml(cfg), None if store_path is None else str(store_path))
    return RayStages(actor, ray.get(actor.where.remote()))


class RayStages:
    """The trainer's side of the stages actor: a `StageGroup`, and `.store`, a client of its store."""

    def __init__(self, actor: Any, where: dict[str, Any]) -> None:
        from tidal.flow.store.client import RemoteStore  # noqa: PLC0415

        self.actor = actor
        self.address, self.token, self.pid = where["address"], where["token"], where["pid"]
        self.store = RemoteStore(self.address, token=self.token)
        self._asked: Any = None  # the metrics call in flight
        self._next_ask = 0.0
        self._failed_rewards = 0
        self._closed = False

    def prepare(self, version: int, position: int) -> None:
        import ray  # noqa: PLC0415

        ray.get(self.actor.prepare.remote(version, position))

    def start(self) -> None:
        import ray  # noqa: PLC0415

        ray.get(self.actor.start.remote())

    def wait(self) -> None:
        """Until the stages end (after `stop`); their error, or the actor's death, is raised."""
        import ray  # noqa: PLC0415

        ray.get(self.actor.wait.remote())

    def stop(self) -> None:
        self.actor.stop.remote()

    def metrics(self) -> dict[str, Any]:
        """The stages' metrics without waiting for them (see `METRICS_EVERY_S`)."""
        import ray  # noqa: PLC0415

        waits: dict[str, float] = {}
        if self._asked is not None and ray.wait([self._asked], timeout=0)[0]:
            try:
                answer = ray.get(self._asked)
                self._failed_rewards, waits = answer["failed_rewards"], answer["wait_s"]
            except ray.exceptions.RayActorError:  # it died: `wait` says so, and the run ends
                pass
            self._asked = None
        now = time.monotonic()
        if self._asked is None and now >= self._next_ask:
            self._asked, self._next_ask = self.actor.metrics.remote(), now + METRICS_EVERY_S
        return {"failed_rewards": self._failed_rewards, "wait_s": waits}

    def save(self, path: str | Path) -> int | None:
        import ray  # noqa: PLC0415

        return ray.get(self.actor.save.remote(str(path)))

    def lost(self) -> bool:
        """Whether the actor died (the store and the stages' state with it)."""
        import ray  # noqa: PLC0415

        try:
            ray.get(self.actor.where.remote(), timeout=CLOSE_WAIT_S)
        except ray.exceptions.RayActorError:
            return True
        except ray.exceptions.GetTimeoutError:
            return False
        return False

    def close(self) -> dict[str, Any] | None:
        """Stop the actor and return its spans (None when it cannot answer: it died)."""
        import ray  # noqa: PLC0415

        if self._closed:
            return None
        self._closed = True
        self.store.close()
        try:
            return ray.get(self.actor.close.remote(), timeout=CLOSE_WAIT_S)
        except (ray.exceptions.RayError, TimeoutError):
            return None
        finally:
            ray.kill(self.actor)

"""The Ray runtime: the same workflow, its rollout workers as actors placed by `flow.placement`.

Under `runtime: ray` the trainer process (itself an actor on its placement) holds the
store and serves it over ZeroMQ (`StoreServer`); each rollout instance is a
`RolloutActor` on its own placement (or, when it time-shares the trainer's devices, on
the trainer's bundle with a seat at that bundle's `Turns` actor: `flow.colocate`)
running the same `RolloutWorker` loop the local runtime runs in a thread, talking to the
store through `RemoteStore`. Rows never go
through Ray's object store. Weights go from the trainer to every rollout actor over the
transport `hal.transfer.choose_transport` picks for the two platforms (host for NPU ->
GPU, collective for one vendor); each actor's receiver thread drops complete, checked
versions into its worker's inbox, applied at the next safe point.

Each actor selects its own hal platform from the `TIDAL_DEVICE` its placement gives it
(`fake:<kind>:<n>` when the recipe's cluster is fake), so one run holds NPU, GPU and
CPU processes. The placement groups and actor options come from `flow.ray.placement`.
Ray is imported only when the runtime is used.
"""

from __future__ import annotations

import collections
import concurrent.futures
import gc
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from tidal.flow.protocols import BuildsFromCheckpoint, PostsWeights
from tidal.flow.ray.faults import ActorLost, death_summary, num_restarts
from tidal.flow.ray.liveness import Liveness, transfer_timeout_s
from tidal.flow.ray.sends import QueuedSends
from tidal.flow.rollout import RolloutWorker, Stop
from tidal.flow.trace import Tracer

log = logging.getLogger(__name__)


def weights_device(engine: Any, *, shared: bool) -> torch.device | None:
    """Where a rollout actor's received versions wait for the next safe point: host memory
    on a device it time-shares (`shared`: a version arriving while the trainer computes takes
    none of its device memory; `load_weights` copies it in during the actor's turn) and for
    an engine whose model lives in processes of its own (`BuildsFromCheckpoint`, vLLM: its
    `load_weights` sends host tensors on, and a copy on this process's device would take the
    memory its KV cache was sized beside); else None, this process's device."""
    return torch.device("cpu") if shared or isinstance(type(engine), BuildsFromCheckpoint) else None


class RolloutActor:
    """Body of a rollout actor: one engine, its `RolloutWorker` loop, and a weight receiver.

    Args:
        make_engine: builds the rollout engine on this process's platform (a picklable function).
        store_address / store_token: the trainer's store server.
        settings: `group_size`, `max_new_tokens`, `prompts_per_generate`, `continuous` (continuous batching) and `sample_seed` (the run's seed: each generate call is seeded from it, `RolloutWorker.sample_seed`).
        turns / seat: the names of the `Turns` actors (one per trainer rank whose devices it
            uses, in rank order; `flow.colocate.turns_actor_name`: a restarted actor looks
            them up again) and this actor's seat name when it time-shares a trainer's devices
            (its engine then generates and loads weights in turns).
        hand_off: a borrowed (multiplexed) seat: groups paused because the trainer
            reclaimed the devices go back to the store for another instance to continue.
    """

    def __init__(self, make_engine: Callable[[], Any], *, store_address: str, store_token: str | None, settings: Mapping[str, Any], turns: Sequence[str] = (), seat: str = "rollout", hand_off: bool = False) -> None:
        from tidal.flow.store.client import RemoteStore  # noqa: PLC0415
        from tidal.hal import current_platform  # noqa: PLC0415

        self.platform = current_platform()  # from TIDAL_DEVICE, set by the placement
        self.started = time.time_ns()
        """Tells this incarnation from the one before a restart (`metrics`: counts start again at 0)."""
        self.engine = make_engine()
        self.weights_device = weights_device(self.engine, shared=bool(turns))
        self.sharing: Any = None
        if turns:
            from tidal.flow.colocate import Sharing, TurnsProxy, find_turns  # noqa: PLC0415
            from tidal.flow.turns import TurnsSpan  # noqa: PLC0415

            proxies = [TurnsProxy(t) for t in find_turns(turns)]
            self.sharing = Sharing(proxies[0] if len(proxies) == 1 else TurnsSpan(proxies), self.platform)
            self.engine = self.sharing.rollout(self.engine, seat)
        self.store = RemoteStore(store_address, token=store_token)
        self.stopping = threading.Event()
        self.tracer = Tracer()  # its spans go back with the summary, into the run's timeline
        self.worker = RolloutWorker(store=self.store, engine=self.engine, stopping=self.stopping, hand_off=hand_off, tracer=self.tracer, **settings)
        gc.collect()
        gc.freeze()  # the engine and what building it left are never scanned by the cyclic GC again (as the trainer does before its run)
        self._first = threading.Event()
        self._receiver: Any = None
        self._generation = 0  # of the weight receiver; a retired one's errors are expected
        self._errors: list[BaseException] = []
        self.num_versions = 0
        self.last_version: int | None = None
        self._received = threading.Condition()

    def describe(self) -> dict[str, Any]:
        """This actor's platform, node and process, as it sees them."""
        import os  # noqa: PLC0415

        import ray  # noqa: PLC0415

        context = ray.get_runtime_context()
        var = self.platform.descriptor.visible_devices_var
        return {
            "platform": self.platform.descriptor.to_dict(),
            "node": context.get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "pid": os.getpid(),
            "placement_group": context.get_placement_group_id(),
            "resources": context.get_assigned_resources(),
            "visible_devices": {var: os.environ.get(var)} if var else {},
            "restarts": num_restarts(),  # by Ray, so far: a death while the trainer warmed up counts too
            "torch": torch.__version__,  # another build than the trainer's (a vLLM environment's own torch): weights cross over host
        }

    def ping(self) -> None:
        """Answers at once: the trainer's liveness check (`flow.ray.liveness`)."""

    def retire_receiver(self) -> None:
        """The trainer is rebuilding the weight group (another actor restarted): the current
        receiver's coming failure is expected; the next `open_receiver` starts a new one."""
        self._generation += 1
        self._receiver = None

    def open_receiver(self, transport: str, *, bind_host: str | None = None, **params: Any) -> str | None:
        """Start receiving weights over `transport` (a new receiver replaces the old one);
        returns the address the trainer's sender connects to, or None where the sender
        does not connect (a `collective` group: its members join it).

        `bind_host` (host, ipc): the interface to listen on, any free port; `params`: the
        rest of the transport's receiver arguments (`token`; a group's `host`, `port`,
        `rank`, `num_receivers`)."""
        from tidal.hal.transfer import JoinsGroup, expected_specs, receiver_class  # noqa: PLC0415

        expected = expected_specs(self.engine.named_weights())
        if bind_host is not None:
            params["bind"] = f"tcp://{bind_host}:0"
        receiver: Any = receiver_class(transport)(self.platform, expected=expected, device=self.weights_device, **params)
        self._receiver = receiver
        if not isinstance(receiver, JoinsGroup):
            self._start_receiving(receiver, self._next_version(receiver, expected))
            return receiver.address
        transfer_s = transfer_timeout_s(sum(spec.nbytes for spec in expected.values()))
        group: Any = receiver  # a group member that receives with two timeouts (`CollectiveReceiver`)

        def join_and_receive() -> Any:
            group.join()  # once: blocks until every member joined
            # one wait for the version to start (a timed-out broadcast leaves the group out of step: no shorter waits in a loop)
            return group.receive(timeout_s=NEXT_VERSION_S, transfer_s=transfer_s)

        self._start_receiving(group, join_and_receive)
        return None

    def _next_version(self, receiver: Any, expected: Mapping[str, Any]) -> Callable[[], Any]:
        """`receive()` for a receiver of `expected`'s tensors: the next version, or None once
        stopping. Waiting for the trainer to start it has no bound here (a long step, an
        evaluation or a checkpoint may come first; liveness notices a trainer that stopped
        answering); once started, it must arrive within `transfer_timeout_s` of its size. A
        receiver that cannot wait apart from receiving waits `NEXT_VERSION_S` for both."""
        from tidal.hal.transfer import WaitsForVersions  # noqa: PLC0415

        if not isinstance(receiver, WaitsForVersions):
            return lambda: receiver.receive(timeout_s=NEXT_VERSION_S)
        transfer_s = transfer_timeout_s(sum(spec.nbytes for spec in expected.values()))

        def receive() -> Any:
            while not receiver.wait(STOP_CHECK_S):
                if self.stopping.is_set():
                    return None
            return receiver.receive(timeout_s=transfer_s)

        return receive

    def _start_receiving(self, receiver: Any, receive: Callable[[], Any]) -> None:
        """Apply what `receive()` gets from `receiver` on a thread of its own, the receiver's
        only user, which closes it when it ends (a ZeroMQ socket is closed by its thread)."""
        self._generation += 1
        generation = self._generation

        def loop() -> None:
            try:
                receive_all()
            finally:
                receiver.close()

        def receive_all() -> None:
            while not self.stopping.is_set():
                try:
                    weights = receive()
                except Exception as e:  # noqa: BLE001 - reported by run()
                    if generation != self._generation:
                        return  # retired: its group was torn down on purpose
                    if not self.stopping.is_set():
                        with self._received:
                            self._errors.append(e)
                            self._received.notify_all()
                        self.worker.stop()
                    self._first.set()
                    return
                if generation != self._generation:
                    return
                if weights is None:  # stopping
                    continue
                if self.last_version is not None and weights.version <= self.last_version:
                    continue  # sent again for an actor that restarted: this one has it (applying it again would pause a generation for nothing)
                self.worker.inbox.offer(weights.version, weights.tensors)
                with self._received:
                    self.num_versions += 1
                    self.last_version = weights.version
                    self._received.notify_all()
                self._first.set()

        threading.Thread(target=loop, name="tidal-weights", daemon=True).start()

    def run(self) -> dict[str, Any]:
        """Generate until stopped; returns counts. Waits for the first weights before generating
        (or for `stop`: an actor restarted as the run ended gets none)."""
        self._first.wait()
        if self._errors:
            raise self._errors[0]
        if not self.stopping.is_set():
            self.worker.apply_weights()
            try:
                self.worker.run()
            except Stop:
                pass
            except Exception:
                if not self.stopping.is_set():
                    raise
        if self._errors:
            raise self._errors[0]
        return {
            "samples": self.worker.num_samples,
            "paused_generations": self.worker.num_paused,
            "handed_off": self.worker.num_handed_off,
            "versions_received": self.num_versions,
            "last_version_received": self.last_version,
            "versions_applied": self.worker.versions_applied,
            "version": self.engine.version,
            "platform": self.platform.descriptor.to_dict(),
            "timeshare": self.sharing.summary() if self.sharing is not None else None,
            "timeline": self.tracer.export(),
        }

    def stop(self, last_version: int | None = None) -> None:
        """Stop generating. With `last_version` (the last version the trainer sent), first wait
        up to `SEND_ON_STOP_S` for it to arrive: a send can complete at the trainer's end while
        this end still reads it, and the run's last update should be received, not cut off."""
        if last_version is not None:
            with self._received:
                self._received.wait_for(lambda: (self.last_version is not None and self.last_version >= last_version) or bool(self._errors), SEND_ON_STOP_S)
        self.worker.stop()
        self._first.set()  # a `run` still waiting for its first version returns

    def metrics(self) -> dict[str, Any]:
        return {"paused_generations": self.worker.num_paused, "handed_off": self.worker.num_handed_off, "wait_s": self.worker.waits.take(), "samples": self.worker.num_samples, "started": self.started}


NEXT_VERSION_S = 24 * 3600.0
"""How long a weight receiver waits for the trainer to start the next version where it cannot
wait apart from receiving (`collective`): in effect no bound, as a
step, an evaluation or a checkpoint may come first; liveness notices a trainer that stopped
answering (`fault.liveness_s`)."""
STOP_CHECK_S = 1.0
"""How often a receiver waiting for the next version looks whether the actor is stopping."""
DEATH_NOTICE_S = 120.0
"""How long a failed weight send waits for a dead rollout actor to be back (then it is retried)."""
SEND_ON_STOP_S = 10.0
"""How long stopping waits for the last version to be sent (`transport.overlap`) and, at
each rollout actor, to arrive, before it stops anyway."""
RESTART_WAIT_S = 90.0
"""How long a dead rollout actor may take to restart (build its engine) before the run fails."""
ACTOR_TOTALS = ("paused_generations", "handed_off")
"""What each rollout actor counts (`RolloutActor.metrics`), of `ROLLOUT_TOTALS`; `RayRollouts`
counts `silent_rollouts` itself."""
METRICS_EVERY_S = 0.5
"""How often the trainer asks the rollout actors for their metrics (and looks for the
answers): each Ray call and check of its answer costs the trainer's step time, so it is
not made every step."""


class RayRollouts:
    """`RolloutGroup` over rollout actors: runs their loops, sends them each version's weights.

    A rollout actor that dies is restarted by Ray (up to `max_restarts` times, counted per
    actor); its store connection closes, so the prompts it held are redelivered, and it
    rejoins the weight transport and generates again once a version reaches it: the next
    one published, or the current one sent again when the trainer waits for rows
    (`weights_wanted`). Ray's count of an actor's restarts is where the count starts: a
    death while the trainer warmed up (before this group existed) used one of them.
    An actor that answers no ping for `liveness_s` is reported, and killed (a death, as
    above) when silent `grace_s` longer (`flow.ray.liveness`; 0 turns the checks off).
    `on_change(descriptions)` is told each actor's description after a restart.
    `on_death(i)` is told that actor `i` died and will not generate again (no restarts
    left, it did not come back, or the run is ending): a seat it held at a trainer's
    `Turns` must leave, else the trainer's next turn waits for ever for its state to park.
    An actor Ray restarts is not told: its new process joins the seat again, which drops
    the old process's claims (`Turns.join`); a `leave` that reached the `Turns` after that
    join would drop the new process's.
    """

    def __init__(
        self,
        actors: Sequence[Any],
        wiring: Any,
        *,
        max_restarts: int = 0,
        on_change: Callable[[list[dict[str, Any]]], None] | None = None,
        on_death: Callable[[int], None] | None = None,
        overlap: bool = False,
        liveness_s: float = 0.0,
        grace_s: float = 0.0,
    ) -> None:
        import ray  # noqa: PLC0415

        self.actors, self.wiring, self.max_restarts = list(actors), wiring, max_restarts
        self.descriptions: list[dict[str, Any]] = ray.get([a.describe.remote() for a in self.actors])
        self.summaries: list[dict[str, Any]] = [{} for _ in self.actors]
        self.restarts = [d.get("restarts", 0) for d in self.descriptions]
        for i, n in enumerate(self.restarts):
            if n:
                log.warning("rollout actor %d died before the trainer connected to it (while it warmed up); Ray restarted it (%d of %d)", i, n, max_restarts)
        self.liveness = Liveness(self.actors, lambda i: f"rollout actor {i} (pid {self.descriptions[i].get('pid', '?')})", silent_s=liveness_s, grace_s=grace_s)
        self._on_change = on_change or (lambda descriptions: None)
        self._on_death = on_death or (lambda i: None)
        self._lock = threading.Lock()  # the wiring is used by publish (trainer thread) only under it
        self._restarted: set[int] = set()  # back from a restart, not wired in yet
        self._restarted_lock = threading.Lock()
        self._died = threading.Event()
        self._gave_up: str | None = None  # why a dead actor will not come back (no restarts left)
        self._stopping = threading.Event()
        self._posts = overlap and isinstance(wiring, PostsWeights)
        """Sends are posted (`ipc`): written and announced, the answers collected on the next send."""
        self._queued = QueuedSends(self._send) if overlap and not self._posts else None
        self._last_sent: int | None = None  # the last version every actor was sent
        self._wanted: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._wanted_lock = threading.Lock()
        self._metrics_asked: list[Any] = []  # requests not answered yet
        self._metrics_next = 0.0  # when `metrics` next calls Ray (time.monotonic)
        self._counts = dict.fromkeys(ACTOR_TOTALS, 0)
        self._answered: list[dict[str, Any] | None] = [None] * len(self.actors)  # each actor's latest answer
        self._before_restarts = dict.fromkeys(ACTOR_TOTALS, 0)  # what actors counted before they were restarted
        self.wiring.attach(self.actors, range(len(self.actors)))

    def run(self) -> None:
        import ray  # noqa: PLC0415

        running = {a.run.remote(): i for i, a in enumerate(self.actors)}
        while running:
            done, _ = ray.wait(list(running), timeout=self.liveness.every_s if self.liveness.on else None)
            if not done:  # none ended: look for the silent
                for i in [] if self._stopping.is_set() else self.liveness.check():
                    ray.kill(self.actors[i], no_restart=False)  # its `run` fails: the death below
                continue
            i = running.pop(done[0])
            try:
                self.summaries[i] = ray.get(done[0])
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
                if self._stopping.is_set():
                    self._dead(i)  # the trainer's last turns (its final checkpoint's) must not wait for it
                    continue
                self.restarts[i] += 1
                why = "killed after it stopped answering (fault.liveness_s)" if i in self.liveness.killed else death_summary(e)
                if self.restarts[i] > self.max_restarts:
                    raise self._give_up(f"rollout actor {i} died {self.restarts[i]} times (fault.rollout_restarts={self.max_restarts}): {why}", dead=i) from None
                log.warning("rollout actor %d died (%s); Ray restarts it (%d of %d)", i, why, self.restarts[i], self.max_restarts)
                self.wiring.abort()  # a send blocked on the dead receiver gives up
                try:
                    self.descriptions[i] = self._back(i)
                except ray.exceptions.RayActorError as back:  # its new process failed to start
                    raise self._give_up(f"rollout actor {i} died, and Ray could not restart it (restart {self.restarts[i]} of {self.max_restarts}): {death_summary(back)}", dead=i) from None
                except RuntimeError as back:  # not back in time
                    raise self._give_up(str(back), dead=i) from None
                self.restarts[i] = max(self.restarts[i], self.descriptions[i].get("restarts", 0))  # Ray's count: a death not seen here counts too
                self.liveness.reset(i)
                if self._stopping.is_set():  # the run ended while Ray restarted it: nothing to generate for
                    self.actors[i].stop.remote()
                    continue
                with self._restarted_lock:
                    self._restarted.add(i)
                self._died.set()  # the next publish wires it in again ...
                with self._wanted_lock:  # ... which a trainer waiting for rows makes at once, of its current version
                    if not self._wanted.done():
                        self._wanted.set_result(None)
                running[self.actors[i].run.remote()] = i  # generates once the next version reaches it
        raise Stop  # the actors return only when stopped

    def publish(self, version: int, named_weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Send `version` to every actor. A `WeightSource` (what the train engines'
        `named_weights()` return) streams bucket by bucket, and a send that failed because an
        actor died makes a second pass over it; a plain iterable is listed first.

        With `overlap`, the caller does not wait for the receivers: rollout still generates
        each prompt with the version that admitted it or a newer one (it waits for it:
        `RolloutWorker._catch_up`), so only the trainer's wait for the receivers goes.
        Over a transport that can post (`ipc`) the weights are written into the shared
        buffer here and announced, and the receivers' answers are collected before the
        next version is written. Otherwise they are copied here (one pass over the source,
        in the caller's thread, so a sharded engine's ranks stay in step) and
        `QueuedSends`' thread sends the copy while the caller trains on; a version not sent
        yet when a newer one comes is replaced by it, and the copy costs one model's
        memory on the trainer's device. Either way a failed send is raised by the next
        `publish` or `flush`.
        """
        from tidal.hal.transfer import snapshot, weight_source  # noqa: PLC0415

        with self._wanted_lock:
            if self._wanted.done():  # this send wires the restarted actors in
                self._wanted = concurrent.futures.Future()
        if self._queued is None:
            self._send(version, weight_source(named_weights), post=self._posts)
        else:
            self._queued.put(version, weight_source(snapshot(weight_source(named_weights))))

    def weights_wanted(self) -> concurrent.futures.Future[None]:
        """Completes when a rollout actor came back from a restart and has no version to
        generate with until one is published (the workflow's trainer, waiting for rows,
        then publishes its current version again); the next `publish` starts a new one."""
        with self._wanted_lock:
            return self._wanted

    @property
    def versions_replaced(self) -> int:
        """Published versions not sent because a newer one came first (`overlap` only)."""
        return 0 if self._queued is None else self._queued.replaced

    def flush(self) -> None:
        """Wait until every published version has been sent (with `overlap`; a posted one:
        taken by every receiver); raise a send's error."""
        if self._queued is not None:
            self._queued.flush()
        elif self._posts:
            with self._lock:
                self._collect()

    def _send(self, version: int, source: Any, *, post: bool = False) -> None:
        with self._lock:
            if post and self._stopping.is_set():
                return  # the actors were told to stop: none would take it, and `stop` waited for the last one
            if post:
                self._collect()  # the version before is in: the shared buffer may be written again
            if self._died.is_set():
                self._rejoin()
            try:  # `wiring.sender` is read after each `_rejoin`: `CollectiveWiring.attach` replaces it
                (self.wiring.post if post else self.wiring.sender.send)(version, source)
            except Exception:
                if not self._died.wait(DEATH_NOTICE_S):
                    raise
                self._rejoin()
                (self.wiring.post if post else self.wiring.sender.send)(version, source)
            self._last_sent = version

    def _collect(self) -> None:
        """The answers to the version posted last; a receiver that died meanwhile is
        replaced and the new one is sent that version (still in the buffer)."""
        try:
            self.wiring.collect()
        except Exception:
            if not self._died.wait(DEATH_NOTICE_S):
                raise
            self._rejoin()
            self.wiring.post_again()
            self.wiring.collect()

    def _back(self, i: int) -> dict[str, Any]:
        """Actor `i`'s description once Ray has restarted it."""
        import ray  # noqa: PLC0415

        deadline = time.monotonic() + RESTART_WAIT_S
        while True:
            try:
                return ray.get(self.actors[i].describe.remote())
            except ray.exceptions.ActorUnavailableError:  # still restarting
                if time.monotonic() > deadline:
                    raise RuntimeError(f"rollout actor {i} did not come back within {RESTART_WAIT_S:.0f}s of dying") from None
                time.sleep(0.2)  # Ray answers at once while the actor restarts and has no event for "back": ask again (control path, not rows)

    def _give_up(self, why: str, *, dead: int) -> ActorLost:
        """Actor `dead` will not come back: a send blocked on it, or waiting to hear of its
        death to wire its replacement in, fails now (it waited the reply timeout, then
        `DEATH_NOTICE_S`, about four minutes) with `why`, which is returned to raise; a
        trainer turn waiting for its seat is freed (`on_death`)."""
        self._dead(dead)
        self._gave_up = why
        self._died.set()
        self.wiring.abort()
        return ActorLost(why)

    def _dead(self, i: int) -> None:
        """Tell `on_death` that actor `i` is gone; its failure is logged, not raised (the
        actor's death is the error the run reports)."""
        try:
            self._on_death(i)
        except Exception as e:  # noqa: BLE001 - see above
            log.warning("rollout actor %d died and its seat could not be given up: %s: %s", i, type(e).__name__, e)

    def _rejoin(self) -> None:
        """Wire the restarted actors in again."""
        if self._gave_up is not None:
            raise ActorLost(self._gave_up)
        self._died.clear()
        with self._restarted_lock:
            restarted, self._restarted = sorted(self._restarted), set()
        self.wiring.attach(self.actors, restarted)
        self._on_change(self.descriptions)

    def stop(self) -> None:
        if self._posts and not self._stopping.is_set():
            with self._lock:
                try:
                    self.wiring.collect(timeout_s=SEND_ON_STOP_S)  # the last version reaches rollout, as it does without overlap
                except Exception as e:  # noqa: BLE001 - the run is over; the next run starts from a checkpoint
                    log.warning("the last weight version posted to rollout was not taken as the run ended: %s", e)
        if self._queued is not None:
            if not self._queued.drain(SEND_ON_STOP_S):  # the last version reaches rollout, as it does without overlap
                log.warning("a weight version was still being sent to rollout %.0fs after the run ended; stopping without it", SEND_ON_STOP_S)
            elif self._queued.error is not None:
                log.warning("the last weight send to rollout failed as the run ended: %s", self._queued.error)
            self._queued.close()
        self._stopping.set()
        with self._restarted_lock:
            unwired = set(self._restarted)  # back from a restart and sent nothing since: no version to wait for
        for i, a in enumerate(self.actors):
            a.stop.remote(None if i in unwired else self._last_sent)

    def metrics(self) -> dict[str, Any]:
        """The actors' metrics without waiting for them: every `METRICS_EVERY_S` a call
        looks for the answers to the last request and asks again (once it is answered),
        and every call returns the answers that are in, so the trainer's step never waits
        on an actor busy generating and only some steps pay for the calls. The counts are the latest answered (over restarts: `_count`); wait times show up
        in the step whose call collected them."""
        import ray  # noqa: PLC0415

        answers: list[dict[str, Any]] = []
        now = time.monotonic()
        if now < self._metrics_next:
            return {**self._counts, "silent_rollouts": self.liveness.num_silences, "wait_s": {}}
        self._metrics_next = now + METRICS_EVERY_S
        if self._metrics_asked:
            ready, _ = ray.wait(self._metrics_asked, num_returns=len(self._metrics_asked), timeout=0)
            if len(ready) == len(self._metrics_asked):
                try:
                    answers = ray.get(self._metrics_asked)
                except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
                    answers = []  # one is restarting: its metrics since the last answer are lost
                self._metrics_asked = []
        if not self._metrics_asked:
            self._metrics_asked = [a.metrics.remote() for a in self.actors]
        wait_s: dict[str, float] = collections.defaultdict(float)
        if answers:
            self._count(answers)
        for m in answers:
            for k, v in m["wait_s"].items():
                wait_s[k] += v / len(self.actors)
        return {**self._counts, "silent_rollouts": self.liveness.num_silences, "wait_s": dict(wait_s)}

    def _count(self, answers: list[dict[str, Any]]) -> None:
        """The counts so far over every actor and its earlier incarnations: a restarted actor
        counts from 0 again (what it counted between its last answer and its death is lost)."""
        for i, answer in enumerate(answers):
            last = self._answered[i]
            if last is not None and last.get("started") != answer.get("started"):
                for key in ACTOR_TOTALS:
                    self._before_restarts[key] += last[key]
            self._answered[i] = answer
        self._counts = {key: self._before_restarts[key] + sum(m[key] for m in self._answered if m is not None) for key in ACTOR_TOTALS}

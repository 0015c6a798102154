"""The Ray runtime (`runtime: ray`): everything that starts, places, feeds and watches
actors, in one package.

- `placement`: a `flow.placement.Plan` as Ray placement groups and actor options
  (node pinning, device-kind tags, fake devices), joining or starting a Ray cluster, and
  the check that a guest spanning trainer ranks has them on one node.
- `trainer`: the `TrainerActor` (one trainer rank: pings, where it runs, the ranks'
  process group, a follower's seats; what it computes comes in as callables, `lead` and
  `follow`) and the driver's wait on the ranks (`wait_ranks`: rank 0's error first).
- `runtime`: the `RolloutActor` (the same `RolloutWorker` loop the local runtime runs in
  a thread, against the trainer's store over ZeroMQ) and the trainer's `RayRollouts`
  (runs the actors' loops, sends each version's weights, restarts actors Ray brought back).
- `rollouts`: what rank 0's `train()` is handed to start the rollout actors and wire the
  weights to them (`start_rollouts`, `StartedRollouts.connect`, `RemoteRollouts`).
- `wiring`: one weight wiring per transport (`make_wiring`), over
  `tidal.hal.transfer`'s senders and receivers.
- `sends`: the trainer's queued sends (`transport.overlap`).
- `liveness`: the trainer's pings of its actors and transfer timeouts.
- `faults`: Ray's errors as one line naming the actor and the cause.

Ray itself is imported only inside functions that need it: importing this package does
not load Ray. Nothing here knows a recipe or an engine: `tools/ray_run.py` is the glue
`tidal run` needs on top (the recipe's settings, the rollout engine's builder, the trainer
ranks' bodies, the driver's loop).
"""
